"""django_txqueue.conf: the TXQUEUE setting read with defaults and per-queue overrides.

tests/settings.py sets TXQUEUE = {"QUEUES": {"bounded": {"MAX_SIZE": 3},
"short": {"LEASE": 1, "MAX_ATTEMPTS": 2}}}.
"""

from datetime import timedelta

import pytest
from django.test import override_settings

from django_txqueue import conf


class TestGet:
    def test_defaults_for_keys_the_project_did_not_set(self):
        for key, default in conf.DEFAULTS.items():
            if key != "QUEUES":
                assert conf.get(key) == default

    def test_the_projects_value_wins(self, settings):
        settings.TXQUEUE = {"LEASE": 42, "CLAIM_STRATEGY": "update_limit"}
        assert conf.get("LEASE") == 42
        assert conf.get("CLAIM_STRATEGY") == "update_limit"
        assert conf.get("MAX_ATTEMPTS") == 5

    def test_no_setting_at_all(self, settings):
        del settings.TXQUEUE
        assert conf.user_settings() == {}
        assert conf.get("LEASE") == 300
        assert conf.queue_option("short", "LEASE") == 300

    def test_a_setting_that_is_not_a_dict_is_ignored_here(self, settings):
        settings.TXQUEUE = ["not", "a", "dict"]  # the system check reports it (E001)
        assert conf.user_settings() == {}
        assert conf.get("MAX_ATTEMPTS") == 5

    def test_unknown_key_is_a_key_error(self):
        with pytest.raises(KeyError):
            conf.get("NO_SUCH_KEY")


class TestQueueOption:
    def test_override_else_top_level(self):
        assert conf.queue_option("short", "MAX_ATTEMPTS") == 2
        assert conf.queue_option("short", "LEASE") == 1
        assert conf.queue_option("bounded", "LEASE") == 300
        assert conf.queue_option("unconfigured", "MAX_ATTEMPTS") == 5

    def test_keys_without_a_top_level_default_are_none(self):
        assert conf.queue_option("bounded", "MAX_SIZE") == 3
        for key in ("MAX_SIZE", "RESCUE", "TIMEOUT"):
            assert conf.queue_option("unconfigured", key) is None

    def test_lower_case_keys(self, settings):
        settings.TXQUEUE = {
            "LEASE": 60,
            "QUEUES": {"sms": {"lease": 30, "max_attempts": 9, "Rescue": "fail", "timeout": 5}},
        }
        assert conf.queue_option("sms", "LEASE") == 30
        assert conf.queue_option("sms", "MAX_ATTEMPTS") == 9
        assert conf.queue_option("sms", "RESCUE") == "fail"
        assert conf.queue_option("sms", "TIMEOUT") == 5
        assert conf.queue_option("other", "LEASE") == 60

    def test_top_level_changes_reach_queues_without_their_own_value(self, settings):
        settings.TXQUEUE = {"MAX_ATTEMPTS": 7, "DATABASE": "default", "QUEUES": {"a": {}}}
        assert conf.queue_option("a", "MAX_ATTEMPTS") == 7
        assert conf.queue_option("a", "DATABASE") == "default"

    def test_empty_or_missing_queue_options(self, settings):
        settings.TXQUEUE = {"QUEUES": {"a": None}}
        assert conf.queue_option("a", "LEASE") == 300
        settings.TXQUEUE = {"QUEUES": None}
        assert conf.queue_option("a", "LEASE") == 300

    def test_unknown_queue_key_is_a_key_error(self):
        with pytest.raises(KeyError):
            conf.queue_option("short", "NO_SUCH_KEY")


