"""Booking a seat: the booking and the intention to send its SMS commit together."""

from django.db import IntegrityError

from django_txqueue import run_in_transaction

from . import sms
from .models import Booking


class SeatTaken(Exception):
    def __init__(self, seat):
        super().__init__(f"Seat {seat} is already booked.")
        self.seat = seat


def book_seat(seat, phone):
    """Book ``seat`` for ``phone`` and queue its SMS in one transaction; SeatTaken if the
    seat is booked already (by a concurrent booking too: the unique constraint decides).

    A transaction refused by a conflict (a deadlock; on a Galera cluster, another node's
    conflicting commit) wrote nothing and runs again: ``book`` has no other effect.
    """

    def book():
        booking = Booking.objects.create(seat=seat, phone=phone)
        sms.queue_for(booking)
        return booking

    try:
        booking = run_in_transaction(book)
    except IntegrityError as error:
        # Only the seat's constraint can refuse this insert; ask the database to be sure
        # (after the rollback, so the winner's committed row is visible).
        if Booking.objects.filter(seat=seat).exists():
            raise SeatTaken(seat) from error
        raise
    return booking
