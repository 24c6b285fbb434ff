# Flows (docs/flows.md): an item counts the items enqueued to wait for it, where it had a
# flag. A producer attaching one changes the count, so an acknowledgement that finds it as
# its claim read it knows every edge to the row, and counts down in one statement. The
# edges lose the index on their item, which their unique constraint's index covers.

import django.db.models.deletion
from django.db import migrations, models
from django.db.models import Count, OuterRef, Subquery


def count_edges(apps, schema_editor):
    """Rows flagged as waited for get the number of their edges; the others keep 0."""
    items = apps.get_model("django_txqueue", "QueueItem")
    edges = apps.get_model("django_txqueue", "QueueDependency")
    counted = (
        edges.objects.filter(parent_id=OuterRef("pk"))
        .order_by()
        .values("parent_id")
        .annotate(n=Count("pk"))
        .values("n")
    )
    items._base_manager.using(schema_editor.connection.alias).filter(
        has_dependents=True
    ).update(dependent_count=Subquery(counted))


class Migration(migrations.Migration):

    dependencies = [
        ('django_txqueue', '0015_flows'),
    ]

    operations = [
        migrations.AddField(
            model_name='queueitem',
            name='dependent_count',
            field=models.PositiveIntegerField(db_default=0, default=0, editable=False),
        ),
        migrations.RunPython(count_edges, migrations.RunPython.noop, elidable=True),
        migrations.RemoveField(
            model_name='queueitem',
            name='has_dependents',
        ),
        migrations.AlterField(
            model_name='queuedependency',
            name='item',
            field=models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='django_txqueue.queueitem'),
        ),
    ]
