"""Transactions refused by a conflict, run again: ``run_in_transaction`` for the caller's
own, ``store.retrying_conflicts`` for the library's (docs/scaling.md).

A real deadlock between two threads stands in for a Galera certification failure: both
are the same error (1213 on MariaDB, 40P01 on PostgreSQL) refusing a whole transaction,
which then wrote nothing. tests/e2e/test_galera.py runs the real cluster.
"""

from __future__ import annotations

import threading

import pytest
from django.core.checks import Warning
from django.db import DatabaseError, connection, connections, transaction
from django.test.utils import CaptureQueriesContext, override_settings

from django_txqueue import checks, run_in_transaction, store
from django_txqueue.db import dialect
from tests.testapp.models import Run


def test_it_returns_what_the_function_returns_and_commits(db):
    def book():
        Run.objects.create(item_id=1, consumer="booking")
        return "booked"

    assert run_in_transaction(book) == "booked"
    assert Run.objects.filter(item_id=1).count() == 1


def test_an_error_that_is_no_conflict_rolls_back_and_is_not_run_again(db):
    runs = []

    def fails():
        runs.append(1)
        Run.objects.create(item_id=2, consumer="x")
        raise ValueError("no seats")

    with pytest.raises(ValueError, match="no seats"):
        run_in_transaction(fails)
    assert runs == [1] and not Run.objects.filter(item_id=2).exists()


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: run_in_transaction("book"), TypeError, "needs a callable, got 'book'"),
        (lambda: run_in_transaction(print, attempts=0), ValueError, "attempts must be between"),
        (lambda: run_in_transaction(print, attempts="3"), ValueError, "attempts must be an"),
    ],
)
def test_bad_arguments_are_refused_before_anything_runs(call, error, match):
    with pytest.raises(error, match=match):
        call()


def deadlock(first_run, transact):
    """Two threads lock rows a and b in opposite orders, each in ``transact(func)``, both
    on their first run holding one row before asking for the other: one of them is the
    database's deadlock victim. Returns each thread's runs and errors."""
    a, b = (
        Run.objects.create(item_id=10, consumer="a"),
        Run.objects.create(item_id=11, consumer="b"),
    )
    both_hold_one = threading.Barrier(2, timeout=10)
    runs = {"ab": 0, "ba": 0}
    errors = {}

    def work(name, order):
        def locks():
            runs[name] += 1
            Run.objects.select_for_update().get(pk=order[0].pk)
            if runs[name] == 1 and first_run:
                both_hold_one.wait()
            Run.objects.select_for_update().get(pk=order[1].pk)
            Run.objects.filter(pk=order[0].pk).update(consumer=name)

        try:
            transact(locks)
        except Exception as exc:
            errors[name] = exc
        finally:
            connections.close_all()

    threads = [
        threading.Thread(target=work, args=("ab", (a, b))),
        threading.Thread(target=work, args=("ba", (b, a))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return runs, errors


@pytest.mark.requires("row_locks")
@pytest.mark.django_db(transaction=True)
def test_a_deadlocked_transaction_runs_again_and_commits():
    runs, errors = deadlock(True, run_in_transaction)
    assert errors == {}
    # Each ran once; the deadlock's victim (whichever) once more, which committed.
    assert sorted(runs.values()) == [1, 2], runs


@pytest.mark.requires("row_locks")
@pytest.mark.django_db(transaction=True)
def test_without_it_the_victim_gets_the_conflict():
    """The test above can fail: the same transactions, not run again, do deadlock."""

    def once(func):
        with transaction.atomic():
            func()

    runs, errors = deadlock(True, once)
    assert runs == {"ab": 1, "ba": 1}
    assert len(errors) == 1
    (error,) = errors.values()
    assert isinstance(error, DatabaseError) and dialect(connection).is_transient(error)


@pytest.mark.requires("row_locks")
@pytest.mark.django_db(transaction=True)
def test_inside_an_atomic_block_it_runs_once_and_the_conflict_reaches_its_owner():
    def nested(func):
        with transaction.atomic():
            run_in_transaction(func)

    runs, errors = deadlock(True, nested)
    assert runs == {"ab": 1, "ba": 1}
    assert len(errors) == 1 and dialect(connection).is_transient(next(iter(errors.values())))


@pytest.mark.requires("row_locks")
@pytest.mark.django_db(transaction=True)
def test_the_library_runs_its_own_transaction_again():
    """``store.retrying_conflicts``: what every store write outside a caller's transaction
    goes through (claims, acknowledgements, heartbeats, rescues, enqueue)."""

    def library(func):
        def run():
            with transaction.atomic():
                func()

        store.retrying_conflicts(run, "default")

    runs, errors = deadlock(True, library)
    assert errors == {} and sorted(runs.values()) == [1, 2], (runs, errors)


def test_a_plain_server_is_no_galera_node_and_is_asked_once(db):
    vendor = dialect(connection)
    assert vendor.is_galera(connection) is False
    with CaptureQueriesContext(connection) as queries:
        assert vendor.is_galera(connection) is False
    assert len(queries) == 0


@override_settings(TXQUEUE={"CLAIM_STRATEGY": "update_limit"})
def test_the_galera_check_says_nothing_on_a_plain_server(db):
    found = checks.check_galera_strategy(databases=["default"])
    assert found == []
    assert not any(isinstance(message, Warning) for message in found)
