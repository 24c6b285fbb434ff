"""Flows (docs/flows.md): an item enqueued ``after=`` others is WAITING, never claimed,
and READY in the transaction that records the last of them DONE; a failure or a
cancellation cancels what waits for it (transitively), unless it runs after a failure."""

import datetime as dt
import io
import json
import threading
import time

import pytest
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.urls import reverse

from django_txqueue import (
    Flow,
    Queue,
    QueueFull,
    Status,
    chain,
    enqueue,
    enqueue_many,
    group,
    step,
    store,
)
from django_txqueue.consumer.worker import Worker
from django_txqueue.db.acks import claimed_dependents
from django_txqueue.db.inserts import inserts
from django_txqueue.models import QueueDependency, QueueFlow, QueueItem

from .helpers import analyze, expire, explain, item_reads, plan_lines
from .test_admin import DASHBOARD, ITEMS, SCRIPT, item_page, message, shown, staff

LONG = 600  # a lease no test outlives


def stored(item):
    return QueueItem.objects.get(pk=item.pk)


def claim_one(queue):
    [item] = queue.claim(1, pid="me", lease=LONG)
    return item


def finish(queue, *, result=None):
    """Claim the queue's next item and acknowledge it; the item."""
    item = claim_one(queue)
    assert item.ack(result) is True
    return item


# -- waiting and release ----------------------------------------------------------------


def test_an_item_after_another_waits_and_is_never_claimed(queue):
    parent = queue.enqueue({"n": 1})
    child = Queue("children").enqueue({"n": 2}, after=[parent])
    assert child.status == Status.WAITING
    assert stored(child).waiting_for == 1
    assert Queue("children").claim(10, pid="me") == []
    assert list(child.dependencies()) == [stored(parent)]
    assert list(parent.dependents()) == [stored(child)]


def test_the_last_acknowledgement_releases_it_in_its_own_transaction(queue):
    first, second = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    child = Queue("children").enqueue({}, after=[first, second.pk])
    finish(queue)
    assert stored(child).status == Status.WAITING  # one of two done
    with transaction.atomic():
        finish(queue)
        assert stored(child).status == Status.READY  # in the acknowledging transaction
    [claimed] = Queue("children").claim(1, pid="me")
    assert claimed.pk == child.pk
    assert stored(child).waiting_for == 0


def test_items_already_done_count_at_once(queue):
    done = queue.enqueue({})
    finish(queue)
    child = Queue("children").enqueue({}, after=[done])
    assert child.status == Status.READY
    assert Queue("children").claim(1, pid="me")[0].pk == child.pk


def test_an_item_claimed_before_something_waits_for_it_still_releases_it(queue):
    """The holder read the row before the waiting item was enqueued: its acknowledgement
    leaves the row to the flow path, which releases the waiting item."""
    parent = queue.enqueue({})
    held = claim_one(queue)
    child = Queue("children").enqueue({}, after=[parent])
    assert held.dependent_count == 0  # as the holder read it
    assert held.ack({"ok": 1}) is True
    row = stored(parent)
    assert (row.status, row.result) == (Status.DONE, {"ok": 1})
    assert stored(child).status == Status.READY


def test_enqueue_many_after_waits_every_item(queue):
    parent = queue.enqueue({})
    children = enqueue_many("children", [{"n": n} for n in range(5)], after=[parent])
    assert [stored(c).status for c in children] == [Status.WAITING] * 5
    assert QueueDependency.objects.filter(parent_id=parent.pk).count() == 5
    assert sorted(c.pk for c in parent.dependents()) == sorted(c.pk for c in children)
    finish(queue)
    assert Queue("children").count(Status.READY) == 5


def test_a_handler_reads_what_its_parents_returned(queue):
    parent = queue.enqueue({})
    child = Queue("children").enqueue({}, after=[parent])
    finish(queue, result={"thumbnail": "a.png"})
    assert [p.result for p in stored(child).dependencies()] == [{"thumbnail": "a.png"}]


def test_a_retried_parent_is_not_finished(queue):
    parent = queue.enqueue({}, max_attempts=3)
    child = Queue("children").enqueue({}, after=[parent])
    held = claim_one(queue)
    assert held.retry("busy", delay=0) is True
    assert stored(child).status == Status.WAITING
    finish(queue)
    assert stored(child).status == Status.READY


# -- the acknowledgement that counts down (claimed waited for) --------------------------------


