"""``manage.py txqueue_chaos``: the audit catches each violation; short real runs pass."""

import datetime as dt
import io
import json

import pytest
from django.core.management import CommandError, call_command
from django.db import connection

from django_txqueue import Queue, Status
from django_txqueue.contrib.chaos.models import ChaosRun
from django_txqueue.contrib.chaos.run import Consumers, Options
from django_txqueue.contrib.chaos.verify import History, Run, audit
from django_txqueue.validation import parse_rate
from tests.helpers import child_env

T0 = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)


def at(seconds):
    return T0 + dt.timedelta(seconds=seconds)


def clean():
    """Item 1 ran once; item 2 was held by consumer 10 when it was killed at t=5 and
    ran again at t=7 under a new claim."""
    return History(
        items={1: (Status.DONE, 100), 2: (Status.DONE, 201)},
        runs=[
            Run(1, 100, "h:11:a", at(1), at(2)),
            Run(2, 200, "h:10:b", at(4), None),
            Run(2, 201, "h:11:a", at(7), at(8)),
        ],
        killed={10: at(5)},
        orphans={2: at(5)},
        sigterm_exits=[0, 0],
        stale_answers={"ack": False, "release": False, "fail": False, "retry": False},
        rescue_bound=6.5,
    )


def test_a_clean_history_has_no_violations():
    report = audit(clean())
    assert report["violations"] == []
    assert report["duplicates"] == report["duplicates_explained"] == 1
    assert report["max_rescue_s"] == 2.0


@pytest.mark.parametrize(
    ("spoil", "violation"),
    [
        (lambda h: h.items.update({1: (Status.READY, None)}), "item 1 ended ready"),
        (lambda h: h.items.update({3: (Status.DONE, 300)}), "item 3 is done but no run"),
        (
            lambda h: h.runs.append(Run(1, 100, "h:12:c", at(3), at(4))),
            "item 1 completed 2 times under one claim",
        ),
        (
            lambda h: h.runs.append(Run(1, 99, "h:12:c", at(0), at(1))),
            "item 1 ran again after a run by h:12:c, which was neither killed",
        ),
        (lambda h: h.sigterm_exits.append(-15), "exited -15, not 0"),
        (lambda h: h.stale_answers.update(retry=True), "stale copy's retry returned True"),
        (lambda h: h.stale_changed.append(1), "changed item 1"),
        (lambda h: h.orphans.update({1: at(5)}), "item 1, orphaned by a kill, never ran again"),
        (lambda h: setattr(h, "rescue_bound", 1.0), "item 2 waited 2.0 s"),
    ],
)
def test_each_violation_is_caught(spoil, violation):
    history = clean()
    spoil(history)
    violations = audit(history)["violations"]
    assert any(violation in found for found in violations), violations


def a_flow(then_starts_at):
    """Items 1 and 2 (``clean``'s) are the steps of a flow whose then, item 3, ran at
    ``then_starts_at``; item 2's completed run finished at t=8."""
    history = clean()
    history.items[3] = (Status.DONE, 300)
    history.runs.append(Run(3, 300, "h:11:a", at(then_starts_at), at(then_starts_at + 1)))
    history.flows = [([1, 2], 3)]
    return history


def test_a_then_item_after_its_steps_is_no_violation():
    report = audit(a_flow(then_starts_at=9))
    assert report["violations"] == []
    assert (report["flows"], report["released_early"]) == (1, 0)


def test_a_then_item_that_ran_before_a_step_finished_is_a_violation():
    # Item 2's first run (h:10, killed) does not count: its completed run ended at t=8.
    report = audit(a_flow(then_starts_at=7.5))
    assert report["released_early"] == 1
    assert "item 3 ran before the last of the steps it waits for" in report["violations"]


def test_starts_within_a_rate_limit_are_no_violation():
    history = clean()  # starts at t=1, 4 and 7
    history.rate = parse_rate("1/s")
    report = audit(history)
    assert report["violations"] == []
    assert (report["rate_limit"], report["most_started_in_a_period"]) == ("1/s", 1)


def test_more_starts_than_a_rate_limit_allows_are_a_violation():
    history = clean()
    history.rate = parse_rate("2/s")
    history.items.update({3: (Status.DONE, 300), 4: (Status.DONE, 300)})
    history.runs += [Run(3, 300, "h:11:a", at(7.3), at(7.4)), Run(4, 300, "h:11:a", at(7.8), None)]
    report = audit(history)
    assert report["most_started_in_a_period"] == 3
    assert "3 handlers started within 0.9 s under RATE_LIMIT 2/s" in report["violations"]


def test_time_the_database_was_down_does_not_count_against_a_rescue():
    history = clean()
    history.rescue_bound = 1.0
    history.downtimes = [(at(5.5), at(6.5))]
    assert audit(history)["max_rescue_s"] == 1.0
    assert audit(history)["violations"] == []


def test_refuses_a_database_whose_name_has_neither_test_nor_staging(monkeypatch):
    # No database access is allowed here: the refusal comes before any query.
    monkeypatch.setitem(connection.settings_dict, "NAME", "prod")
    with pytest.raises(CommandError, match="Refusing to run on database 'prod'"):
        call_command("txqueue_chaos")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--consumers", "1"], "at least 2"),
        (["--items", "0"], "--items"),
        (["--lease", "0"], "lease"),
        (["--rate-limit", "fast"], "--rate-limit: a rate limit is 'N/s'"),
    ],
)
def test_bad_numbers_are_command_errors(args, message):
    with pytest.raises(CommandError, match=message):
        call_command("txqueue_chaos", *args)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_short_run_with_kills_finds_nothing_wrong_and_touches_only_its_queue(monkeypatch):
    for name, value in child_env().items():
        monkeypatch.setenv(name, value)
    other = Queue("other").enqueue({"n": 1})
    out = io.StringIO()
    try:
        call_command(
            "txqueue_chaos", "--items", "300", "--consumers", "3", "--rounds", "2", "--json",
            stdout=out,
        )  # fmt: skip
    except CommandError:
        pytest.fail(f"violations:\n{out.getvalue()}")  # its report says which
    report = json.loads(out.getvalue())
    assert report["violations"] == []
    assert report["kills"] == 2 and report["sigterms"] == 2 + 3
    assert report["runs"] >= 300 and report["duplicates"] == report["duplicates_explained"]
    assert Queue("txqueue-chaos").count(Status.DONE) == 300
    assert ChaosRun.objects.filter(queue="txqueue-chaos").count() == report["runs"]
    assert Queue("other").items.get().pk == other.pk


@pytest.mark.slow
def test_a_consumer_that_ends_by_itself_is_named_with_its_code_and_last_words(monkeypatch):
    """Its settings cannot be imported: the violation quotes the error from its stderr."""
    monkeypatch.setenv("DJANGO_SETTINGS_MODULE", "no_such_settings_module")
    options = Options(
        alias="default", queue="txqueue-chaos", items=1, consumers=1, rounds=0, lease=1, seed=0
    )
    consumers = Consumers(options)
    try:
        consumers.running[0].wait(30)
        [crash] = consumers.crashed()
    finally:
        consumers.close()
    assert crash.startswith("a consumer exited by itself with code 1\n")
    assert "No module named 'no_such_settings_module'" in crash
