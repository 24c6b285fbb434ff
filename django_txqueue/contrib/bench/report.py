"""What a bench run shows when it is done: its figures' arithmetic (latency
percentiles, percentages of the hand-written baseline) and the table (``--json``
prints the figures as they are)."""

from __future__ import annotations

import statistics
from typing import Any


def latency(samples: list[float]) -> dict[str, Any] | None:
    """p50, p95 and max in milliseconds, and the sample count."""
    if not samples:
        return None
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": statistics.median(ordered) * 1000,
        "p95_ms": ordered[round(0.95 * (len(ordered) - 1))] * 1000,
        "max_ms": ordered[-1] * 1000,
    }


def percent(ours: float | None, raw: float | None) -> float | None:
    """Ours as a percentage of the hand-written figure (None without one)."""
    if ours is None or not raw:
        return None
    return 100.0 * ours / raw


# -- the table -------------------------------------------------------------------------


def columns(rows: list[list[str]]) -> list[str]:
    """Aligned columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells).rstrip())
    return lines


def rate(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/s"


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def ms(value: dict[str, Any] | None, key: str) -> str:
    return "-" if value is None else f"{value[key]:.2f} ms"


DRAIN_MODES = {
    "process": "run_queue_consumer processes",
    "inprocess": "Worker in forked processes",
}


def drain_table(entries: list[dict[str, Any]]) -> list[str]:
    """The drains; with several process counts, each rate as a share of the first's."""
    counts = list(dict.fromkeys(entry["processes"] for entry in entries))
    scaling = len(counts) > 1
    head = ["drain (no-op items)", "txqueue", "hand-written", "% of it"]
    if scaling:
        head += [f"txqueue % of x{counts[0]}", f"hand-written % of x{counts[0]}"]
    rows = [[*head, "exactly once"]]
    for entry in entries:
        shape = f"{entry['strategy']}, batch {entry['batch']}, x{entry['processes']}"
        row = [shape, rate(entry["ours"]), rate(entry["raw"]), pct(entry["percent"])]
        if scaling:
            row += [pct(entry["percent_of_first"]), pct(entry["raw_percent_of_first"])]
        rows.append([*row, "yes" if entry["verified"] else "NO"])
    first = entries[0]
    mode = DRAIN_MODES.get(first.get("mode", ""), first.get("mode", ""))
    caption = f"{first['items']:,} items per drain, ours through {mode}"
    return [caption, *columns(rows)]


def spread_table(rows: list[dict[str, Any]]) -> list[str]:
    """The many-queues part's table: each shape's rate beside one queue's."""
    header = ["one consumer, queues served", "batch", "txqueue", "% of 1 queue", "claims/item"]
    table = [[*header, "exactly once"]]
    for row in rows:
        table.append(
            [
                row["shape"],
                str(row["batch"]),
                rate(row["rate"]),
                pct(row["percent"]),
                f"{row['claims_per_item']:.2f}",
                "yes" if row["verified"] else "NO",
            ]
        )
    return [
        f"{rows[0]['items']:,} items per drain, median of {rows[0]['rounds']}",
        *columns(table),
    ]


def table(result: dict[str, Any]) -> str:
    database = result["database"]
    out = [
        f"{database['vendor']} {database['version']}, database {database['name']!r} "
        f"(alias {database['alias']}), queue {result['queue']!r}; "
        f"{result['cpus']} CPUs, load average {result['load_average']}",
    ]
    if "enqueue" in result:
        rows = [["enqueue", "txqueue", "hand-written", "% of it", "minimal table", "% of it"]]
        for entry in result["enqueue"]:
            rows.append(
                [
                    entry["what"],
                    rate(entry["ours"]),
                    rate(entry["raw"]),
                    pct(entry["percent"]),
                    rate(entry.get("minimal")),
                    pct(entry.get("percent_of_minimal")),
                ]
            )
        out += ["", *columns(rows)]
    if "drain" in result:
        out += ["", *drain_table(result["drain"])]
    if "wakeup" in result:
        wakeup = result["wakeup"]
        rows = [["wake-up, commit -> handler start", "n", "p50", "p95", "max", "p50 % of raw"]]
        for label, key, share in (
            ("idle consumer", "latency", pct(wakeup["percent"])),
            ("cold start (first second)", "cold_start", ""),
            (wakeup["baseline_label"], "baseline", ""),
            ("hand-written claim statement alone", "claim_statement", ""),
        ):
            stats = wakeup[key]
            count = "-" if stats is None else str(stats["n"])
            row = [label, count, *(ms(stats, k) for k in ("p50_ms", "p95_ms", "max_ms"))]
            rows.append([*row, share])
        out += ["", *columns(rows)]
        if wakeup.get("idle_cpu_percent") is not None:
            out.append(f"idle consumer CPU: {wakeup['idle_cpu_percent']:.2f}% of one core")
    if "scale" in result:
        header = ["claim rate (batch 10)", "ready", "done", "claimed", "txqueue", "% of 10k"]
        rows = [[*header, "CPU µs/item", "CPU % of 10k"]]
        for entry in result["scale"]:
            rows.append(
                [
                    entry["backlog"],
                    f"{entry['ready']:,}",
                    f"{entry['done']:,}",
                    f"{entry['claimed']:,}",
                    rate(entry["rate"]),
                    pct(entry["percent"]),
                    "-" if entry["cpu_us"] is None else f"{entry['cpu_us']:.0f}",
                    pct(entry["cpu_percent"]),
                ]
            )
        out += ["", *columns(rows)]
    if "spread" in result:
        out += ["", *spread_table(result["spread"])]
    if "fair" in result:
        rows = [["claim rate (batch 10)", "claimed", "txqueue", "% of plain", "% of 10k"]]
        for entry in result["fair"]["claims"]:
            rows.append(
                [
                    entry["backlog"],
                    f"{entry['claimed']:,}",
                    rate(entry["rate"]),
                    pct(entry["percent_of_plain"]),
                    pct(entry["percent_of_10k"]),
                ]
            )
        out += ["", *columns(rows)]
        rows = [["enqueue(), one per transaction", "txqueue", "% of plain"]]
        for entry in result["fair"]["enqueue"]:
            rows.append([entry["what"], rate(entry["rate"]), pct(entry["percent"])])
        out += ["", *columns(rows)]
    if result["problems"]:
        out += ["", "VERIFICATION FAILED:", *(f"- {problem}" for problem in result["problems"])]
    out += ["", f"({result['seconds']:.0f} s)"]
    return "\n".join(out)
