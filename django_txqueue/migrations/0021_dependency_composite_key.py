# A flow's edges keyed by (parent, item), without their serial id (docs/flows.md: what it
# costs). Django cannot turn a primary key into a composite one in place: the edges move
# to a new table, which then takes the old one's name.

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('django_txqueue', '0020_schedule'),
    ]

    operations = [
        migrations.CreateModel(
            name='QueueDependencyNew',
            fields=[
                ('pk', models.CompositePrimaryKey('parent', 'item', blank=True, editable=False, primary_key=True, serialize=False)),
                ('parent', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='django_txqueue.queueitem')),
                ('item', models.ForeignKey(db_constraint=False, db_index=False, on_delete=django.db.models.deletion.DO_NOTHING, related_name='+', to='django_txqueue.queueitem')),
            ],
            options={
                'verbose_name': 'queue dependency',
                'verbose_name_plural': 'queue dependencies',
                'indexes': [models.Index(fields=['item'], name='txqueue_dependency_item')],
            },
        ),
        migrations.RunSQL(
            'INSERT INTO django_txqueue_queuedependencynew (parent_id, item_id) '
            'SELECT parent_id, item_id FROM django_txqueue_queuedependency',
            reverse_sql='INSERT INTO django_txqueue_queuedependency (parent_id, item_id) '
            'SELECT parent_id, item_id FROM django_txqueue_queuedependencynew',
        ),
        migrations.DeleteModel(name='QueueDependency'),
        migrations.RenameModel(old_name='QueueDependencyNew', new_name='QueueDependency'),
    ]