def acknowledge(items, results=None):
    """Acknowledge one claim's ``items`` together, as a consumer's batch is: counting down
    where one was claimed waited for. How many were acknowledged."""
    results = {i.pk: (results or {}).get(i.pk) for i in items}
    ack = store.Ack(items[0].claim_token, results, claimed_dependents(items))
    return store.ack_many(QueueItem, "default", ack)


def test_one_acknowledgement_counts_down_every_parent_it_takes(queue):
    first, second, third = (queue.enqueue({"n": n}) for n in range(3))
    both = Queue("children").enqueue({}, after=[first, second])
    all_three = Queue("children").enqueue({}, after=[first, second, third])
    held = queue.claim(2, pid="me", lease=LONG)
    assert claimed_dependents(held) == {first.pk: 2, second.pk: 2}  # as the claim read them
    assert acknowledge(held, {first.pk: {"ok": 1}}) == 2
    assert (stored(both).status, stored(both).waiting_for) == (Status.READY, 0)
    assert (stored(all_three).status, stored(all_three).waiting_for) == (Status.WAITING, 1)
    assert stored(first).result == {"ok": 1}
    finish(queue)
    assert (stored(all_three).status, stored(all_three).waiting_for) == (Status.READY, 0)


def test_one_acknowledgement_takes_parents_waited_for_by_different_numbers(queue):
    """The claim read 2 and 1 (one value is bound where all are the same): each row is
    taken by its own count, and each waiting item counted down by its parents taken."""
    first, second, third = (queue.enqueue({"n": n}) for n in range(3))
    both = Queue("children").enqueue({}, after=[first, second])
    first_only = Queue("children").enqueue({}, after=[first])
    after_third = Queue("children").enqueue({}, after=[second, third])
    held = queue.claim(3, pid="me", lease=LONG)
    assert claimed_dependents(held) == {first.pk: 2, second.pk: 2, third.pk: 1}
    assert acknowledge(held) == 3
    assert [stored(i).status for i in (both, first_only, after_third)] == [Status.READY] * 3


def test_a_parent_taken_over_is_counted_by_its_new_holder_only(queue):
    first, second = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    child = Queue("children").enqueue({}, after=[first, second])
    held = queue.claim(2, pid="me", lease=LONG)
    expire(held[1])
    assert queue.requeue_stuck() == 1
    [retaken] = queue.claim(1, pid="other", lease=LONG)
    assert retaken.pk == held[1].pk
    assert acknowledge(held) == 1  # the other's claim holds the second now
    assert (stored(child).status, stored(child).waiting_for) == (Status.WAITING, 1)
    assert retaken.ack() is True
    assert (stored(child).status, stored(child).waiting_for) == (Status.READY, 0)
    assert acknowledge(held) == 0  # again, as after a lost connection: counts nothing
    assert stored(child).waiting_for == 0


def test_a_parent_whose_cancellation_was_requested_cancels_its_dependents(queue):
    parent, other = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    child = Queue("children").enqueue({}, after=[parent])
    sibling = Queue("children").enqueue({}, after=[other])
    held = queue.claim(2, pid="me", lease=LONG)
    assert stored(parent).cancel() is True  # requested while it runs
    assert acknowledge(held) == 2
    assert stored(parent).status == Status.CANCELLED
    row = stored(child)
    assert row.status == Status.CANCELLED
    assert row.last_error == f"item {parent.pk} it waited for ended cancelled"
    assert stored(sibling).status == Status.READY


@pytest.mark.django_db(transaction=True)
def test_an_item_added_while_the_acknowledgement_waits_for_its_producer_is_released(queue):
    """The producer holds the running parent's row while it adds a waiting item; the
    acknowledgement that waited for it must count that item down too (on PostgreSQL one
    statement, whose snapshot began before the producer's commit)."""
    parent = queue.enqueue({})
    first = Queue("children").enqueue({}, after=[parent])
    [held] = queue.claim(1, pid="me", lease=LONG)
    assert held.dependent_count == 1
    attached, committed = threading.Event(), []

    def produce():
        try:
            with transaction.atomic():
                committed.append(Queue("children").enqueue({}, after=[parent]))
                attached.set()
                time.sleep(0.5)  # the acknowledgement now waits for this transaction
        finally:
            attached.set()
            connections.close_all()

    producer = threading.Thread(target=produce)
    producer.start()
    assert attached.wait(10)
    acknowledged = acknowledge([held])  # blocks until the producer commits
    producer.join(10)
    [second] = committed
    assert acknowledged == 1
    assert stored(parent).dependent_count == 2
    assert [stored(c).status for c in (first, second)] == [Status.READY, Status.READY]


