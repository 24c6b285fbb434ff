import datetime as dt
import io

import pytest
from django.core.management import call_command
from django.db import connection

from django_txqueue import conf
from django_txqueue.checks import check_handlers, check_settings, check_sqlite_transactions
from django_txqueue.tasks.backend import TASKS_FRAMEWORK


def messages(settings, value):
    settings.TXQUEUE = value
    return [(m.id, m.msg, m.hint or "") for m in check_settings()]


def test_default_settings_are_clean(settings):
    assert messages(settings, {}) == []


def test_unknown_key_is_named_with_the_valid_ones(settings):
    [(msg_id, msg, hint)] = messages(settings, {"LEASSE": 10})
    assert msg_id == "txqueue.E002"
    assert "'LEASSE'" in msg
    for key in ("LEASE", "MAX_ATTEMPTS", "QUEUES", "CLAIM_STRATEGY"):
        assert key in hint


def test_unknown_per_queue_key(settings):
    [(msg_id, msg, hint)] = messages(settings, {"QUEUES": {"sms": {"lease": 5, "retries": 3}}})
    assert msg_id == "txqueue.E005"
    assert "'retries'" in msg and "sms" in msg
    assert "MAX_ATTEMPTS" in hint


@pytest.mark.parametrize(
    ("value", "msg_id", "names"),
    [
        ({"LEASE": 0}, "txqueue.E003", ["TXQUEUE['LEASE'] is 0", "positive number"]),
        ({"LEASE": "5"}, "txqueue.E003", ["TXQUEUE['LEASE'] is '5'", "positive number"]),
        ({"MAX_ATTEMPTS": 1.5}, "txqueue.E003", ["TXQUEUE['MAX_ATTEMPTS'] is 1.5", "integer"]),
        (
            {"CLAIM_STRATEGY": "fastest"},
            "txqueue.E003",
            ["TXQUEUE['CLAIM_STRATEGY'] is 'fastest'", "auto, skip_locked, update_limit"],
        ),
        (
            {"DATABASE": "nowhere"},
            "txqueue.E003",
            ["TXQUEUE['DATABASE'] is 'nowhere'", "settings.DATABASES"],
        ),
        ({"QUEUES": []}, "txqueue.E003", ["TXQUEUE['QUEUES'] is []", "dict"]),
        (
            {"LISTEN_DATABASES": {"default": "direct"}},
            "txqueue.E003",
            ["TXQUEUE['LISTEN_DATABASES'] is {'default': 'direct'}", "settings.DATABASES"],
        ),
        (
            {"LISTEN_DATABASES": "default"},
            "txqueue.E003",
            ["TXQUEUE['LISTEN_DATABASES'] is 'default'", "dict of database alias"],
        ),
        (
            {"QUEUES": {"sms": {"MAX_SIZE": -1}}},
            "txqueue.E003",
            ["TXQUEUE['QUEUES']['sms']['MAX_SIZE'] is -1", "positive integer"],
        ),
        (
            {"QUEUES": {"sms": {"rescue": "never"}}},
            "txqueue.E003",
            ["TXQUEUE['QUEUES']['sms']['rescue'] is 'never'", "'retry' or 'fail'"],
        ),
        ({"RETENTION": 0}, "txqueue.E003", ["TXQUEUE['RETENTION'] is 0", "timedelta"]),
        ({"RETENTION": "7d"}, "txqueue.E003", ["TXQUEUE['RETENTION'] is '7d'", "None"]),
        ({"RETENTION": True}, "txqueue.E003", ["TXQUEUE['RETENTION'] is True", "seconds"]),
        (
            {"RETENTION": dt.timedelta(0)},
            "txqueue.E003",
            ["TXQUEUE['RETENTION'] is datetime.timedelta(0)", "positive"],
        ),
        (
            {"RETENTION": dt.timedelta(days=36501)},
            "txqueue.E003",
            ["TXQUEUE['RETENTION'] is datetime.timedelta(days=36501)", "at most 36500 days"],
        ),
        ({"RETENTION": float("inf")}, "txqueue.E003", ["TXQUEUE['RETENTION'] is inf"]),
        (
            {"QUEUES": {"sms": {"retention": -1}}},
            "txqueue.E003",
            ["TXQUEUE['QUEUES']['sms']['retention'] is -1", "positive"],
        ),
        ({"PURGE_INTERVAL": 0}, "txqueue.E003", ["TXQUEUE['PURGE_INTERVAL'] is 0", "positive"]),
        ({"PURGE_INTERVAL": None}, "txqueue.E003", ["TXQUEUE['PURGE_INTERVAL'] is None"]),
        ({"QUEUES": {"": {}}}, "txqueue.E004", ["TXQUEUE['QUEUES']['']", "1 to 100"]),
        ({"QUEUES": {"sms": 30}}, "txqueue.E004", ["TXQUEUE['QUEUES']['sms']", "dict"]),
    ],
)
def test_bad_values_are_errors_naming_the_key_and_value(settings, value, msg_id, names):
    [(found_id, msg, _)] = messages(settings, value)
    assert found_id == msg_id
    for name in names:
        assert name in msg


@pytest.mark.parametrize(
    "value",
    [
        {"RETENTION": None},
        {"RETENTION": 3600},
        {"RETENTION": 0.5},
        {"RETENTION": dt.timedelta(days=30)},
        {"RETENTION": 36500 * 86400},
        {"PURGE_INTERVAL": 60},
        {"QUEUES": {"sms": {"RETENTION": None}, "email": {"retention": dt.timedelta(hours=1)}}},
    ],
)
def test_good_retention_values(settings, value):
    assert messages(settings, value) == []


