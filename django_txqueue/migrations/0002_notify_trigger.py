"""On PostgreSQL, a trigger NOTIFYs listening consumers of new items at commit."""

from django.db import migrations

from django_txqueue.claim import vendor_sql

TABLE = "django_txqueue_queueitem"


def install(apps, schema_editor):
    vendor = vendor_sql(schema_editor.connection)
    if getattr(vendor, "HAS_NOTIFY", False):
        vendor.install_notify_trigger(schema_editor, TABLE)


def remove(apps, schema_editor):
    vendor = vendor_sql(schema_editor.connection)
    if getattr(vendor, "HAS_NOTIFY", False):
        vendor.remove_notify_trigger(schema_editor, TABLE)


class Migration(migrations.Migration):
    dependencies = [("django_txqueue", "0001_initial")]
    operations = [migrations.RunPython(install, remove, elidable=False)]