# -- failures and cancellations -------------------------------------------------------------


def test_a_failed_parent_cancels_what_waits_for_it_transitively(queue):
    parent = queue.enqueue({})
    child = Queue("children").enqueue({}, after=[parent])
    grandchild = Queue("grandchildren").enqueue({}, after=[child])
    assert claim_one(queue).fail("boom") is True
    row = stored(child)
    assert row.status == Status.CANCELLED
    assert f"item {parent.pk}" in row.last_error and "failed" in row.last_error
    assert row.finished_at is not None
    assert stored(grandchild).status == Status.CANCELLED
    assert f"item {child.pk}" in stored(grandchild).last_error


def test_after_failure_run_releases_it_once_everything_ended(queue):
    failing, passing = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    report = Queue("reports").enqueue({}, after=[failing, passing], after_failure="run")
    assert claim_one(queue).fail("bounced") is True
    assert stored(report).status == Status.WAITING
    finish(queue)
    assert stored(report).status == Status.READY


def test_an_item_after_a_failed_one_is_cancelled_at_once(queue):
    parent = queue.enqueue({})
    claim_one(queue).fail("boom")
    child = Queue("children").enqueue({}, after=[parent])
    assert child.status == Status.CANCELLED
    assert f"item {parent.pk}" in stored(child).last_error
    ran = Queue("children").enqueue({}, after=[parent], after_failure="run")
    assert ran.status == Status.READY


def test_cancelling_a_waiting_item_cancels_what_waits_for_it(queue):
    parent = queue.enqueue({})
    child = Queue("children").enqueue({}, after=[parent])
    grandchild = Queue("grandchildren").enqueue({}, after=[child])
    assert Queue("children").cancel() == 1
    assert stored(child).status == Status.CANCELLED
    assert stored(grandchild).status == Status.CANCELLED
    finish(queue)  # the parent, done after all: nothing waits for it any more
    assert stored(child).status == Status.CANCELLED


def test_cancelling_a_ready_parent_cancels_its_dependents(queue):
    parent = queue.enqueue({})
    child = Queue("children").enqueue({}, after=[parent])
    assert parent.cancel() is True
    assert stored(child).status == Status.CANCELLED
    assert "cancelled" in stored(child).last_error


@pytest.mark.usefixtures("fast_consumers")
def test_a_rescued_parent_out_of_attempts_cancels_its_dependents(queue):
    parent = queue.enqueue({}, max_attempts=1)
    child = Queue("children").enqueue({}, after=[parent])
    expire(claim_one(queue))
    assert queue.requeue_stuck() == 1
    assert stored(parent).status == Status.FAILED
    assert stored(child).status == Status.CANCELLED


# -- bad input --------------------------------------------------------------------------------


def test_an_unknown_parent_is_refused_having_written_nothing(queue):
    with transaction.atomic():
        with pytest.raises(ValueError, match="no item 987654321 on database 'default'"):
            queue.enqueue({}, after=[987654321])
        assert queue.count() == 0
        queue.enqueue({})  # the caller's transaction is still usable
    assert queue.count() == 1


@pytest.mark.django_db(databases=["default", "other"])
def test_a_parent_on_another_database_is_refused(queue):
    elsewhere = Queue(queue.name, using="other").enqueue({})
    with pytest.raises(ValueError, match="a flow lives on one database"):
        queue.enqueue({}, after=[elsewhere])
    assert queue.count() == 0


@pytest.mark.parametrize(
    ("after", "error"),
    [
        (5, TypeError),
        ([None], TypeError),
        (["7"], TypeError),
        ([QueueItem(queue="x")], ValueError),
    ],
)
def test_after_takes_a_list_of_saved_items_or_ids(queue, after, error):
    with pytest.raises(error):
        queue.enqueue({}, after=after)
    assert queue.count() == 0


def test_after_failure_is_cancel_or_run(queue):
    with pytest.raises(ValueError, match="after_failure must be 'cancel' or 'run'"):
        enqueue(queue.name, {}, after=[], after_failure="skip")


