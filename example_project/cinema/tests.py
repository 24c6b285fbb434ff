"""The cinema's own tests, as a project writes them with django_txqueue.testing
(docs/testing.md): `python manage.py test cinema`.

Django's TestCase runs each test in a transaction that is rolled back; the helpers run the
SMS handler in the test's own thread, so it sees the booking and its writes roll back too.
The fake gateway delivers into a file of the test's own.
"""

import tempfile
from pathlib import Path

from django.test import TestCase, override_settings

from django_txqueue import Status, testing

from . import sms
from .booking import book_seat
from .gateway import default_gateway


class BookingTests(TestCase):
    def setUp(self):
        scratch = tempfile.TemporaryDirectory()
        self.addCleanup(scratch.cleanup)
        gateway = {"PATH": str(Path(scratch.name) / "gateway.sqlite3"), "FAIL_RATE": 0, "DELAY": 0}
        overridden = override_settings(CINEMA_SMS_GATEWAY=gateway)
        overridden.enable()
        self.addCleanup(overridden.disable)

    def test_booking_a_seat_queues_one_sms(self):
        booking = book_seat(12, "+15550001")
        testing.assert_enqueued(sms.QUEUE, {"booking": booking.pk}, count=1)

    def test_running_the_queue_sends_the_sms_once(self):
        booking = book_seat(13, "+15550002")
        self.assertEqual(testing.drain(sms.QUEUE).counts, {"done": 1})
        booking.refresh_from_db()
        self.assertIsNotNone(booking.sms_sent_at)
        self.assertEqual(len(default_gateway().messages()), 1)
        [item] = testing.assert_enqueued(sms.QUEUE, {"booking": booking.pk}, status=Status.DONE)
        self.assertEqual(item.result["sent_now"], True)

    def test_inline_sends_it_as_the_booking_is_made(self):
        with testing.inline():
            booking = book_seat(14, "+15550003")
        booking.refresh_from_db()
        self.assertIsNotNone(booking.sms_sent_at)
