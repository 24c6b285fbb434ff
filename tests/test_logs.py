"""Logs that tools can read (docs/tracing.md): each line a consumer writes about an item
carries its queue, id, attempt and the consumer as ``extra`` fields, and a handler's
exception is logged once, with its traceback."""

import json
import logging

import pytest

from django_txqueue import Queue
from django_txqueue.observe.logs import about, counted
from django_txqueue.tasks.backend import TASKS_FRAMEWORK, run_task
from tests.helpers import run_until_finished

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fast_consumers")]

FIELDS = ("queue", "item_id", "attempt", "consumer")


class SeatTaken(Exception):
    pass


def handler(item):
    if item.payload.get("fail"):
        raise SeatTaken(f"seat {item.payload['seat']} is taken")
    return "booked"


def drain(queue_name, handle=handler):
    return run_until_finished(queue_name, handle)


def about_items(caplog):
    """The records that name an item, as ``(level, {field: value})``."""
    return [
        (record.levelname, {name: getattr(record, name) for name in FIELDS})
        for record in caplog.records
        if hasattr(record, "item_id")
    ]


def test_a_failing_and_a_succeeding_item_are_logged_with_their_fields(caplog):
    ok = Queue("logged").enqueue({"seat": "1A"})
    failing = Queue("logged").enqueue({"seat": "2B", "fail": True}, max_attempts=2)
    with caplog.at_level(logging.DEBUG, logger="django_txqueue"):
        worker = drain("logged")

    fields = {"queue": "logged", "consumer": worker.identity}
    assert sorted(
        about_items(caplog), key=lambda pair: (pair[1]["item_id"], pair[1]["attempt"])
    ) == [
        ("DEBUG", {**fields, "item_id": ok.pk, "attempt": 1}),
        ("WARNING", {**fields, "item_id": failing.pk, "attempt": 1}),  # will retry
        ("ERROR", {**fields, "item_id": failing.pk, "attempt": 2}),  # failed for good
    ]


def test_the_handlers_exception_is_logged_once_with_its_traceback(caplog):
    failing = Queue("logged").enqueue({"seat": "2B", "fail": True}, max_attempts=1)
    with caplog.at_level(logging.DEBUG):  # every logger: the consumer's, Django's...
        drain("logged")

    assert caplog.text.count("Traceback (most recent call last)") == 1
    assert caplog.text.count("seat 2B is taken") == 2  # the line's summary, the traceback's
    [record] = [r for r in caplog.records if r.exc_info]
    assert record.levelno == logging.ERROR
    assert record.item_id == failing.pk
    assert isinstance(record.exc_info[1], SeatTaken)
    assert 'raise SeatTaken(f"seat' in caplog.text  # the handler's own line


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Tasks framework")
def test_a_failing_django_task_is_logged_once_by_the_consumer(caplog):
    """Django's Tasks framework logs each failed attempt on ``django.tasks`` too, with the
    traceback (its contract: Django's own suite checks it, scripts/upstream_tasks.py);
    the consumer's loggers log it once per attempt, with the item's fields."""
    from tests.testapp import tasks

    result = tasks.boom.enqueue("no seat")
    item_id = int(result.id)
    with caplog.at_level(logging.DEBUG):
        drain(tasks.boom.queue_name, run_task)

    ours = [r for r in caplog.records if r.name.startswith("django_txqueue") and r.exc_info]
    assert ours and all(r.item_id == item_id for r in ours)
    assert [r.attempt for r in ours] == list(range(1, len(ours) + 1))
    djangos = [r for r in caplog.records if r.name == TASKS_FRAMEWORK and r.exc_info]
    assert len(djangos) == len(ours)


def test_the_fields_are_no_log_record_attributes_and_reach_a_json_formatter(db):
    item = Queue("logged").enqueue({})
    extra = about(item)
    assert set(extra) == set(FIELDS)
    builtin = set(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}
    assert not set(extra) & builtin
    record = logging.getLogger("django_txqueue.settle").makeRecord(
        "django_txqueue.settle", logging.WARNING, __file__, 1, "x", (), None, extra=extra
    )

    class JSONFormatter(logging.Formatter):  # as docs/tracing.md shows it
        def format(self, record):
            line = {"message": record.getMessage(), "level": record.levelname}
            line.update({name: getattr(record, name) for name in FIELDS if hasattr(record, name)})
            return json.dumps(line)

    assert json.loads(JSONFormatter().format(record)) == {
        "message": "x",
        "level": "WARNING",
        "queue": "logged",
        "item_id": item.pk,
        "attempt": 0,  # not claimed yet
        "consumer": "",
    }


def test_counts_are_written_in_the_singular_for_one():
    """Counts in the singular for one: "1 consumer", never "1 consumers"."""
    assert [counted(n, "consumer") for n in (0, 1, 2)] == [
        "0 consumers",
        "1 consumer",
        "2 consumers",
    ]
    assert counted(1, "once() record") == "1 once() record"
    assert counted(3, "entry", "entries") == "3 entries"
