# A flow's items found along the primary key between the first and last its enqueue wrote
# (QueueFlow) instead of by an index on ``flow``, which every claim and acknowledgement
# of a flow item wrote again on PostgreSQL (docs/flows.md: what it costs).

from django.db import migrations, models
from django.db.models import Max, Min

BATCH = 1000


def record_flows(apps, schema_editor):
    """A row for each flow already enqueued, read by the index about to go."""
    items = apps.get_model("django_txqueue", "QueueItem")
    flows = apps.get_model("django_txqueue", "QueueFlow")
    alias = schema_editor.connection.alias
    spans = (
        items._base_manager.using(alias)
        .filter(flow__isnull=False)
        .values("flow")
        .annotate(first=Min("pk"), last=Max("pk"))
        .order_by("flow")
    )
    rows = []  # a batch at a time: an install may hold millions of flows
    for span in spans.iterator(chunk_size=BATCH):
        rows.append(flows(id=span["flow"], first_item=span["first"], last_item=span["last"]))
        if len(rows) == BATCH:
            flows._base_manager.using(alias).bulk_create(rows)
            rows = []
    flows._base_manager.using(alias).bulk_create(rows)


class Migration(migrations.Migration):

    dependencies = [
        ('django_txqueue', '0021_dependency_composite_key'),
    ]

    operations = [
        migrations.CreateModel(
            name='QueueFlow',
            fields=[
                ('id', models.UUIDField(editable=False, primary_key=True, serialize=False)),
                ('first_item', models.BigIntegerField()),
                ('last_item', models.BigIntegerField()),
            ],
            options={
                'verbose_name': 'queue flow',
            },
        ),
        migrations.RunPython(record_flows, migrations.RunPython.noop),
        migrations.RemoveIndex(
            model_name='queueitem',
            name='txqueue_item_flow',
        ),
    ]
