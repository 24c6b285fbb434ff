"""The audit of a chaos run, from what the database holds afterwards: pure functions of
the rows, the runs and the command's own log of kills, so a test can feed them a
fabricated history and watch each violation being caught."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django_txqueue import Status
from django_txqueue.validation import Rate


@dataclass
class Run:
    item_id: int
    claim_token: int
    consumer: str  # the claim's pid, host:os-pid:random
    started_at: datetime
    finished_at: datetime | None


@dataclass
class History:
    """What happened: the items' final (status, claim token), every run, the consumers
    killed (os pid: when), how each SIGTERM'd consumer exited, the stale calls' answers
    and whether the stale items changed, the rescue bound (seconds) and the database's
    downtimes."""

    items: dict[int, tuple[int, int | None]]
    runs: list[Run]
    killed: dict[int, datetime] = field(default_factory=dict)
    sigterm_exits: list[int] = field(default_factory=list)
    stale_answers: dict[str, bool] = field(default_factory=dict)
    stale_changed: list[int] = field(default_factory=list)
    rescue_bound: float = 0.0
    # Items IN_PROGRESS under a consumer when it was killed: when.
    orphans: dict[int, datetime] = field(default_factory=dict)
    # When the database was down (--restart-command): (stopped, back).
    downtimes: list[tuple[datetime, datetime]] = field(default_factory=list)
    # --flows: each group's steps and the item after them (its "then").
    flows: list[tuple[list[int], int]] = field(default_factory=list)
    # --rate-limit: the queue's RATE_LIMIT.
    rate: Rate | None = None


# A handler starts a little after its claim, which the rate limit times (by the database's
# clock); how much later varies by this much at most between two claims, so the starts of
# a period less this long hold no more than the limit's claims.
START_JITTER = 0.1  # seconds


def most_in_any_stretch(moments: list[datetime], seconds: float) -> int:
    """The most of ``moments`` inside any ``seconds``-long stretch, wherever it starts."""
    moments, most, first = sorted(moments), 0, 0
    for last, moment in enumerate(moments):
        while (moment - moments[first]).total_seconds() >= seconds:
            first += 1
        most = max(most, last - first + 1)
    return most


def os_pid(consumer: str) -> int | None:
    parts = consumer.split(":")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


def audit(history: History) -> dict[str, Any]:
    """The report's figures and its violations (empty: the run proved the guarantees)."""
    violations: list[str] = []
    by_item: dict[int, list[Run]] = {}
    for run in history.runs:
        by_item.setdefault(run.item_id, []).append(run)

    def killed(run: Run) -> bool:
        return os_pid(run.consumer) in history.killed

    def cut_by_restart(run: Run) -> bool:
        """Running while the database went away: its acknowledgement may have been lost."""
        return any(
            run.started_at <= back and (run.finished_at is None or run.finished_at >= down)
            for down, back in history.downtimes
        )

    for pk, (status, _) in history.items.items():
        if status != Status.DONE:
            violations.append(f"item {pk} ended {Status(status).label}, not done")
        elif not any(run.finished_at for run in by_item.get(pk, [])):
            violations.append(f"item {pk} is done but no run of it finished")
    duplicates = explained = 0
    rescue_times: list[float] = []
    for pk, runs in by_item.items():
        final_token = history.items.get(pk, (0, None))[1]
        completed = [r for r in runs if r.finished_at and r.claim_token == final_token]
        if len(completed) > 1:
            violations.append(f"item {pk} completed {len(completed)} times under one claim")
        others = [r for r in runs if r.claim_token != final_token]
        if others:
            duplicates += len(others)
            for run in others:
                if killed(run) or cut_by_restart(run):
                    explained += 1
                else:
                    violations.append(
                        f"item {pk} ran again after a run by {run.consumer}, which was "
                        "neither killed nor cut off by a restart"
                    )
    # An orphan: IN_PROGRESS under a consumer just killed; its next run is its rescue.
    for pk, killed_at in history.orphans.items():
        later = [r.started_at for r in by_item.get(pk, []) if r.started_at >= killed_at]
        if not later:
            violations.append(f"item {pk}, orphaned by a kill, never ran again")
            continue
        rescue = (min(later) - killed_at).total_seconds()
        rescue -= sum(
            (back - down).total_seconds()
            for down, back in history.downtimes
            if killed_at <= back and down <= min(later)
        )
        rescue_times.append(rescue)
        if rescue > history.rescue_bound:
            violations.append(
                f"item {pk} waited {rescue:.1f} s after its consumer was killed "
                f"(bound {history.rescue_bound:.1f} s)"
            )
    early = 0
    for steps, then in history.flows:
        # The then item is released by its last step's acknowledgement, which follows
        # that step's completed run (under its final claim): no run of the then may start
        # before every step's completed run finished.
        finished = [
            r.finished_at
            for pk in steps
            for r in by_item.get(pk, [])
            if r.finished_at and r.claim_token == history.items.get(pk, (0, None))[1]
        ]
        last = max(finished, default=None)
        started = [r.started_at for r in by_item.get(then, [])]
        if last is not None and started and min(started) < last:
            early += 1
            violations.append(f"item {then} ran before the last of the steps it waits for")
    most_started, window = 0, 0.0
    if history.rate is not None:
        window = history.rate.period - START_JITTER
        most_started = most_in_any_stretch([run.started_at for run in history.runs], window)
        if most_started > history.rate.limit:
            violations.append(
                f"{most_started} handlers started within {window:g} s under RATE_LIMIT "
                f"{history.rate}"
            )
    for exit_code in history.sigterm_exits:
        if exit_code != 0:
            violations.append(f"a consumer stopped by SIGTERM exited {exit_code}, not 0")
    for call, answer in history.stale_answers.items():
        if answer:
            violations.append(f"a stale copy's {call} returned True")
    for pk in history.stale_changed:
        violations.append(f"a stale copy's calls changed item {pk}")
    return {
        "items": len(history.items),
        "runs": len(history.runs),
        "duplicates": duplicates,
        "duplicates_explained": explained,
        "kills": len(history.killed),
        "sigterms": len(history.sigterm_exits),
        "orphans": len(history.orphans),
        "max_rescue_s": round(max(rescue_times, default=0.0), 2),
        "rescue_bound_s": history.rescue_bound,
        "flows": len(history.flows),
        "released_early": early,
        "rate_limit": None if history.rate is None else str(history.rate),
        "most_started_in_a_period": most_started,
        "rate_window_s": window,
        "violations": violations,
    }
