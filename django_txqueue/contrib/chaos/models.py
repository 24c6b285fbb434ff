"""The chaos tool's own table: the record of every handler run on its queue."""

from __future__ import annotations

from django.db import models

from django_txqueue.validation import MAX_QUEUE_NAME


class ChaosRun(models.Model):
    """One handler run on ``txqueue_chaos``'s queue: the item, the claim it ran under, the
    consumer, and when it started and finished (None: its consumer died first)."""

    id = models.BigAutoField(primary_key=True)
    queue = models.CharField(max_length=MAX_QUEUE_NAME)
    item_id = models.BigIntegerField(db_index=True)
    claim_token = models.BigIntegerField()
    consumer = models.CharField(max_length=255)
    started_at = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name = "chaos run"

    def __str__(self) -> str:
        return f"run of {self.item_id}"