# -- everything else for waiting items ----------------------------------------------------


def test_a_waiting_item_holds_its_dedup_key(queue):
    parent = queue.enqueue({})
    child = Queue("children").enqueue({}, after=[parent], dedup_key="report")
    twin = Queue("children").enqueue({}, dedup_key="report")
    assert twin.pk == child.pk
    assert Queue("children").count(None) == 1


def test_waiting_items_count_towards_max_size(queue, settings):
    settings.TXQUEUE = {**settings.TXQUEUE, "QUEUES": {"bounded": {"MAX_SIZE": 2}}}
    parent = queue.enqueue({})
    Queue("bounded").enqueue({}, after=[parent])
    Queue("bounded").enqueue({}, after=[parent])
    with pytest.raises(QueueFull):
        Queue("bounded").enqueue({})


def test_an_item_released_into_a_paused_queue_waits_for_its_resume(queue):
    parent = queue.enqueue({})
    children = Queue("children")
    child = children.enqueue({}, after=[parent])
    children.pause()
    finish(queue)
    assert stored(child).status == Status.READY
    assert children.claim(1, pid="me") == []
    children.resume()
    assert children.claim(1, pid="me")[0].pk == child.pk


def test_a_fair_queues_item_released_takes_its_round(queue):
    """tests/settings.py makes "fair" FAIR: its items need a key and get a round."""
    parent = queue.enqueue({})
    child = Queue("fair").enqueue({}, key="tenant-a", after=[parent])
    assert stored(child).round > 0
    finish(queue)
    assert Queue("fair").claim(1, pid="me")[0].pk == child.pk


def test_a_fair_groups_steps_and_then_take_rounds_one_after_another(db):
    """A fair queue's items take rounds in enqueue order, a flow's then after its steps."""
    Queue("fair").enqueue({}, key="t")
    flow = group(
        step("fair", {"n": 1}, key="t"),
        step("fair", {"n": 2}, key="t"),
        then=step("fair", key="t"),
    ).enqueue()
    first = QueueItem.objects.get(queue="fair", flow=None).round
    assert [stored(item).round for item in flow.items] == [first + 1, first + 2, first + 3]


def test_an_ordered_queues_items_run_in_key_order_once_released(queue):
    """ "ordered" is ORDERED: one item per key at a time, in enqueue order; a released
    item waits behind its key's earlier one."""
    parent = queue.enqueue({})
    ordered = Queue("ordered")
    first = ordered.enqueue({"n": 1}, key="k", after=[parent])
    second = ordered.enqueue({"n": 2}, key="k")
    assert [i.pk for i in ordered.claim(5, pid="me")] == []  # first waits, second behind it
    finish(queue)
    [claimed] = ordered.claim(5, pid="me")
    assert claimed.pk == first.pk
    assert claimed.ack() is True
    assert ordered.claim(5, pid="me")[0].pk == second.pk


def test_purge_keeps_what_a_waiting_item_still_waits_for(queue):
    done, running = queue.enqueue({"n": 1}), queue.enqueue({"n": 2})
    child = Queue("children").enqueue({}, after=[done, running])
    finish(queue)
    assert stored(done).status == Status.DONE
    assert queue.purge(older_than=dt.timedelta(0)) == 0  # the child waits for it still
    finish(queue)
    Queue("children").claim(1, pid="me")[0].ack()
    assert queue.purge(older_than=dt.timedelta(0)) == 2
    assert Queue("children").purge(older_than=dt.timedelta(0)) == 1
    assert not QueueDependency.objects.filter(item_id=child.pk).exists()


# -- through a consumer -------------------------------------------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a_consumer_runs_a_waiting_item_after_its_parents(queue):
    ran = []
    handlers = {
        name: (lambda item, name=name: ran.append((name, item.payload["n"])))
        for name in (queue.name, "children")
    }
    parents = [queue.enqueue({"n": n}) for n in range(3)]
    Queue("children").enqueue({"n": 99}, after=parents)
    Worker(handlers, batch=2, burst=True).run()
    assert sorted(ran[:3]) == [(queue.name, 0), (queue.name, 1), (queue.name, 2)]
    assert ran[3:] == [("children", 99)]


