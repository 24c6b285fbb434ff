"""The booking's SMS: its text, its queue item, and its state as the bookings page shows it."""

from dataclasses import dataclass

from django_txqueue import QueueItem, Status, enqueue

QUEUE = "sms"


def item_key(booking_pk):
    """The queue item's key (and dedup_key): how a page finds the SMS of a booking."""
    return f"booking:{booking_pk}"


def effect_key(booking_pk):
    """Names the send itself: the once() record and the gateway's idempotency key."""
    return f"sms:booking:{booking_pk}"


def text_for(booking):
    return f"Booking #{booking.pk}: seat {booking.seat} is yours. Enjoy the film!"


def queue_for(booking):
    """Enqueue the booking's SMS in the caller's transaction."""
    key = item_key(booking.pk)
    return enqueue(QUEUE, {"booking": booking.pk}, key=key, dedup_key=key)


@dataclass
class SmsState:
    label: str  # pending, sending, retrying, sent, failed, or "not queued"
    detail: str = ""


def states_for(bookings):
    """Booking pk to SmsState, read from each booking's latest SMS item (one query)."""
    keys = {item_key(booking.pk): booking.pk for booking in bookings}
    latest = {}
    for item in QueueItem.objects.filter(queue=QUEUE, key__in=keys).order_by("pk"):
        latest[keys[item.key]] = item
    return {booking.pk: state_of(booking, latest.get(booking.pk)) for booking in bookings}


def state_of(booking, item):
    if item is None:  # purged after it was done, or never queued
        if booking.sms_sent_at:
            return SmsState("sent", booking.sms_message_id)
        return SmsState("not queued")
    attempts = f"{item.attempts} of {item.max_attempts} attempts"
    if item.status == Status.DONE:
        return SmsState("sent", booking.sms_message_id)
    if item.status == Status.FAILED:
        return SmsState("failed", f"{attempts}; last error: {last_line(item.last_error)}")
    if item.status == Status.IN_PROGRESS:
        return SmsState("sending", f"attempt {item.attempts} of {item.max_attempts}")
    if item.attempts:  # READY again after failed (or rescued) attempts
        return SmsState("retrying", f"{attempts}; last error: {last_line(item.last_error)}")
    return SmsState("pending")


def last_line(error):
    """The exception line of a traceback (the consumer keeps the whole traceback)."""
    lines = error.strip().splitlines()
    return lines[-1] if lines else ""
