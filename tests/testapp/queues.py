"""Handlers for the consumer tests, autodiscovered like any app's queues.py."""

import asyncio
import sqlite3
import threading
import time

from django.db import connection

from django_txqueue import once
from django_txqueue.consumer.registry import handler

from . import gateway
from .models import Run


@handler("echo")
def echo(item):
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    return item.payload


@handler("elsewhere")
def elsewhere(item):
    """Records its run on the item's own database (the queue lives on alias "other")."""
    Run.objects.using(item._state.db).create(item_id=item.pk, consumer=item.pid)
    return item.payload


@handler("boom")
def boom(item):
    raise ValueError(f"boom {item.payload}")


@handler("slow")
def slow(item):
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    time.sleep(item.payload.get("seconds", 0.5) if isinstance(item.payload, dict) else 0.5)
    return "slept"


@handler("in-c")
def in_c(item):
    """Counts ``rows`` rows (default: for hours) in SQLite's C code: a call that Python's
    signal handlers wait for, as for a driver's blocking query. Its run is recorded from
    another thread once the call is under way, so that a test that signals the consumer on
    seeing it finds the handler in C, not just before."""
    rows = item.payload.get("rows", 10**12) if isinstance(item.payload, dict) else 10**12
    calling = threading.Event()

    def record_once_in_c():
        calling.wait()
        time.sleep(0.5)  # the caller's few bytecodes into the call, however loaded
        Run.objects.create(item_id=item.pk, consumer=item.pid)
        connection.close()

    threading.Thread(target=record_once_in_c, daemon=True).start()
    counter = sqlite3.connect(":memory:")
    try:
        calling.set()
        return counter.execute(
            "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n LIMIT ?) "
            "SELECT count(*) FROM n",
            (rows,),
        ).fetchone()[0]
    finally:
        counter.close()


@handler("noop")
def noop(item):
    return None


@handler("exits")
def exits(item):
    """A handler that calls sys.exit(): its item's failure, not the consumer's end."""
    raise SystemExit(3)


@handler("interrupts")
def interrupts(item):
    raise KeyboardInterrupt


@handler("sms")
def send_sms(item):
    """Send once per booking, however often the item (or another for the booking) runs.
    The Run row is the effect's bookkeeping, written in the record's transaction."""
    booking = item.payload["booking"]
    with once(f"sms:booking:{booking}") as first:
        if first:
            gateway.send(item.payload["to"], f"Booking {booking} confirmed")
            Run.objects.create(item_id=booking, consumer="sms")
        time.sleep(item.payload.get("linger", 0))  # hold the transaction open (races)


@handler("atomic", atomic=True)
def record_atomically(item):
    """Its effect, a Run row, commits with the item's acknowledgement or not at all.

    Payload options: ``entered`` (a file created once the row is written, uncommitted),
    ``seconds`` (a pause after that), ``fail`` (raise), ``result`` (returned)."""
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    options = item.payload if isinstance(item.payload, dict) else {}
    if "entered" in options:
        with open(options["entered"], "w"):
            pass
    time.sleep(options.get("seconds", 0))
    if options.get("fail"):
        raise ValueError("the atomic handler failed")
    return options.get("result", "recorded")


@handler("ordered")
def timed(item):
    """Records when it ran (wall clock) in its result, for tests of ordered groups."""
    start = time.time()
    time.sleep(0.01)
    return {"start": start, "end": time.time()}


@handler("soak")
def soak(item):
    """benchmarks/soak.py: when the handler started, against the enqueue time it carries."""
    return {"started": time.time()}


@handler("cancellable")
def cancellable(item):
    """Works for up to ``seconds`` (default 30), polling its cancellation request as a long
    handler should; returns "stopped" when asked, else "finished"."""
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    options = item.payload if isinstance(item.payload, dict) else {}
    deadline = time.monotonic() + options.get("seconds", 30)
    while time.monotonic() < deadline:
        if item.cancel_requested():
            return "stopped"
        time.sleep(0.02)
    return "finished"


LEAKED = []  # what the "leaky" handler never lets go of


@handler("leaky")
def leaky(item):
    """Leaks 10 MB per item, touched so that it is resident (a C extension's leak, say)."""
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    LEAKED.append(bytearray(10 * 2**20))
    time.sleep(0.05)


@handler("progress")
def reports_progress(item):
    """Works through ``steps`` steps of ``pause`` seconds, reporting each; with ``calls``,
    reports that many times as fast as it can first (``report_progress`` holds them back)."""
    options = item.payload if isinstance(item.payload, dict) else {}
    steps = options.get("steps", 3)
    for call in range(options.get("calls", 0)):
        item.report_progress(call, options["calls"], "counting")
    for step in range(steps):
        item.report_progress(step, steps, f"step {step} of {steps}")
        time.sleep(options.get("pause", 0))
    item.report_progress(steps, steps, "all steps")
    return "done"


handler("progress_atomic", atomic=True)(reports_progress)


@handler("async-nap")
async def async_nap(item):
    """Records its run, then awaits ``seconds`` (default 0.05): a provider's API call."""
    await Run.objects.acreate(item_id=item.pk, consumer=item.pid)
    options = item.payload if isinstance(item.payload, dict) else {}
    await asyncio.sleep(options.get("seconds", 0.05))
    return "napped"


@handler("nap")
def nap(item):
    """``async-nap``'s sync twin: records its run, then sleeps ``seconds`` (default 0.05)."""
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    options = item.payload if isinstance(item.payload, dict) else {}
    time.sleep(options.get("seconds", 0.05))
    return "napped"
