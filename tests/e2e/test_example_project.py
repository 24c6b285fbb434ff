"""example_project end to end: its commands run as a user runs them, each in a process of
its own, against a database of the example's own (not the suite's test database).

The database (example.py says which) is created for this module and dropped after it. The
fake SMS gateway gets a fresh file for each test.
"""

import importlib.util
import json
import re
import subprocess
import sys
import threading

import pytest

from .example import EXAMPLE, TIMEOUT, VENDOR, example_env, manage

pytestmark = pytest.mark.slow

# Seats above the demo's, so that the tests do not depend on their order.
RACED_SEAT, TWICE_SEAT, PAGE_SEAT = 41, 42, 43


def test_demo_sends_one_sms_per_booking(example_database):
    if VENDOR == "sqlite":
        # The demo's own fresh file; the site's db.sqlite3 must stay as it was.
        url = None
        site_db = EXAMPLE / "db.sqlite3"
        before = site_db.stat().st_mtime_ns if site_db.exists() else None
    else:
        url = example_database  # the demo empties it first, and says so
    done = manage(["demo", "--seats", "8"], example_env(url), check=False)

    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    assert done.stdout.splitlines()[-3:] == ["Bookings: 8", "SMS sent: 8", "Duplicates: 0"]
    assert "Seats lost to races: 2" in output
    if url is None:
        assert "a fresh SQLite file" in output
        assert (site_db.stat().st_mtime_ns if site_db.exists() else None) == before
    else:
        assert "Migrated, then emptied the demo's tables" in output


def test_the_examples_own_tests_pass(example_database):
    """cinema/tests.py, written with django_txqueue.testing, run as its project runs them
    (Django's test runner makes a test database beside the example's)."""
    done = manage(["test", "cinema", "--noinput", "-v", "2"], example_env(example_database))
    output = done.stdout + done.stderr
    assert "Ran 3 tests" in output and "\nOK\n" in output, output  # manage() checked its exit


