"""The SMS handler: ``run_queue_consumer sms`` runs it for each booking's queue item."""

from django.utils import timezone

from django_txqueue import Status, handler, once

from . import reminders, sms
from .gateway import default_gateway
from .models import Booking


@handler(sms.QUEUE)
def send_booking_sms(item):
    """Send the booking's SMS and record it, once, however often the item runs.

    A second run (the item rescued after its consumer died, or a second item for the same
    booking) finds the committed record and sends nothing. If a consumer dies between the
    provider's answer and the commit, the record rolls back and the next run calls the
    provider again, with the same idempotency key: the provider does not deliver twice.
    A GatewayError rolls the record back too, and the consumer retries with back-off.
    """
    booking = Booking.objects.filter(pk=item.payload["booking"]).first()
    if booking is None:
        return {"skipped": "the booking was deleted"}
    key = sms.effect_key(booking.pk)
    with once(key) as first:
        if first:
            booking.sms_message_id = default_gateway().send(
                booking.phone, sms.text_for(booking), idempotency_key=key
            )
            booking.sms_sent_at = timezone.now()
            booking.save(update_fields=["sms_message_id", "sms_sent_at"])
    if not first:
        booking.refresh_from_db(fields=["sms_message_id"])
    return {"message_id": booking.sms_message_id, "sent_now": first}


@handler(reminders.REMINDER_QUEUE)
def send_reminder(item):
    """One booking's reminder; the idempotency key names this flow's reminder, so a second
    run of the item (or a second reminder flow) never delivers it twice."""
    booking = Booking.objects.filter(pk=item.payload["booking"]).first()
    if booking is None:
        return {"skipped": "the booking was deleted"}
    key = f"reminder:{item.flow}:booking:{booking.pk}"
    message_id = default_gateway().send(booking.phone, item.payload["text"], idempotency_key=key)
    return {"message_id": message_id}


@handler(reminders.REPORT_QUEUE)
def report_reminders(item):
    """Once every reminder has ended: how many were sent, read from what they returned."""
    statuses = [parent.status for parent in item.dependencies()]
    sent = sum(1 for status in statuses if status == Status.DONE)
    return {"sent": sent, "not_sent": len(statuses) - sent}
