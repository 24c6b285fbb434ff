"""Handlers for the consumer tests, autodiscovered like any app's queues.py."""

import time

from django_txqueue.registry import handler

from .models import Run


@handler("echo")
def echo(item):
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    return item.payload


@handler("boom")
def boom(item):
    raise ValueError(f"boom {item.payload}")


@handler("slow")
def slow(item):
    Run.objects.create(item_id=item.pk, consumer=item.pid)
    time.sleep(item.payload.get("seconds", 0.5) if isinstance(item.payload, dict) else 0.5)
    return "slept"


@handler("noop")
def noop(item):
    return None


@handler("bench")
def bench(item):
    """tests/bench/wakeup.py: the item's result is the wall-clock time its handler started."""
    return time.time()


@handler("exits")
def exits(item):
    """A handler that calls sys.exit(): its item's failure, not the consumer's end."""
    raise SystemExit(3)


@handler("interrupts")
def interrupts(item):
    raise KeyboardInterrupt
