"""``python -m benchmarks.peers``: each queue system on the same PostgreSQL database,
the same workloads, one table. See docs/benchmarks.md ("Peers side by side")."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any

import django
import psycopg
from psycopg import sql

from .common import enqueue_rates

OURS = "txqueue_"
PEERS = ["pgqueuer_", "procrastinate_", "django_tasks_db_"]
# The ceiling beside them: a raw loop on our table (no wake-up, no target of its own).
CEILING = "hand_written_"
OURS_NAME, CEILING_NAME = "django-txqueue", "hand-written loop"  # their rows' names
# Our drain rate at batch 10 against each peer's: issue 14, part 9; pgqueuer's as issue
# 28 set it (2×, "on the way to 3×").
TARGET_RATIO = {"pgqueuer": 2.0, "procrastinate": 20.0, "django-tasks-db": 20.0}
# Our enqueue rate (one job per transaction) against pgqueuer's: issue 28, part 4.
ENQUEUE_TARGET_RATIO = {"pgqueuer": 1.5}


def recreate_database() -> None:
    """Drop and create the benchmark's own database, so every run starts empty."""
    from django.conf import settings

    db = settings.DATABASES["default"]
    with psycopg.connect(
        dbname="postgres", user=db["USER"], host=db["HOST"], port=db["PORT"], autocommit=True
    ) as connection:
        name = sql.Identifier(db["NAME"])
        connection.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
        connection.execute(sql.SQL("CREATE DATABASE {}").format(name))


def measure(module_name: str, items: int, processes: int, samples: int) -> dict[str, Any]:
    """One system's row; a system that cannot be imported or run gets its error instead."""
    from django_txqueue.contrib.bench.report import latency

    row: dict[str, Any] = {"system": module_name.rstrip("_").replace("_", "-"), "error": None}
    try:
        module = importlib.import_module(f"benchmarks.peers.{module_name}")
        row.update(system=module.NAME, batch=module.BATCH)
        module.prepare()
        progress(f"{module.NAME}: drain {items:,} jobs, {processes} workers")
        drained = module.drain(items, processes)
        row.update(rate=drained.rate, problems=drained.problems)
        if hasattr(module, "wakeup"):
            progress(f"{module.NAME}: wake-up, {samples} jobs")
            row["wakeup"] = latency(module.wakeup(samples))
    except Exception as exc:  # a peer that fails is reported in the table, not fatal
        traceback.print_exc(file=sys.stderr)
        row["error"] = f"{type(exc).__name__}: {exc}"
    return row


def measure_enqueues(
    rows: list[dict[str, Any]], modules: list[str], count: int, rounds: int
) -> None:
    """Each system's enqueue rate, one job per transaction, taking turns in slices
    (``common.enqueue_rates``): its median into its row, as ``enqueue``, with the
    median of its per-round ratios to the hand-written INSERT into a minimal table and
    to ours."""
    systems = {}
    for row, name in zip(rows, modules, strict=True):
        module = importlib.import_module(f"benchmarks.peers.{name}")
        if not row["error"] and hasattr(module, "enqueuer"):
            systems[row["system"]] = (row, module.enqueuer)
    progress(f"enqueue: {rounds} turns of {count:,} jobs each, one per transaction")
    rates = enqueue_rates({name: make for name, (_, make) in systems.items()}, count, rounds)

    def ratio(a: str, b: str) -> float | None:
        if a not in rates or b not in rates:
            return None
        return statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=True))

    for name, (row, _) in systems.items():
        row["enqueue"] = statistics.median(rates[name])
        if name != CEILING_NAME:
            row["enqueue_of_minimal"] = ratio(name, CEILING_NAME)
        if name in ENQUEUE_TARGET_RATIO and (mine := ratio(OURS_NAME, name)) is not None:
            target = ENQUEUE_TARGET_RATIO[name]
            row.update(enqueue_ratio=mine, enqueue_target=target, enqueue_met=mine >= target)


