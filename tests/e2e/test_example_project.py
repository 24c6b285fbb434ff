"""example_project end to end: its commands run as a user runs them, each in a process of
its own, against a database of the example's own (not the suite's test database).

SQLite: a file in a temporary directory. PostgreSQL and MariaDB/MySQL: a database named
``test_txqueue{TXQUEUE_TEST_RUN}_example`` on the suite's server, created for this module
and dropped after it. The fake SMS gateway gets a fresh file for each test.
"""

import json
import os
import re
import subprocess
import sys
from urllib.parse import quote

import pytest
from django.conf import settings

from tests.helpers import ROOT

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "example_project"
# The suite's own server, as tests/settings.py configured it from TXQUEUE_TEST_*.
VENDOR = settings.VENDOR
SERVER = settings.DATABASES["default"]
DATABASE_NAME = f"{SERVER['TEST']['NAME']}_example"
TIMEOUT = 120  # seconds for any one command; each normally takes one or a few


# -- the example's database ----------------------------------------------------------


def server_connection():
    """An autocommit connection to the suite's server, outside any database of ours."""
    address = {"host": SERVER["HOST"], "port": int(SERVER["PORT"]), "user": SERVER["USER"]}
    if VENDOR == "postgresql":
        import psycopg

        return psycopg.connect(**address, dbname="postgres", autocommit=True)
    import MySQLdb

    connection = MySQLdb.connect(**address)
    connection.autocommit(True)
    return connection


def database_url():
    scheme = "postgres" if VENDOR == "postgresql" else "mysql"
    user, host, port = quote(SERVER["USER"]), SERVER["HOST"], SERVER["PORT"]
    return f"{scheme}://{user}@{host}:{port}/{DATABASE_NAME}"


def run_ddl(*statements):
    connection = server_connection()
    try:
        cursor = connection.cursor()
        for statement in statements:
            cursor.execute(statement)
    finally:
        connection.close()


def quoted_name():
    # DDL takes no parameters for names; this one is ours, letters, digits and _ only.
    assert re.fullmatch(r"\w+", DATABASE_NAME), DATABASE_NAME
    return f'"{DATABASE_NAME}"' if VENDOR == "postgresql" else f"`{DATABASE_NAME}`"


@pytest.fixture(scope="module")
def example_database(tmp_path_factory):
    """The DATABASE_URL of a migrated database for the example, dropped afterwards."""
    if VENDOR == "sqlite":
        url = f"sqlite:///{tmp_path_factory.mktemp('example') / 'cinema.sqlite3'}"
        drop = ()
    else:
        name = quoted_name()
        charset = "" if VENDOR == "postgresql" else " CHARACTER SET utf8mb4"
        force = " WITH (FORCE)" if VENDOR == "postgresql" else ""
        drop = (f"DROP DATABASE IF EXISTS {name}{force}",)
        run_ddl(*drop, f"CREATE DATABASE {name}{charset}")
        url = database_url()
    try:
        manage(["migrate", "-v", "0"], example_env(url))
        yield url
    finally:
        if drop:
            run_ddl(*drop)


# -- running the example's commands --------------------------------------------------


def example_env(url, **variables):
    env = {
        **os.environ,
        "DJANGO_SETTINGS_MODULE": "cinema_site.settings",
        "CINEMA_SMS_FAIL_RATE": "0",
        "CINEMA_SMS_DELAY": "0",
        **variables,
    }
    if url is None:
        env.pop("DATABASE_URL", None)
    else:
        env["DATABASE_URL"] = url
    return env


def manage(args, env, *, check=True):
    """Run ``example_project/manage.py ARGS`` from the repository's parent directory (any
    directory works); the finished process, its output as text."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLE / "manage.py"), *args],
        env=env,
        cwd=ROOT.parent,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    if check:
        assert done.returncode == 0, f"manage.py {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done


class Example:
    """The example project on the example database, with a gateway file of this test's."""

    def __init__(self, url, gateway_path):
        self.url = url
        self.gateway_path = gateway_path

    def env(self, **variables):
        return example_env(self.url, CINEMA_SMS_GATEWAY_PATH=str(self.gateway_path), **variables)

    def manage(self, *args, check=True, **variables):
        return manage(args, self.env(**variables), check=check)

    def shell(self, code, **variables):
        """Run Python in ``manage.py shell``; what it printed."""
        return self.manage("shell", "-v", "0", "-c", code, **variables).stdout

    def consume(self, **variables):
        """``run_queue_consumer sms --burst``: every SMS due now, then exit."""
        self.manage("run_queue_consumer", "sms", "--burst", "-v", "0", **variables)

    def messages(self, key):
        """The messages the gateway delivered with this idempotency key."""
        log = json.loads(self.manage("sms_log", "--json").stdout)
        return [message for message in log["messages"] if message["idempotency_key"] == key]


@pytest.fixture
def example(example_database, tmp_path):
    return Example(example_database, tmp_path / "gateway.sqlite3")


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
