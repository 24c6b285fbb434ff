"""A consumer process of ``txqueue_chaos``: ``run_queue_consumer`` on the chaos queue,
whose handler records each run in ``ChaosRun``.

    python -m django_txqueue.contrib.chaos.consumer QUEUE

Started by the command with the project's settings module and, in
``TXQUEUE_CHAOS_SETTINGS``, the short leases and intervals it wants (merged into
``TXQUEUE`` for this process only). The handler is registered here, not in a
``queues.py``, so that no other consumer ever serves the chaos queue.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from typing import Any

# A run sleeps up to this long, so that kills land inside handlers too.
HOLD_SECONDS = 0.02


def record(item: Any) -> None:
    from django.utils import timezone

    from .models import ChaosRun

    run = ChaosRun.objects.create(
        queue=item.queue,
        item_id=item.pk,
        claim_token=item.claim_token,
        consumer=item.pid,
        started_at=timezone.now(),
    )
    time.sleep(random.uniform(0, HOLD_SECONDS))  # noqa: S311 - timing, not secrecy
    ChaosRun.objects.filter(pk=run.pk).update(finished_at=timezone.now())


def main(queue: str) -> None:
    import django

    django.setup()
    from django.core.management import call_command
    from django.test.utils import override_settings

    from django_txqueue import conf, handler

    handler(queue)(record)
    settings = conf.user_settings()
    overrides = json.loads(os.environ.get("TXQUEUE_CHAOS_SETTINGS", "{}"))
    queues = {**settings.get("QUEUES", {}), **overrides.pop("QUEUES", {})}
    with override_settings(TXQUEUE={**settings, **overrides, "QUEUES": queues}):
        call_command("run_queue_consumer", queue, "--skip-checks", verbosity=0)


if __name__ == "__main__":
    main(sys.argv[1])