def progress(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def judge(ours: dict[str, Any], peer: dict[str, Any]) -> None:
    """Ratio ours/theirs and whether the issue's target is met, into the peer's row."""
    target = TARGET_RATIO[peer["system"]]
    if ours.get("rate") and peer.get("rate"):
        ratio = ours["rate"] / peer["rate"]
        peer.update(ratio=ratio, target=target, met=ratio >= target)


def table(rows: list[dict[str, Any]]) -> str:
    header = [
        "system",
        "batch",
        "drain",
        "of the loop",
        "ours ÷ theirs",
        "target",
        "wake-up p50 / p95",
        "enqueue",
        "of a minimal INSERT",
        "ours ÷ theirs",
        "target",
        "ok",
    ]
    lines = [header]
    for row in rows:
        if row["error"]:
            lines.append([row["system"], "", "did not run: " + row["error"], *[""] * 8, "no"])
            continue
        wake = row.get("wakeup")
        ratio, target = row.get("ratio"), row.get("target")
        enqueue, enqueue_ratio = row.get("enqueue"), row.get("enqueue_ratio")
        enqueue_target = row.get("enqueue_target")
        lines.append(
            [
                row["system"],
                str(row["batch"]),
                f"{row['rate']:,.0f}/s",
                f"{100 * row['of_ceiling']:.0f}%" if row.get("of_ceiling") else "",
                "" if ratio is None else f"{ratio:.1f}×",
                "" if target is None else f"≥ {target:.0f}×: {'met' if row['met'] else 'not met'}",
                f"{wake['p50_ms']:.1f} / {wake['p95_ms']:.1f} ms" if wake else "",
                "" if enqueue is None else f"{enqueue:,.0f}/s",
                f"{100 * row['enqueue_of_minimal']:.0f}%" if row.get("enqueue_of_minimal") else "",
                "" if enqueue_ratio is None else f"{enqueue_ratio:.1f}×",
                ""
                if enqueue_target is None
                else f"≥ {enqueue_target:.1f}×: {'met' if row['enqueue_met'] else 'not met'}",
                "no: " + "; ".join(row["problems"]) if row["problems"] else "yes",
            ]
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        " | ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)) for line in lines
    ]
    text.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(text)


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__)
    parser.add_argument("--items", type=int, default=20_000, help="jobs per drain")
    parser.add_argument("--processes", type=int, default=2, help="worker processes per drain")
    parser.add_argument("--wakeup-items", type=int, default=100, help="wake-up samples")
    parser.add_argument(
        "--enqueue-items", type=int, default=500, help="jobs per system per enqueue slice"
    )
    parser.add_argument(
        "--enqueue-rounds", type=int, default=10, help="enqueue slices per system (0: none)"
    )
    parser.add_argument("--only", nargs="+", help="systems to run (module names)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the table")
    args = parser.parse_args()

    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "benchmarks.peers.settings")
    django.setup()
    from django.core.management import call_command

    recreate_database()
    call_command("migrate", verbosity=0)
    systems = [CEILING, OURS, *PEERS]
    if args.only:
        systems = [s for s in systems if s.rstrip("_") in {o.rstrip("_") for o in args.only}]
    rows = [measure(name, args.items, args.processes, args.wakeup_items) for name in systems]
    if args.enqueue_rounds:
        measure_enqueues(rows, systems, args.enqueue_items, args.enqueue_rounds)
    ours = next((row for row in rows if row["system"] == OURS_NAME), {})
    ceiling = next((row for row in rows if row["system"] == CEILING_NAME), {})
    for row in rows:
        if row["system"] in TARGET_RATIO and not row["error"]:
            judge(ours, row)
        if ceiling.get("rate") and row.get("rate") and row is not ceiling:
            row["of_ceiling"] = row["rate"] / ceiling["rate"]
    if args.json:
        print(json.dumps({"items": args.items, "processes": args.processes, "rows": rows}))
    else:
        print(f"{args.items:,} no-op jobs, {args.processes} worker processes, PostgreSQL")
        print(table(rows))
    failed = any(row["error"] or row.get("problems") for row in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
