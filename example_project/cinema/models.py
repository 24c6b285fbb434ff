"""A booking is a seat and a phone number; the database lets a seat be booked once."""

from django.core.validators import RegexValidator
from django.db import models

phone_number = RegexValidator(
    r"^\+?[0-9]{6,15}$", "Enter a phone number: 6 to 15 digits, optionally after a +."
)


class Booking(models.Model):
    seat = models.PositiveIntegerField()
    phone = models.CharField(max_length=16, validators=[phone_number])
    created_at = models.DateTimeField(auto_now_add=True)
    # Written by the SMS handler, in the transaction that records the send (cinema/queues.py).
    sms_message_id = models.CharField(max_length=64, blank=True, default="")
    sms_sent_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["seat"]
        constraints = [
            # The one authority on "seat taken": two racing bookings cannot both commit.
            models.UniqueConstraint(fields=["seat"], name="cinema_booking_one_per_seat"),
        ]

    def __str__(self):
        return f"Seat {self.seat} for {self.phone}"
