"""Consuming: what ``run_queue_consumer`` runs.

- ``worker``: the loop (claim, hand to handler threads, settle, shut down);
- ``rotation``: which queue a consumer claims from next; ``claims``: one queue's claim path
  and where a consumer's claims resume; ``wakeup``: how an idle consumer hears of work;
- ``registry``: ``@handler``, the function that handles a queue; ``execution``: one
  handler run and its ``Outcome``; ``settle``: outcomes written as acknowledgements,
  retries and failures;
- ``housekeeping``: the thread that runs the jobs ``heartbeat`` (the Consumer row, leases,
  cancellation requests), ``rescue`` (stuck items) and ``purge`` (finished items), and the
  schedule's ticks;
- ``readiness``: the database waited for at start-up; ``supervisor``: ``--processes N``.
"""