@pytest.mark.django_db(transaction=True)
def test_a_burst_run_does_not_stop_before_the_step_its_last_batch_released(queue):
    """The last batch's acknowledgement rides with a claim that finds nothing; the step it
    releases is claimed all the same, in the same burst run."""
    steps = [step(queue.name, {"n": n}) for n in range(20)]
    flow = group(*steps, then=step(queue.name, {"then": True})).enqueue()
    ran = []
    Worker({queue.name: ran.append}, batch=10, burst=True).run()
    assert [item.pk for item in ran][-1] == flow.items[-1].pk
    assert stored(flow.items[-1]).status == Status.DONE


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("poll", [0.001, 60])
def test_a_burst_run_claims_a_step_released_into_a_queue_it_claimed_just_before(
    queue, settings, poll
):
    """The last acknowledgement rides with a claim from the `then`'s queue, which on
    PostgreSQL cannot see the release (it is made in the same statement; elsewhere the
    acknowledgement runs first in the claim's transaction), and that queue is not idle (its
    POLL_INTERVAL ran out: a slow machine's drain) or is: the burst run claims the `then`
    all the same."""
    settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": poll}
    steps = [step(queue.name, {"n": n}) for n in range(3)]
    flow = group(*steps, then=step("children", {"then": True})).enqueue()
    ran = []
    Worker({queue.name: ran.append, "children": ran.append}, batch=10, burst=True).run()
    assert stored(flow.items[-1]).status == Status.DONE
    assert ran[-1].pk == flow.items[-1].pk


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("batch", [10, 100])
def test_the_count_down_reads_edges_and_items_by_index_on_tables_never_analyzed(queue, batch):
    """Each acknowledgement of a group's steps counts its `then` down. The statements a
    real drain ran, EXPLAINed as they were run, read the edges by their parents' keys
    and the item counted down by its own: no full read of either table, at a batch of 10
    or 100, though these tables have no statistics (a new install, autovacuum not yet
    run). Planned for an unknown number of parents, PostgreSQL once read every item per
    acknowledgement; with the parents bound and joined to those acknowledged, every edge
    at a batch of 100."""
    group(*(step(queue.name, {"n": n}) for n in range(2000)), then=step(queue.name)).enqueue()
    edges = QueueDependency._meta.db_table
    counting = []

    def record(execute, sql, params, many, context):
        if edges in sql and sql.lstrip().upper().startswith(("UPDATE", "WITH")):
            counting.append((sql, params))
        return execute(sql, params, many, context)

    with connection.execute_wrapper(record):
        Worker({queue.name: lambda item: None}, batch=batch, burst=True).run()
    assert len(counting) >= 2000 // batch  # one per batch of steps
    items = QueueItem._meta.db_table
    for sql, params in counting[:3]:
        plan = explain(sql, params)
        text = "\n".join(str(row) for row in plan)
        lines = plan_lines(plan)
        if lines is None:  # MySQL's table of tables read, each with its access type
            assert all(row["type"] != "ALL" for row in item_reads(plan)), text
            continue
        for table in (items, edges):
            assert not any(
                f"Seq Scan on {table}" in line or line.strip() == f"SCAN {table}" for line in lines
            ), text


@pytest.mark.django_db(transaction=True)
def test_a_failing_handler_cancels_its_dependents_through_a_consumer(queue):
    def boom(item):
        raise RuntimeError("no thumbnails today")

    parent = queue.enqueue({}, max_attempts=1)
    child = Queue("children").enqueue({}, after=[parent])
    Worker({queue.name: boom, "children": lambda item: None}, burst=True).run()
    assert stored(parent).status == Status.FAILED
    assert stored(child).status == Status.CANCELLED


# -- builders ---------------------------------------------------------------------------------


def test_a_chain_runs_each_step_after_the_previous_one(db):
    flow = chain(step("resize", {"photo": 1}), step("publish", {"photo": 1})).enqueue()
    resize, publish = flow.items
    assert (resize.queue, publish.queue) == ("resize", "publish")
    assert [stored(i).status for i in flow.items] == [Status.READY, Status.WAITING]
    assert list(publish.dependencies()) == [stored(resize)]
    assert {i.flow for i in flow.items} == {flow.id}
    finish(Queue("resize"))
    assert stored(publish).status == Status.READY


def test_a_group_with_then_releases_then_after_all_its_parts(db):
    flow = group(*(step("thumbs", {"size": n}) for n in range(3)), then=step("publish")).enqueue()
    *thumbs, publish = flow.items
    assert stored(publish).waiting_for == 3
    for _ in range(2):
        finish(Queue("thumbs"))
    assert stored(publish).status == Status.WAITING
    finish(Queue("thumbs"))
    assert stored(publish).status == Status.READY
    assert flow.counts() == {Status.DONE: 3, Status.READY: 1}


