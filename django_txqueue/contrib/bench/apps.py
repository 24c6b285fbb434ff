from django.apps import AppConfig


class BenchConfig(AppConfig):
    name = "django_txqueue.contrib.bench"
    label = "txqueue_bench"
    verbose_name = "Queue benchmark"
