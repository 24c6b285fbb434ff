"""``remind TEXT``: a reminder SMS to every booking, then one report (a flow)."""

from django.core.management.base import BaseCommand
from django.db import transaction

from cinema.reminders import send_reminders


class Command(BaseCommand):
    help = "Send TEXT to every booking, side by side, then report how many went out."

    def add_arguments(self, parser):
        parser.add_argument("text", help="The reminder's text.")

    def handle(self, *args, **options):
        with transaction.atomic():
            flow = send_reminders(options["text"])
        if flow is None:
            self.stdout.write("No bookings: nothing to remind.")
            return
        self.stdout.write(
            f"Flow {flow.id}: {len(flow.items) - 1} reminders, then report #{flow.items[-1].pk}."
        )
