from django.apps import AppConfig


class CinemaConfig(AppConfig):
    name = "cinema"
    default_auto_field = "django.db.models.BigAutoField"