def test_parts_nest_and_items_come_in_the_order_written(db):
    flow = chain(
        step("resize"),
        group(chain(step("a"), step("a2")), step("b"), then=step("publish")),
        step("notify"),
    ).enqueue()
    assert [i.queue for i in flow.items] == ["resize", "a", "a2", "b", "publish", "notify"]
    resize, a, a2, b, publish, notify = flow.items
    assert not resize.dependencies().exists() and stored(resize).status == Status.READY
    assert set(a.dependencies()) == {stored(resize)}
    assert set(b.dependencies()) == {stored(resize)}
    assert set(a2.dependencies()) == {stored(a)}
    assert set(publish.dependencies()) == {stored(a2), stored(b)}
    assert set(notify.dependencies()) == {stored(publish)}
    assert [i.pk for i in Flow.of(notify).items] == sorted(i.pk for i in flow.items)


def test_a_group_of_a_thousand_is_a_few_statements(db, django_assert_max_num_queries):
    # 4 to 12 where a statement binds thousands of values; about 20 on an SQLite built
    # to bind at most 999 (Python 3.11's): not one per step.
    with django_assert_max_num_queries(30):
        flow = group(*(step("mail", {"n": n}) for n in range(1000)), then=step("report")).enqueue()
    assert len(flow.items) == 1001
    assert QueueDependency.objects.filter(item_id=flow.items[-1].pk).count() == 1000
    assert Queue("mail").count(Status.READY) == 1000


def test_a_flow_is_written_in_the_callers_transaction(db):
    with pytest.raises(RuntimeError), transaction.atomic():
        chain(step("resize"), step("publish")).enqueue()
        raise RuntimeError("the booking failed")
    assert QueueItem.objects.filter(queue__in=["resize", "publish"]).count() == 0


def test_a_failed_step_cancels_the_rest_of_its_chain(db):
    flow = chain(step("resize"), step("publish"), step("notify")).enqueue()
    assert claim_one(Queue("resize")).fail("corrupt photo") is True
    assert [stored(i).status for i in flow.items[1:]] == [Status.CANCELLED] * 2


def test_a_step_may_run_after_a_failure(db):
    flow = group(
        step("mail", {"n": 1}), step("mail", {"n": 2}), then=step("report", after_failure="run")
    ).enqueue()
    claim_one(Queue("mail")).fail("bounced")
    finish(Queue("mail"))
    assert stored(flow.items[-1]).status == Status.READY


def test_builders_refuse_bad_input_before_writing(db):
    with pytest.raises(ValueError, match="priority"):
        step("resize", priority="high")
    with pytest.raises(TypeError, match="not after="):
        step("resize", after=[1])
    with pytest.raises(TypeError, match="takes steps, chains and groups"):
        chain(step("a"), "b")
    with pytest.raises(ValueError, match="at least one part"):
        group()
    twice = step("a")
    with pytest.raises(ValueError, match="appears twice"):
        chain(twice, twice).enqueue()
    with pytest.raises(TypeError, match="payload for queue 'b': Object of type set"):
        chain(step("a", {"n": 1}), step("b", {"tags": {"x"}})).enqueue()
    assert QueueItem.objects.count() == 0


def test_a_flows_items_are_read_between_its_first_and_last_beside_others_written_between(db):
    # The steps and the then are two INSERTs; another item written between them (as a
    # concurrent producer's may be) lies between the flow's first and last keys.
    intruders = []

    def write_one_between(execute, sql, params, many, context):
        done = execute(sql, params, many, context)
        if sql.startswith("INSERT") and "queueitem" in sql and not intruders:
            intruders.append(None)  # this wrapper sees the intruder's INSERT too
            intruders[0] = Queue("elsewhere").enqueue({"n": "between"})
        return done

    with connection.execute_wrapper(write_one_between):
        flow = group(step("mail", {"n": 1}), step("mail", {"n": 2}), then=step("report")).enqueue()
    [intruder] = intruders
    first, second, report = flow.items
    assert second.pk < intruder.pk < report.pk
    ours = sorted(i.pk for i in flow.items)
    assert [i.pk for i in Flow.of(report).items] == ours
    assert sorted(QueueItem.objects.in_flow(flow.id).values_list("pk", flat=True)) == ours
    assert Flow.of(first).counts() == {Status.READY: 2, Status.WAITING: 1}
    row = QueueFlow.objects.get(pk=flow.id)
    assert (row.first_item, row.last_item) == (first.pk, report.pk)
    with pytest.raises(ValueError, match="belongs to no flow"):
        Flow.of(intruder)


