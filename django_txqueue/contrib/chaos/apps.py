from django.apps import AppConfig


class ChaosConfig(AppConfig):
    name = "django_txqueue.contrib.chaos"
    label = "txqueue_chaos"
    verbose_name = "Queue fault injection"
    default_auto_field = "django.db.models.BigAutoField"
