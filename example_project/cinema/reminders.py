"""A flow: a reminder SMS to every booking, side by side, then one report once all of them
have ended, which reads what each reminder returned (docs/flows.md)."""

from django_txqueue import group, step

from .models import Booking

REMINDER_QUEUE = "reminder"
REPORT_QUEUE = "reminder-report"


def send_reminders(text):
    """Enqueue the reminders and their report, in the caller's transaction; the Flow.

    The report runs even if some reminders failed for good (``after_failure="run"``): it
    says how many went out."""
    reminders = [
        step(REMINDER_QUEUE, {"booking": booking.pk, "text": text})
        for booking in Booking.objects.all()
    ]
    if not reminders:
        return None
    report = step(REPORT_QUEUE, {"text": text}, after_failure="run")
    return group(*reminders, then=report).enqueue()