def test_not_a_dict(settings):
    [(msg_id, msg, _)] = messages(settings, ["LEASE"])
    assert msg_id == "txqueue.E001"
    assert "TXQUEUE must be a dict, not list" in msg


@pytest.mark.parametrize("key", ["FAIR", "ordered"])
@pytest.mark.parametrize("value", [True, False])
def test_fair_and_ordered_take_a_flag(settings, key, value):
    assert messages(settings, {"QUEUES": {"t": {key: value}}}) == []


@pytest.mark.parametrize("key", ["FAIR", "ordered"])
@pytest.mark.parametrize("value", [1, "yes", None])
def test_fair_and_ordered_refuse_anything_but_a_flag(settings, key, value):
    [(msg_id, msg, _)] = messages(settings, {"QUEUES": {"t": {key: value}}})
    assert msg_id == "txqueue.E003"
    assert msg == f"TXQUEUE['QUEUES']['t'][{key!r}] is {value!r}; it must be True or False."


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_max_in_flight_per_key_takes_a_positive_integer(settings, value):
    [(msg_id, msg, _)] = messages(settings, {"QUEUES": {"t": {"MAX_IN_FLIGHT_PER_KEY": value}}})
    assert msg_id == "txqueue.E003"
    assert "it must be None or a positive integer" in msg


def test_ordered_with_more_than_one_in_flight_per_key_is_refused(settings):
    options = {"ordered": True, "max_in_flight_per_key": 3}
    [(msg_id, msg, hint)] = messages(settings, {"QUEUES": {"t": options}})
    assert msg_id == "txqueue.E006"
    assert "is ORDERED" in msg and "MAX_IN_FLIGHT_PER_KEY to 3" in msg
    assert (
        messages(settings, {"QUEUES": {"t": {"ORDERED": True, "MAX_IN_FLIGHT_PER_KEY": 1}}}) == []
    )


def test_fair_and_ordered_combine(settings):
    assert messages(settings, {"QUEUES": {"t": {"FAIR": True, "ORDERED": True}}}) == []


def test_per_queue_overrides_accept_lower_case(settings):
    settings.TXQUEUE = {"LEASE": 30, "QUEUES": {"sms": {"lease": 5}}}
    assert conf.queue_option("sms", "LEASE") == 5
    assert conf.queue_option("email", "LEASE") == 30
    assert conf.queue_option("email", "MAX_ATTEMPTS") == 5


@pytest.mark.requires("transaction_modes")
def test_sqlite_without_immediate_transactions_is_warned(monkeypatch):
    assert check_sqlite_transactions() == []
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "transaction_mode", None)
    [warning] = check_sqlite_transactions()
    assert warning.id == "txqueue.W002" and "IMMEDIATE" in warning.hint
    assert "DATABASES['default']" in warning.msg and "transaction_mode 'NONE'" in warning.msg


class TestQueuesWithoutHandler:
    """txqueue.W004: a configured queue that no handler serves."""

    @pytest.fixture(autouse=True)
    def tasks_with_listed_queues(self, settings):
        # The tests' TxQueueBackend lists its queues; one that takes any name ends the check.
        settings.TASKS = {
            "default": {
                "BACKEND": "django_txqueue.backends.TxQueueBackend",
                "QUEUES": ["default", "tasks-other"],
            }
        }

    def warnings(self, settings, value):
        settings.TXQUEUE = value
        return [(m.id, m.msg, m.hint) for m in check_handlers()]

    def test_a_configured_queue_without_handler_is_warned_once(self, settings):
        [(msg_id, msg, hint)] = self.warnings(
            settings, {"QUEUES": {"echo": {}, "emails": {"LEASE": 5}, "default": {}}}
        )
        assert msg_id == "txqueue.W004"
        assert msg.startswith("TXQUEUE['QUEUES']['emails'] names queue 'emails', which has no")
        assert "@handler('emails')" in hint and "SILENCED_SYSTEM_CHECKS" in hint

    def test_a_schedule_entrys_queue_without_handler_is_warned(self, settings):
        entries = {
            "nightly": {"QUEUE": "reports", "EVERY": 60},
            "ok": {"QUEUE": "echo", "EVERY": 1},
        }
        [(msg_id, msg, _)] = self.warnings(settings, {"SCHEDULE": entries})
        assert msg_id == "txqueue.W004" and "['nightly'] names queue 'reports'" in msg

    def test_queues_with_handlers_and_bad_names_say_nothing_here(self, settings):
        # echo: @handler in tests/testapp/queues.py, found by the check's autodiscovery;
        # 7 is E004's.
        assert self.warnings(settings, {"QUEUES": {"echo": {}, 7: {}}}) == []
        assert self.warnings(settings, {}) == []

    @pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Tasks framework")
    def test_a_tasks_backend_taking_any_queue_may_serve_it(self, settings):
        backend = {"BACKEND": "django_txqueue.backends.TxQueueBackend", "QUEUES": []}
        settings.TASKS = {"default": backend}
        assert self.warnings(settings, {"QUEUES": {"emails": {}}}) == []

    @pytest.mark.django_db(databases="__all__")  # model checks ask each database about JSON
    def test_manage_py_check_shows_it(self, settings):
        settings.SILENCED_SYSTEM_CHECKS = []  # tests/settings.py silences it for the others
        settings.TXQUEUE = {"QUEUES": {"emails": {}}}
        out = io.StringIO()
        call_command("check", stdout=out, stderr=out)
        assert (
            "?: (txqueue.W004) TXQUEUE['QUEUES']['emails'] names queue 'emails'" in out.getvalue()
        )