def test_an_item_enqueued_after_others_has_a_flow_of_its_own(queue):
    parent = queue.enqueue({})
    children = Queue("children").enqueue_many([{"n": 1}, {"n": 2}], after=[parent])
    flow = Flow.of(children[0])
    assert [i.pk for i in flow.items] == [c.pk for c in children]
    assert QueueFlow.objects.get(pk=flow.id).first_item == children[0].pk


def test_a_flows_row_goes_with_its_last_item(queue):
    flow = group(step(queue.name, {"n": 1}), step(queue.name, {"n": 2}), then=step("report"))
    flow = flow.enqueue()
    finish(queue)
    finish(queue)
    assert queue.purge(older_than=dt.timedelta(0)) == 2
    assert QueueFlow.objects.filter(pk=flow.id).exists()  # its then is left
    finish(Queue("report"))
    assert Queue("report").purge(older_than=dt.timedelta(0)) == 1
    assert not QueueFlow.objects.filter(pk=flow.id).exists()
    other = chain(step(queue.name), step("report")).enqueue()
    QueueItem.objects.filter(pk=other.items[0].pk).update(status=Status.DONE)
    assert QueueItem.objects.filter(pk=other.items[1].pk).delete_finished() == 0  # WAITING
    assert QueueItem.objects.in_flow(other.id).filter(status=Status.DONE).delete_finished() == 1
    assert QueueFlow.objects.filter(pk=other.id).exists()
    QueueItem.objects.filter(pk=other.items[1].pk).update(status=Status.CANCELLED)
    assert QueueItem.objects.in_flow(other.id).delete_finished() == 1
    assert not QueueFlow.objects.filter(pk=other.id).exists()
    assert not QueueDependency.objects.exists()


@pytest.mark.django_db(transaction=True)
def test_a_flows_items_are_read_along_the_primary_key_among_many_others(queue):
    # What Flow.of, the admin's flow filter and its cancel read: the flow's keys only,
    # not every item (a table of a million rows in the admin).
    queue.enqueue_many([{"n": n} for n in range(3000)])
    flow = group(step(queue.name, {"n": 1}), step(queue.name, {"n": 2}), then=step("report"))
    flow = flow.enqueue()
    queue.enqueue_many([{"n": n} for n in range(3000)])
    analyze(QueueItem)
    sql, params = QueueItem.objects.in_flow(flow.id).query.sql_with_params()
    plan = explain(sql, params)
    text = "\n".join(str(row) for row in plan)
    lines = plan_lines(plan)
    if lines is None:  # MySQL's table of tables read, each with its access type
        [read] = item_reads(plan)
        assert (read["type"], read["key"]) == ("range", "PRIMARY"), text
    elif connection.vendor == "postgresql":
        assert any("_pkey" in line for line in lines), text
        assert not any("Seq Scan" in line for line in lines), text
    else:
        assert any("USING INTEGER PRIMARY KEY" in line for line in lines), text
    assert len(Flow.of(flow.items[0]).items) == 3


def test_no_index_is_kept_on_flow(db):
    # Each claim and acknowledgement of a flow's item would write it again (PostgreSQL
    # gives a row's new version an entry in every index): 4-5% of a flow's drain.
    # (That the migrations make the models' indexes, test_migrations checks.)
    assert [index.name for index in QueueItem._meta.indexes if "flow" in index.fields] == []
    assert not QueueItem._meta.get_field("flow").db_index


def test_a_flow_whose_row_was_deleted_by_hand_is_still_found(db):
    flow = chain(step("resize"), step("publish")).enqueue()
    QueueFlow.objects.filter(pk=flow.id).delete()
    assert [i.pk for i in Flow.of(flow.items[1]).items] == [i.pk for i in flow.items]


