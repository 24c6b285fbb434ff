"""A consumer's claims resume after its last claimed item (``resume``), on PostgreSQL,
where an old snapshot keeps the claimed rows' READY index entries, and on MySQL and
MariaDB, where stepping over them until purge removes them is slow; they read from the
head when a resumed claim finds nothing, after a short claim, and at least every
FULL_CLAIM_EVERY seconds."""

import re
import time

import pytest
from django.db import connection

from django_txqueue import Queue
from django_txqueue.consumer.claims import FULL_CLAIM_EVERY, FULL_CLAIM_SHARE, Resume
from tests.helpers import analyze, explain, has, item_reads, plan_lines

resumes = pytest.mark.requires("resumes_claims")


def claim(resume, limit):
    return [item.payload["n"] for item in resume.ack_and_claim(None, limit, pid="p")[1]]


@resumes
def test_a_claim_resumes_after_the_last_item_and_a_full_claim_comes_in_time(db):
    queue = Queue("resumed")
    queue.enqueue_many([{"n": n} for n in range(6)])
    resume = Resume(queue.claims)
    assert claim(resume, 2) == [0, 1]
    queue.enqueue({"n": "urgent"}, priority=-1)  # sorts before the resume point
    assert claim(resume, 2) == [2, 3]
    resume.full_claim_due = time.monotonic()  # FULL_CLAIM_EVERY has passed
    assert claim(resume, 2) == ["urgent", 4]


@resumes
def test_a_resumed_claim_that_finds_nothing_reads_from_the_head(db):
    queue = Queue("resumed")
    queue.enqueue_many([{"n": n} for n in range(2)])
    resume = Resume(queue.claims)
    first, second = resume.ack_and_claim(None, 2, pid="p")[1]
    assert resume.after() == (0, 0, second.run_at, second.pk)  # round, priority, run_at, id
    assert first.release()  # READY again, behind the resume point
    assert claim(resume, 2) == [0]


@resumes
def test_after_a_short_claim_the_next_reads_from_the_head(db):
    queue = Queue("resumed")
    queue.enqueue_many([{"n": n} for n in range(3)])
    resume = Resume(queue.claims)
    assert claim(resume, 2) == [0, 1]
    assert claim(resume, 2) == [2]  # the tail of the queue
    assert resume.after() is None


@resumes
def test_a_resumed_claim_is_a_range_scan_starting_at_the_point(db):
    queue = Queue("resumed")
    queue.enqueue_many([{"n": n} for n in range(3000)])
    resume = Resume(queue.claims)
    claim(resume, 10)
    ran = []

    def record(execute, sql, params, many, context):
        ran.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        assert claim(resume, 10) == list(range(10, 20))
    # The statement that picks the rows (savepoints aside, in a test's transaction).
    sql, params = next((sql, params) for sql, params in ran if sql.startswith(("SELECT", "WITH")))
    if has("transactional_ddl"):  # (MySQL's ANALYZE TABLE would commit)
        analyze(queue.items.model)
    rows = explain(sql, params)
    lines = plan_lines(rows)
    if lines is None:  # MySQL's table of tables read
        # "range", not "ref": a lookup of (status, queue) alone would read from the head.
        [plan] = item_reads(rows)
        assert (plan["key"], plan["type"]) == ("txqueue_item_ready", "range"), plan
        assert "filesort" not in plan["Extra"], plan
        return
    plan = "\n".join(lines)
    assert "txqueue_item_ready" in plan and "Sort" not in plan, plan
    index_conditions = [line for line in plan.splitlines() if "Index Cond" in line]
    assert any("ROW(round, priority, run_at, id) > ROW(" in line for line in index_conditions)


def test_ordered_queues_and_other_databases_never_resume(db):
    assert Queue("ordered").claims.resume_key is None
    if not has("resumes_claims"):
        assert Queue("plain").claims.resume_key is None


def test_full_claims_come_every_second_or_less_often_when_slow(db):
    resume = Resume(Queue("plain").claims)
    resume.claimed([], 10, full=True, seconds=0.001)
    assert resume.full_claim_due == pytest.approx(time.monotonic() + FULL_CLAIM_EVERY, abs=0.1)
    resume.claimed([], 10, full=True, seconds=0.2)  # an old snapshot made it slow
    expected = time.monotonic() + 0.2 / FULL_CLAIM_SHARE
    assert resume.full_claim_due == pytest.approx(expected, abs=0.1)


@resumes
@pytest.mark.django_db(transaction=True)
def test_the_consumer_resumes_its_claims_and_ends_on_one_from_the_head(monkeypatch):
    """A burst consumer, batch 10, 30 items: the first claim reads from the head, the
    next three after the last item claimed (the third finds nothing), and one from the
    head finds the queue empty. (The full claim due every second is put off: on a loaded
    machine the drain can last longer.)"""
    from django_txqueue.consumer.worker import Worker

    monkeypatch.setattr("django_txqueue.consumer.claims.FULL_CLAIM_EVERY", 60.0)

    Queue("resumed").enqueue_many([{"n": n} for n in range(30)])
    claims = []

    def record(execute, sql, params, many, context):
        if "SKIP LOCKED" in sql and "resumed" in params:  # not the on_commit calls' claims
            claims.append(sql)
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        worker = Worker(handlers={"resumed": lambda item: None}, burst=True, batch=10)
        worker.run()
    assert worker.processed == 30
    # After the point: a row comparison ending "id") > (, or MySQL's spelled-out one.
    after = re.compile(re.escape(connection.ops.quote_name("id")) + r"\)? > ")
    resumed = [after.search(sql) is not None for sql in claims]
    assert resumed == [False, True, True, True, False], claims
