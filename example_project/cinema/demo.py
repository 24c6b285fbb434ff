"""The steps of ``manage.py demo``: a database of its own, booking processes, consumer
processes, and the counts read back from the databases afterwards.

Every number the demo prints is read from the site's database or the gateway's file.
"""

import os
import random
import signal
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from django.conf import settings
from django.core.management import call_command
from django.db import connection

from django_txqueue import QueueItem, Status
from django_txqueue.models import Consumer, Effect

from . import sms
from .gateway import Gateway
from .models import Booking

MANAGE = settings.BASE_DIR / "manage.py"


def manage(*args):
    """The command line of a child ``manage.py`` with the same interpreter."""
    return [sys.executable, str(MANAGE), *args]


def use_sqlite_file(path):
    """Point this process's default connection at a new SQLite file, as Django's test
    runner points it at the test database; returns the DATABASE_URL for the children."""
    connection.close()
    settings.DATABASES["default"]["NAME"] = str(path)
    connection.settings_dict["NAME"] = str(path)
    return f"sqlite:///{path}"


def describe_database():
    return f"{connection.display_name} database {connection.settings_dict['NAME']!s}"


def migrate():
    call_command("migrate", verbosity=0, interactive=False)


def clear_tables():
    """Delete the bookings, the sms queue's items and the records of sent SMS; their counts."""
    return {
        "bookings": Booking.objects.all().delete()[0],
        "sms queue items": QueueItem.objects.filter(queue=sms.QUEUE).delete()[0],
        "sent-SMS records": Effect.objects.filter(key__startswith=sms.effect_key("")).delete()[0],
    }


# -- booking -------------------------------------------------------------------------


@dataclass
class Attempt:
    seat: int
    phone: str
    returncode: int = -1
    output: str = ""

    @property
    def lost_race(self):
        return self.returncode != 0 and "is already booked" in self.output


def booking_attempts(seats, races):
    """One attempt per seat, plus a second one for ``races`` random seats: those two run
    side by side, and the database lets one of them win."""
    attempts = []
    contested = set(random.sample(range(1, seats + 1), races))
    for seat in range(1, seats + 1):
        contenders = 2 if seat in contested else 1
        attempts += [Attempt(seat, f"+4470{seat:04d}{n:03d}") for n in range(contenders)]
    return attempts


def run_attempt(attempt, env):
    done = subprocess.run(  # noqa: S603 - our own manage.py
        manage("book", str(attempt.seat), attempt.phone),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    attempt.returncode = done.returncode
    attempt.output = done.stdout + done.stderr
    return attempt


def start_bookings(attempts, env, parallel):
    """Run the attempts, ``parallel`` processes at a time, in order (so that the two
    contenders for a seat start together); returns the futures."""
    pool = ThreadPoolExecutor(max_workers=parallel)
    futures = [pool.submit(run_attempt, attempt, env) for attempt in attempts]
    pool.shutdown(wait=False)
    return futures


# -- consumers -----------------------------------------------------------------------


@dataclass
class Consumers:
    """``run_queue_consumer sms`` processes, their output in files of ``workdir``."""

    env: dict
    workdir: Path
    running: list = field(default_factory=list)
    stopped: list = field(default_factory=list)

    def start(self):
        log = self.workdir / f"consumer-{len(self.running) + len(self.stopped)}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(  # noqa: S603 - our own manage.py
                manage("run_queue_consumer", sms.QUEUE),
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        proc.log = log
        self.running.append(proc)
        return proc

    def held_bookings(self, proc):
        """The bookings whose SMS ``proc`` holds IN_PROGRESS right now."""
        identities = Consumer.objects.filter(os_pid=proc.pid, stopped_at__isnull=True)
        payloads = QueueItem.objects.filter(
            queue=sms.QUEUE, status=Status.IN_PROGRESS, pid__in=identities.values("identity")
        ).values_list("payload", flat=True)
        return {payload["booking"] for payload in payloads}

    def kill(self, proc):
        """SIGKILL: no goodbye, its items stay IN_PROGRESS until another consumer rescues them."""
        proc.kill()
        proc.wait()
        self.running.remove(proc)

    def stop_all(self, timeout):
        """SIGTERM each, as an operator would; the exit codes of those that were running."""
        for proc in self.running:
            proc.send_signal(signal.SIGTERM)
        codes = []
        for proc in self.running:
            try:
                codes.append(proc.wait(timeout=timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
            self.stopped.append(proc)
        self.running = []
        return codes

    def logs(self):
        return "\n".join(
            f"--- {proc.log.name} (pid {proc.pid}):\n{proc.log.read_text(errors='replace')}"
            for proc in self.stopped + self.running
        )


# -- waiting and counting ------------------------------------------------------------


def delivered_unrecorded(bookings, gateway):
    """Of these bookings, those whose SMS the gateway delivered but the site has not
    recorded (committed) yet: the moment in which a crash matters."""
    unrecorded = Booking.objects.filter(pk__in=bookings, sms_sent_at__isnull=True)
    pks = list(unrecorded.values_list("pk", flat=True))  # read before the gateway
    delivered = {message.idempotency_key for message in gateway.messages()}
    return [pk for pk in pks if sms.effect_key(pk) in delivered]


def recorded(pk):
    return Booking.objects.filter(pk=pk, sms_sent_at__isnull=False).exists()


def unfinished_sms():
    return QueueItem.objects.filter(queue=sms.QUEUE, status__in=[Status.READY, Status.IN_PROGRESS])


@dataclass
class Outcome:
    bookings: int
    recorded: int  # bookings whose handler recorded a message id
    items: int
    items_failed: int
    attempts: int
    gateway_calls: Counter
    sms_sent: int  # bookings whose own text reached their phone at the gateway
    duplicates: int  # messages delivered beyond one per (phone, text)


def measure(gateway_path):
    booked = list(Booking.objects.all())
    items = QueueItem.objects.filter(queue=sms.QUEUE)
    gateway = Gateway(gateway_path)
    delivered = Counter((message.recipient, message.body) for message in gateway.messages())
    return Outcome(
        bookings=len(booked),
        recorded=sum(1 for booking in booked if booking.sms_sent_at and booking.sms_message_id),
        items=items.count(),
        items_failed=items.filter(status=Status.FAILED).count(),
        attempts=sum(items.values_list("attempts", flat=True)),
        gateway_calls=gateway.calls(),
        sms_sent=sum(1 for b in booked if (b.phone, sms.text_for(b)) in delivered),
        duplicates=sum(delivered.values()) - len(delivered),
    )


def child_env(**variables):
    return {**os.environ, **{name: str(value) for name, value in variables.items()}}