class TestLease:
    def test_top_level_lease(self, settings):
        assert conf.lease() == timedelta(seconds=300)
        settings.TXQUEUE = {"LEASE": 2.5}
        assert conf.lease() == timedelta(seconds=2.5)

    def test_per_queue_lease(self, settings):
        assert conf.lease("short") == timedelta(seconds=1)
        assert conf.lease("unconfigured") == timedelta(seconds=300)
        settings.TXQUEUE = {"LEASE": 10, "QUEUES": {"sms": {"lease": 0.5}}}
        assert conf.lease("sms") == timedelta(seconds=0.5)
        assert conf.lease("other") == conf.lease() == timedelta(seconds=10)


class TestLeaseOverrides:
    def test_only_queues_whose_lease_differs(self, settings):
        assert conf.lease_overrides() == {"short": timedelta(seconds=1)}
        settings.TXQUEUE = {
            "LEASE": 60,
            "QUEUES": {
                "fast": {"lease": 5},
                "slow": {"LEASE": 600},
                "same": {"LEASE": 60},
                "none": {"MAX_ATTEMPTS": 1},
            },
        }
        assert conf.lease_overrides() == {
            "fast": timedelta(seconds=5),
            "slow": timedelta(seconds=600),
        }

    def test_none_when_no_queue_has_its_own(self, settings):
        settings.TXQUEUE = {"LEASE": 30}
        assert conf.lease_overrides() == {}


class TestReload:
    def test_override_settings_is_seen_and_undone(self):
        assert conf.get("POLL_INTERVAL") == 2
        with override_settings(TXQUEUE={"POLL_INTERVAL": 0.5, "QUEUES": {"x": {"lease": 3}}}):
            assert conf.get("POLL_INTERVAL") == 0.5
            assert conf.lease("x") == timedelta(seconds=3)
            assert conf.queue_option("short", "LEASE") == 300  # the whole dict is replaced
        assert conf.get("POLL_INTERVAL") == 2
        assert conf.lease("x") == timedelta(seconds=300)
        assert conf.queue_option("short", "LEASE") == 1

    def test_other_settings_keep_the_cache(self, settings):
        conf.get("LEASE")
        hits = conf._merged.cache_info().hits
        settings.DEBUG = not settings.DEBUG
        conf.get("LEASE")
        assert conf._merged.cache_info().hits == hits + 1

    def test_the_project_dict_is_not_changed(self, settings):
        raw = {"QUEUES": {"sms": {"lease": 30}}}
        settings.TXQUEUE = raw
        assert conf.queue_option("sms", "LEASE") == 30
        assert raw == {"QUEUES": {"sms": {"lease": 30}}}


class TestRetention:
    def test_seven_days_by_default(self, settings):
        settings.TXQUEUE = {}
        assert conf.retention() == timedelta(days=7)
        assert conf.retention("sms") == timedelta(days=7)
        assert conf.get("PURGE_INTERVAL") == 300

    def test_seconds_timedelta_none_and_per_queue(self, settings):
        settings.TXQUEUE = {
            "RETENTION": 3600,
            "QUEUES": {"keep": {"retention": None}, "short": {"RETENTION": timedelta(hours=1)}},
        }
        assert conf.retention() == timedelta(hours=1)
        assert conf.retention("other") == timedelta(hours=1)
        assert conf.retention("keep") is None
        assert conf.retention("short") == timedelta(hours=1)
        settings.TXQUEUE = {"RETENTION": None, "QUEUES": {"sms": {"RETENTION": 60}}}
        assert conf.retention() is None
        assert conf.retention("sms") == timedelta(minutes=1)

    def test_once_records_are_kept_for_the_longest_retention(self, settings):
        settings.TXQUEUE = {"RETENTION": 60, "QUEUES": {"long": {"RETENTION": 7200}}}
        assert conf.effect_retention() == timedelta(hours=2)
        settings.TXQUEUE = {"QUEUES": {"keep": {"RETENTION": None}}}
        assert conf.effect_retention() is None
        settings.TXQUEUE = {"RETENTION": None, "QUEUES": {"sms": {"RETENTION": 60}}}
        assert conf.effect_retention() is None
