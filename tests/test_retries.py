"""Retries by exception (docs/limits.md): ``@handler(..., retry_on=, discard_on=,
backoff=)`` and ``Snooze``, each through ``run_queue_consumer``."""

import datetime as dt

import pytest
from django.db.models.functions import Now

from django_txqueue import Queue, Snooze, Status, handler
from django_txqueue.checks import check_settings
from django_txqueue.consumer import registry
from django_txqueue.models import QueueItem

pytestmark = pytest.mark.django_db(transaction=True)


class ProviderBusy(Exception):
    pass


class BadNumber(ValueError):
    pass


@pytest.fixture
def handled(queue):
    """Register ``func`` for the test's queue with ``@handler``'s options; unregistered
    after the test."""

    def register(func, **options):
        handler(queue.name, **options)(func)
        return queue

    yield register
    registry.unregister(queue.name)


def stored(item):
    return QueueItem.objects.get(pk=item.pk)


def seconds_until_due(item):
    """How far in the future the item is due, by the database's clock."""
    row = QueueItem.objects.filter(pk=item.pk).annotate(now=Now()).values("run_at", "now").get()
    return (row["run_at"] - row["now"]).total_seconds()


def raising(exc):
    def handle(item):
        raise exc

    return handle


# -- discard_on and retry_on --------------------------------------------------------------


def test_an_exception_in_discard_on_ends_the_item_failed_at_once(handled, run_consumer):
    queue = handled(raising(BadNumber("not a phone number")), discard_on=ValueError)
    item = queue.enqueue({}, max_attempts=5)
    run_consumer(queue.name, "--burst")
    row = stored(item)
    assert (row.status, row.attempts) == (Status.FAILED, 1)
    assert row.error_class == "tests.test_retries.BadNumber"
    assert "not a phone number" in row.last_error


def test_only_exceptions_in_retry_on_are_retried(handled, run_consumer):
    failures = iter([ProviderBusy("busy"), KeyError("no such template")])

    def handle(item):
        raise next(failures)

    queue = handled(handle, retry_on=(ProviderBusy, TimeoutError), backoff=lambda n, exc: 0)
    item = queue.enqueue({}, max_attempts=5)
    run_consumer(queue.name, "--burst")
    row = stored(item)
    assert (row.status, row.attempts) == (Status.FAILED, 2)  # retried once, then KeyError
    assert row.error_class == "builtins.KeyError"


def test_discard_on_wins_over_retry_on(handled, run_consumer):
    queue = handled(raising(BadNumber("x")), retry_on=ValueError, discard_on=BadNumber)
    item = queue.enqueue({})
    run_consumer(queue.name, "--burst")
    assert stored(item).status == Status.FAILED


# -- backoff ----------------------------------------------------------------------------------


def test_backoff_gets_the_attempt_and_the_exception_and_sets_the_delay(handled, run_consumer):
    seen = []

    def backoff(attempt, exc):
        seen.append((attempt, type(exc).__name__))
        return 120 if isinstance(exc, ProviderBusy) else 0

    queue = handled(raising(ProviderBusy("slow down")), backoff=backoff)
    item = queue.enqueue({})
    run_consumer(queue.name, "--burst")
    assert seen == [(1, "ProviderBusy")]
    row = stored(item)
    assert (row.status, row.attempts) == (Status.READY, 1)
    assert 110 < seconds_until_due(item) <= 120


def test_a_backoff_may_return_a_timedelta(handled, run_consumer):
    queue = handled(raising(ProviderBusy()), backoff=lambda n, exc: dt.timedelta(minutes=5))
    item = queue.enqueue({})
    run_consumer(queue.name, "--burst")
    assert 290 < seconds_until_due(item) <= 300


def test_a_broken_backoff_is_logged_and_the_queues_back_off_used(handled, run_consumer, caplog):
    queue = handled(raising(ProviderBusy()), backoff=lambda n, exc: "soon")
    item = queue.enqueue({})
    run_consumer(queue.name, "--burst")
    assert stored(item).status == Status.READY  # retried all the same
    assert 0 < seconds_until_due(item) <= 11  # RETRY_DELAY 10, with jitter
    assert "the handler's backoff failed" in caplog.text
    assert "not seconds or a timedelta" in caplog.text


# -- Snooze -----------------------------------------------------------------------------------


def test_a_snooze_runs_the_item_later_without_using_an_attempt(handled, run_consumer):
    queue = handled(raising(Snooze(30)))
    item = queue.enqueue({}, max_attempts=1)
    run_consumer(queue.name, "--burst")
    row = stored(item)
    assert (row.status, row.attempts, row.snoozes) == (Status.READY, 0, 1)
    assert 25 < seconds_until_due(item) <= 30
    assert row.last_error == ""


def test_past_max_snoozes_a_snooze_uses_an_attempt(handled, run_consumer, settings):
    settings.TXQUEUE = {"QUEUES": {"snoozy": {"MAX_SNOOZES": 2}}}
    handler("snoozy")(raising(Snooze(0)))
    try:
        item = Queue("snoozy").enqueue({}, max_attempts=2)
        run_consumer("snoozy", "--burst")  # due at once: it runs until it is FAILED
    finally:
        registry.unregister("snoozy")
    row = stored(item)
    assert (row.status, row.snoozes, row.attempts) == (Status.FAILED, 2, 2)
    assert row.error_class == "django_txqueue.Snooze"
    assert "MAX_SNOOZES" in row.last_error


def test_item_snooze_puts_back_a_held_item(queue):
    item = queue.enqueue({})
    [held] = queue.claim(1, pid="me")
    assert held.snooze(60) is True
    assert held.snooze(60) is False  # no longer held
    row = stored(item)
    assert (row.status, row.attempts, row.snoozes) == (Status.READY, 0, 1)
    assert 55 < seconds_until_due(item) <= 60


def test_bad_input_is_refused_by_name(queue):
    with pytest.raises(ValueError, match="Snooze takes seconds"):
        Snooze(-1)
    with pytest.raises(ValueError, match="Snooze takes seconds"):
        queue.enqueue({}).snooze("later")
    with pytest.raises(TypeError, match="retry_on takes exception classes"):
        handler("q", retry_on="ValueError")
    with pytest.raises(TypeError, match="discard_on takes exception classes"):
        handler("q", discard_on=(ValueError, 3))
    with pytest.raises(TypeError, match="backoff must be a callable"):
        handler("q", backoff=5)


def test_max_snoozes_is_checked(settings):
    settings.TXQUEUE = {"MAX_SNOOZES": -1, "QUEUES": {"sms": {"MAX_SNOOZES": "ten"}}}
    found = [m.msg for m in check_settings() if m.id == "txqueue.E003"]
    assert "TXQUEUE['MAX_SNOOZES'] is -1; it must be an integer >= 0." in found
    assert "TXQUEUE['QUEUES']['sms']['MAX_SNOOZES'] is 'ten'; it must be an integer >= 0." in found
