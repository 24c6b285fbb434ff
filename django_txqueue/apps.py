from django.apps import AppConfig


class TxQueueConfig(AppConfig):
    name = "django_txqueue"
    verbose_name = "Queue"
    default_auto_field = "django.db.models.BigAutoField"

    def ready(self) -> None:
        from . import checks  # noqa: F401  registers the system checks
