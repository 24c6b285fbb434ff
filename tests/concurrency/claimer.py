"""A child process: claim batches from one queue until it is empty, ack them, print ids.

Usage: python -m tests.concurrency.claimer QUEUE STRATEGY BATCH START_AT [HOLD_MS [MAX_ITEMS]]

With HOLD_MS, each item is held that long between its start and end, which its result
records (wall clock), so that a test can check how processing intervals overlap. With
MAX_ITEMS (0: no limit), it stops once it has claimed that many.
"""

import json
import sys
import time

import django


def main(
    queue_name: str, strategy: str, batch: int, start_at: float, hold: float, max_items: int
) -> None:
    django.setup()
    from django_txqueue import Queue

    queue = Queue(queue_name)
    time.sleep(max(0.0, start_at - time.time()))
    claimed, empty_claims = [], 0
    # Stop after a few empty claims in a row: under contention one claim can come
    # back empty while others still hold the last items.
    while empty_claims < 3 and not (max_items and len(claimed) >= max_items):
        items = queue.claim(batch, strategy=strategy)
        if not items:
            empty_claims += 1
            time.sleep(0.05)
            continue
        empty_claims = 0
        for item in items:
            result = {"by": item.pid, "start": time.time()}
            if hold:
                time.sleep(hold)
            result["end"] = time.time()
            if not item.ack(result=result):
                raise SystemExit(f"ack of freshly claimed item {item.pk} was fenced")
            claimed.append(item.pk)
    print(json.dumps(claimed))


if __name__ == "__main__":
    hold_ms = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    max_items = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]), hold_ms / 1000, max_items)
