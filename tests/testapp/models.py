"""A QueueModel subclass: the seed-003 pattern of making an app's own table a queue."""

from django.db import models

from django_txqueue.models import QueueModel


class Thing(QueueModel):
    id = models.BigAutoField(primary_key=True)
    name = models.CharField(max_length=50)
    group = models.CharField(max_length=20, default="a")

    class Meta(QueueModel.Meta):
        pass

    def __str__(self) -> str:
        return self.name


class Run(models.Model):
    """One handler execution, recorded by the test handlers to count runs per item."""

    item_id = models.BigIntegerField(db_index=True)
    consumer = models.CharField(max_length=255)

    def __str__(self) -> str:
        return f"run of {self.item_id}"
