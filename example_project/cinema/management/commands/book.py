"""``book SEAT PHONE``: book a seat as the booking page does; exit 1 if it cannot be had."""

from django.core.management.base import BaseCommand, CommandError

from cinema.booking import SeatTaken, book_seat
from cinema.forms import BookingForm


class Command(BaseCommand):
    help = "Book SEAT for PHONE and queue its SMS, in one transaction."

    def add_arguments(self, parser):
        parser.add_argument("seat")
        parser.add_argument("phone")

    def handle(self, *args, seat, phone, **options):
        form = BookingForm({"seat": seat, "phone": phone})
        if not form.is_valid():
            problems = [f"{field}: {' '.join(errors)}" for field, errors in form.errors.items()]
            raise CommandError("; ".join(problems))
        try:
            booking = book_seat(form.cleaned_data["seat"], form.cleaned_data["phone"])
        except SeatTaken as taken:
            raise CommandError(str(taken)) from taken
        self.stdout.write(
            f"Booked seat {booking.seat} for {booking.phone} (booking #{booking.pk}); "
            "its SMS is queued."
        )