def test_a_tools_delete_of_a_queue_takes_its_flows_edges_and_rows(db):
    flow = group(step("bench", {"n": 1}), step("bench", {"n": 2}), then=step("bench")).enqueue()
    kept = chain(step("other"), step("other")).enqueue()
    assert store.delete_all(QueueItem.objects.filter(queue="bench")) == 3
    assert not QueueFlow.objects.filter(pk=flow.id).exists()
    assert not QueueDependency.objects.filter(item_id=flow.items[-1].pk).exists()
    assert QueueFlow.objects.filter(pk=kept.id).exists()
    assert QueueDependency.objects.filter(item_id=kept.items[1].pk).exists()


def test_a_flows_keys_are_read_back_where_a_multi_row_insert_returns_none(db, monkeypatch):
    # MySQL's: no RETURNING, and the items' keys are read back, from the newest row.
    features, name = connection.features, "can_return_rows_from_bulk_insert"
    monkeypatch.setattr(type(features), name, False)  # a property on MySQL's
    monkeypatch.delitem(features.__dict__, name, raising=False)  # cached on others'
    inserts.cache_clear()
    try:
        flow = group(*(step("mail", {"n": n}) for n in range(5)), then=step("report")).enqueue()
    finally:
        inserts.cache_clear()
    stored_keys = QueueItem.objects.in_flow(flow.id).order_by("pk")
    assert [(i.pk, i.queue) for i in flow.items] == [(i.pk, i.queue) for i in stored_keys]
    assert [i.payload for i in flow.items[:5]] == [{"n": n} for n in range(5)]
    assert set(flow.items[-1].dependencies()) == set(stored_keys[:5])


def test_flow_of_an_item_outside_any_flow_is_refused(queue):
    with pytest.raises(ValueError, match="belongs to no flow"):
        Flow.of(queue.enqueue({}))


# -- in the admin -------------------------------------------------------------------------------


def flow_page(item):
    return reverse("admin:django_txqueue_queueitem_flow", args=[item.pk])


def test_the_admin_shows_a_flow_from_any_of_its_items(admin_client):
    flow = group(step(SCRIPT, {"n": 1}), step("thumbs", {"n": 2}), then=step("publish")).enqueue()
    first, _, publish = flow.items
    change = admin_client.get(item_page(publish)).content.decode()
    assert flow_page(publish) in change
    assert "waiting for 2" in change
    page = admin_client.get(flow_page(first))
    html = page.content.decode()
    assert page.status_code == 200
    assert 'id="flow-chart"' in html
    assert html.count('class="flow-item"') == 3
    assert html.count("<line ") == 2  # the two edges into publish
    assert SCRIPT not in html and "&lt;script&gt;" in html  # escaped, chart and table
    assert f"#{first.pk}" in html  # publish's "waits for" column
    listed = admin_client.get(ITEMS, {"flow": str(flow.id)})
    assert shown(listed) == {i.pk for i in flow.items}
    assert shown(admin_client.get(ITEMS, {"flow": "not-a-uuid"})) == set()


def test_cancelling_a_flow_in_the_admin_needs_the_change_permission(client, admin_client):
    flow = chain(step("resize"), step("publish")).enqueue()
    client.force_login(staff("viewer", "view_queueitem"))
    assert client.get(flow_page(flow.items[0])).status_code == 200
    assert client.post(flow_page(flow.items[0])).status_code == 403
    assert [stored(i).status for i in flow.items] == [Status.READY, Status.WAITING]
    response = admin_client.post(flow_page(flow.items[0]), follow=True)
    assert "Cancelled 2 items of the flow." in message(response)
    assert [stored(i).status for i in flow.items] == [Status.CANCELLED] * 2


def test_an_item_outside_any_flow_has_no_flow_page(admin_client, queue):
    item = queue.enqueue({})
    assert admin_client.get(flow_page(item)).status_code == 404
    assert admin_client.get("/admin/django_txqueue/queueitem/x1/flow/").status_code == 404


def test_the_dashboard_and_the_stats_count_waiting_items(admin_client, queue):
    parent = queue.enqueue({})
    Queue("children").enqueue({}, after=[parent])
    Queue("children").enqueue({}, after=[parent])
    assert Queue("children").stats()["waiting"] == 2
    html = admin_client.get(DASHBOARD).content.decode()
    assert 'data-column="waiting"' in html
    out = io.StringIO()
    call_command("txqueue_stats", "children", "--json", stdout=out)
    assert [row["waiting"] for row in json.loads(out.getvalue())] == [2]