def test_racing_bookings_of_one_seat_make_one_booking_and_one_sms(example):
    env = example.env()
    racers = [
        subprocess.Popen(
            [sys.executable, str(EXAMPLE / "manage.py"), "book", str(RACED_SEAT), f"+1555000{n}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for n in range(6)
    ]
    results = [(racer.wait(TIMEOUT), *racer.communicate()) for racer in racers]

    won = [out for code, out, _ in results if code == 0]
    lost = [err for code, _, err in results if code != 0]
    assert len(won) == 1, results
    assert len(lost) == 5, results
    assert all(f"Seat {RACED_SEAT} is already booked." in err for err in lost), lost
    booking = int(re.search(r"booking #(\d+)", won[0]).group(1))

    example.consume()
    messages = example.messages(f"sms:booking:{booking}")
    assert len(messages) == 1, messages
    assert f"seat {RACED_SEAT} is yours" in messages[0]["body"]


def test_two_runs_of_one_bookings_sms_deliver_one_message(example):
    out = example.manage("book", str(TWICE_SEAT), "+15550142").stdout
    booking = int(re.search(r"booking #(\d+)", out).group(1))
    # A second item for the same booking, without the dedup_key that would refuse it.
    example.shell(
        "from django_txqueue import enqueue; "
        f"enqueue('sms', {{'booking': {booking}}}, key='booking:{booking}')"
    )

    # Two handler threads, one batch of two: both runs of the SMS at the same time.
    example.manage("run_queue_consumer", "sms", "--burst", "--concurrency", "2", "-v", "0")

    results = json.loads(
        example.shell(
            "import json; from django_txqueue import QueueItem; print(json.dumps(list("
            f"QueueItem.objects.filter(queue='sms', key='booking:{booking}')"
            ".values('status', 'result'))))"
        )
    )
    assert [item["status"] for item in results] == [3, 3]  # both DONE
    assert sorted(item["result"]["sent_now"] for item in results) == [False, True]
    assert len(example.messages(f"sms:booking:{booking}")) == 1


PAGE = """
import sys
from django.test import Client
from django.test.utils import setup_test_environment
setup_test_environment()  # lets the Client's host, testserver, in
client = Client()
{body}
"""


def bookings_row(page, seat):
    """The state cell and the detail cell of ``seat``'s row on the bookings page."""
    row = re.search(
        rf'<tr id="booking-\d+">\s*<td>{seat}</td>.*?</tr>', page, flags=re.DOTALL
    ).group(0)
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row, flags=re.DOTALL)
    return cells[3], cells[4]


def test_booking_page_and_the_sms_states_on_the_bookings_page(example):
    posted = example.shell(
        PAGE.format(
            body=(
                f"first = client.post('/', {{'seat': {PAGE_SEAT}, 'phone': '+15550143'}}, "
                "follow=True)\n"
                "assert first.redirect_chain == [('/bookings/', 302)], first.redirect_chain\n"
                f"again = client.post('/', {{'seat': {PAGE_SEAT}, 'phone': '+15550144'}})\n"
                "sys.stdout.write(first.content.decode() + '\\n=====\\n' + again.content.decode())"
            )
        )
    )
    listing, again = posted.split("\n=====\n")
    assert f"Seat {PAGE_SEAT} is booked" in listing
    assert bookings_row(listing, PAGE_SEAT) == ("pending", "")
    assert f"Seat {PAGE_SEAT} is already booked." in again  # the form's error, re-shown

    def bookings_page():
        return example.shell(PAGE.format(body="print(client.get('/bookings/').content.decode())"))

    example.consume(CINEMA_SMS_FAIL_RATE="1")  # one failed attempt, retried later
    state, detail = bookings_row(bookings_page(), PAGE_SEAT)
    assert state == "retrying"
    assert re.fullmatch(
        r"\d of 10 attempts; last error: cinema\.gateway\.GatewayError: .*", detail
    )

    example.consume()  # the retry is due within 0.2 s, less than a consumer's start-up
    state, detail = bookings_row(bookings_page(), PAGE_SEAT)
    assert state == "sent"
    assert detail.startswith("SM")


def test_reminders_go_to_every_booking_then_one_report_counts_them(example):
    """The example's flow (cinema/reminders.py): a reminder per booking side by side, then
    a report once all of them have ended, reading what they returned."""
    for seat in (51, 52, 53):
        example.manage("book", str(seat), f"+155502{seat}")
    out = example.manage("remind", "The film starts at 8").stdout
    report = int(re.search(r"then report #(\d+)", out).group(1))
    assert int(re.search(r"(\d+) reminders", out).group(1)) >= 3  # and earlier tests' seats

    consumer = example.manage(
        "run_queue_consumer", "reminder", "reminder-report", "--burst", "--concurrency", "2"
    )

    result = json.loads(
        example.shell(
            "import json; from django_txqueue import QueueItem; "
            f"item = QueueItem.objects.get(pk={report}); "
            "print(json.dumps({'status': item.status, 'result': item.result, "
            "'parents': item.dependencies().count(), 'waiting_for': item.waiting_for, "
            "'statuses': sorted(p.status for p in item.dependencies())}))"
        )
    )
    # Said in full if it fails: what the report still waits for, and the consumer's words.
    assert result["status"] == 3, (result, consumer.stdout[-3000:], consumer.stderr[-3000:])
    assert result["result"] == {"sent": result["parents"], "not_sent": 0}
    log = json.loads(example.manage("sms_log", "--json").stdout)
    sent = [message for message in log["messages"] if message["body"] == "The film starts at 8"]
    assert len(sent) == result["parents"]


def test_the_fake_gateways_first_calls_at_once_all_deliver(tmp_path):
    """Handler threads that call the gateway at once, on a fresh file, each deliver: its
    schema is made under its write lock (switching a new file to WAL there failed calls now
    and then, "database is locked": a retry that a burst run could exit before)."""
    if VENDOR != "sqlite":  # a SQLite file whatever the site's database: one run is enough
        pytest.skip(f"runs with TXQUEUE_TEST_DB=sqlite (this run: {VENDOR})")
    spec = importlib.util.spec_from_file_location("gateway", EXAMPLE / "cinema" / "gateway.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # Four callers on each of 200 fresh files: the WAL switch failed a call on about one
    # file in twenty, so with it this test passes about once in 30,000 runs.
    callers, files, errors = 4, 200, []

    def send(gateway, barrier, n):
        barrier.wait()
        try:
            gateway.send("+15550100", "hello", idempotency_key=f"key {n}")
        except Exception as exc:  # noqa: BLE001 - each caller's error, reported together
            errors.append(repr(exc))

    for file in range(files):
        gateway = module.Gateway(tmp_path / f"gateway-{file}.sqlite3")
        barrier = threading.Barrier(callers)
        failed_before = len(errors)
        threads = [
            threading.Thread(target=send, args=(gateway, barrier, n)) for n in range(callers)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        # Each call delivered once or failed before delivering: nothing half-written.
        assert len(gateway.messages()) == callers - (len(errors) - failed_before), errors
    assert errors == []
