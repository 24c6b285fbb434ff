"""Module-level functions for on_commit tests: each records its run as a ``Run`` row."""

import os

from .models import Run


def record(label, *, times=1):
    """Record a run of ``label`` by this process (``item_id`` holds the OS pid)."""
    for _ in range(times):
        Run.objects.create(item_id=os.getpid(), consumer=label)


def fails_once(label):
    """Raise on the first call for ``label``, record later ones."""
    if not Run.objects.filter(consumer=f"{label}:failed").exists():
        Run.objects.create(item_id=os.getpid(), consumer=f"{label}:failed")
        raise RuntimeError(f"first call of {label} fails")
    record(label)


def exit_now(label):
    """Record the start of the call, then die without a word (as a killed process would)."""
    record(f"{label}:started")
    os._exit(0)
