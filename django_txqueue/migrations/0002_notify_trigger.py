"""On PostgreSQL, a trigger NOTIFYs listening consumers of new items at commit.

Frozen: the DDL is written out here, so that later changes to the package cannot
change what this migration did. Other databases have no NOTIFY: nothing to do there.
The payload is the queue name; the channel is ``django_txqueue``. A statement-level
trigger keeps an enqueue_many one INSERT and one notification per queue.
"""

from django.db import migrations

CREATE = [
    """
    CREATE OR REPLACE FUNCTION django_txqueue_notify() RETURNS trigger AS $$
    BEGIN
        PERFORM pg_notify('django_txqueue', queue) FROM (SELECT DISTINCT queue FROM inserted) q;
        RETURN NULL;
    END $$ LANGUAGE plpgsql
    """,
    """
    CREATE TRIGGER django_txqueue_notify AFTER INSERT ON "django_txqueue_queueitem"
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT
    EXECUTE FUNCTION django_txqueue_notify()
    """,
]
DROP = [
    'DROP TRIGGER IF EXISTS django_txqueue_notify ON "django_txqueue_queueitem"',
    "DROP FUNCTION IF EXISTS django_txqueue_notify()",
]


def install(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for sql in CREATE:
            schema_editor.execute(sql)


def remove(apps, schema_editor):
    if schema_editor.connection.vendor == "postgresql":
        for sql in DROP:
            schema_editor.execute(sql)


class Migration(migrations.Migration):
    dependencies = [("django_txqueue", "0001_initial")]
    operations = [migrations.RunPython(install, remove, elidable=False)]
