import pytest
from django.db import connection

from django_txqueue import conf
from django_txqueue.checks import check_settings, check_sqlite_transactions


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
    "value",
    [
        {"LEASE": 0},
        {"LEASE": "5"},
        {"MAX_ATTEMPTS": 1.5},
        {"CLAIM_STRATEGY": "fastest"},
        {"DATABASE": "nowhere"},
        {"QUEUES": []},
        {"QUEUES": {"sms": {"MAX_SIZE": -1}}},
        {"QUEUES": {"": {}}},
    ],
)
def test_bad_values_are_errors(settings, value):
    found = messages(settings, value)
    assert found and all(msg_id.startswith("txqueue.E") for msg_id, _, _ in found)


def test_not_a_dict(settings):
    assert messages(settings, ["LEASE"])[0][0] == "txqueue.E001"


def test_fair_and_ordered_are_unknown_until_implemented(settings):
    found = messages(settings, {"QUEUES": {"t": {"FAIR": True, "ordered": True}}})
    assert [m[0] for m in found] == ["txqueue.E005", "txqueue.E005"]


def test_per_queue_overrides_accept_lower_case(settings):
    settings.TXQUEUE = {"LEASE": 30, "QUEUES": {"sms": {"lease": 5}}}
    assert conf.queue_option("sms", "LEASE") == 5
    assert conf.queue_option("email", "LEASE") == 30
    assert conf.queue_option("email", "MAX_ATTEMPTS") == 5


@pytest.mark.skipif(not hasattr(connection, "transaction_modes"), reason="SQLite only option")
def test_sqlite_without_immediate_transactions_is_warned(monkeypatch):
    assert check_sqlite_transactions() == []
    monkeypatch.setitem(connection.settings_dict["OPTIONS"], "transaction_mode", None)
    [warning] = check_sqlite_transactions()
    assert warning.id == "txqueue.W002" and "IMMEDIATE" in warning.hint
