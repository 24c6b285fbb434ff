"""``demo``: book seats from racing processes, send their SMS through consumers that meet a
failing (and, with --crash, a dying) world, and count what happened."""

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError
from django.db import connection

from cinema import demo


def fraction(value):
    number = float(value)
    if not 0 <= number <= 1:
        raise ValueError(value)
    return number


class Command(BaseCommand):
    help = (
        "Book seats from several processes at once (some racing for the same seat), send "
        "every booking's SMS through consumer processes and a fake gateway that fails some "
        "calls, then count bookings, SMS sent and duplicates from the databases. "
        "SQLite: a fresh database file of its own. DATABASE_URL: that database, emptied first."
    )
    # Django's checks would open (and on SQLite create) the site's own database; the demo
    # works on a database of its own, and its child processes run the checks there.
    requires_system_checks = []

    def add_arguments(self, parser):
        parser.add_argument("--seats", type=int, default=20, help="Seats to book (default 20).")
        parser.add_argument(
            "--races", type=int, help="Seats booked by two processes at once (default: 1 in 4)."
        )
        parser.add_argument(
            "--parallel", type=int, default=6, help="Booking processes at a time (default 6)."
        )
        parser.add_argument(
            "--consumers", type=int, default=2, help="Consumer processes (default 2)."
        )
        parser.add_argument(
            "--fail-rate",
            type=fraction,
            default=0.2,
            help="Fraction of gateway calls that fail, to show retries (default 0.2).",
        )
        parser.add_argument(
            "--delay", type=float, default=0.05, help="Seconds each gateway call takes."
        )
        parser.add_argument(
            "--crash",
            action=argparse.BooleanOptionalAction,
            default=True,
            help="SIGKILL a consumer between an SMS's delivery and its record, and start "
            "another: the SMS is rescued and not delivered twice (default: on).",
        )
        parser.add_argument(
            "--timeout", type=float, default=60, help="Seconds to wait for every SMS."
        )
        parser.add_argument(
            "--keep", action="store_true", help="Keep the demo's files (database, logs)."
        )

    def say(self, line):
        self.stdout.write(line)
        self.stdout.flush()

    def handle(self, *args, **options):
        if min(options["seats"], options["parallel"], options["consumers"]) < 1:
            raise CommandError("--seats, --parallel and --consumers must be at least 1.")
        if (options["races"] or 0) < 0 or options["delay"] < 0 or options["timeout"] <= 0:
            raise CommandError("--races and --delay must be 0 or more, --timeout more than 0.")
        started = time.monotonic()
        workdir = Path(tempfile.mkdtemp(prefix="cinema-demo-"))
        consumers = None
        try:
            env = self.prepare(workdir, options)
            consumers = demo.Consumers(env, workdir)
            problems = self.run_story(consumers, env, options)
            outcome = demo.measure(workdir / "gateway.sqlite3")
            problems += self.check(outcome, options["seats"])
            if problems:
                self.stderr.write(consumers.logs())
        finally:
            if consumers is not None:
                consumers.stop_all(timeout=15)  # after an error: stopped already otherwise
            connection.close()
            if options["keep"]:
                self.say(f"Kept the demo's files (databases, consumer logs) in {workdir}")
            else:
                shutil.rmtree(workdir, ignore_errors=True)
        self.summarise(outcome, time.monotonic() - started)
        if problems:
            raise CommandError("The demo failed: " + "; ".join(problems))

    def prepare(self, workdir, options):
        """The database (fresh, or emptied) and the environment of every child process."""
        url = os.environ.get("DATABASE_URL")
        if url:
            demo.migrate()
            cleared = demo.clear_tables()
            counts = ", ".join(f"{n} {what}" for what, n in cleared.items())
            self.say(f"Database: {demo.describe_database()} (DATABASE_URL).")
            self.say(f"  Migrated, then emptied the demo's tables: deleted {counts}.")
        else:
            url = demo.use_sqlite_file(workdir / "demo.sqlite3")
            demo.migrate()
            self.say(f"Database: a fresh SQLite file, {workdir / 'demo.sqlite3'}.")
        gateway = workdir / "gateway.sqlite3"
        self.say(
            f"SMS gateway: {gateway}; {options['fail_rate']:.0%} of calls fail, "
            f"each call takes {options['delay']} s."
        )
        return demo.child_env(
            DATABASE_URL=url,
            CINEMA_SMS_GATEWAY_PATH=gateway,
            CINEMA_SMS_FAIL_RATE=options["fail_rate"],
            CINEMA_SMS_DELAY=options["delay"],
        )

    def run_story(self, consumers, env, options):
        """Consumers up, bookings in, SMS out; the problems met on the way."""
        for _ in range(options["consumers"]):
            consumers.start()
        pids = ", ".join(str(proc.pid) for proc in consumers.running)
        self.say(f"Consumers: {options['consumers']} x run_queue_consumer sms (pids {pids}).")

        seats = options["seats"]
        races = min(seats, options["races"] if options["races"] is not None else seats // 4)
        attempts = demo.booking_attempts(seats, races)
        parallel = min(options["parallel"], len(attempts))
        self.say(
            f"Booking {seats} seats: {len(attempts)} `manage.py book` processes, {parallel} "
            f"at a time; {races} of the seats wanted by two processes at once."
        )
        futures = demo.start_bookings(attempts, env, parallel)
        waited = self.wait(consumers, futures, options)

        codes = consumers.stop_all(timeout=15)
        self.say(f"Stopped the consumers with SIGTERM: exit codes {codes}.")
        problems = [] if waited else [f"not every SMS was sent within {options['timeout']} s"]
        if any(code != 0 for code in codes):
            problems.append(f"a consumer exited with {codes}")
        return problems + self.report_bookings(attempts)

    def wait(self, consumers, futures, options):
        """Until every booking process is done and no SMS is left to send; False on timeout."""
        deadline = time.monotonic() + options["timeout"]
        gateway = demo.Gateway(consumers.workdir / "gateway.sqlite3")
        crash_pending = options["crash"]
        booked = done = False
        while not done and time.monotonic() < deadline:
            if not booked and all(future.done() for future in futures):
                booked = True
                self.say("Bookings done; waiting for the SMS...")
            done = booked and not demo.unfinished_sms().exists()
            if crash_pending and not done:
                crash_pending = not self.crash_one(consumers, gateway)
            if not done:
                time.sleep(0.02 if crash_pending else 0.1)
        if crash_pending:
            self.say("No consumer was caught between a delivery and its record: none killed.")
        return done

    def crash_one(self, consumers, gateway):
        """SIGKILL a consumer caught between the gateway's delivery of an SMS and the
        commit that records it, and start another; True if it did."""
        for proc in consumers.running:
            caught = demo.delivered_unrecorded(consumers.held_bookings(proc), gateway)
            if not caught:
                continue
            consumers.kill(proc)
            new = consumers.start()
            pk = caught[0]
            self.say(
                f"Killed consumer {proc.pid} (SIGKILL) after the gateway delivered the SMS of "
                f"booking #{pk}, before its record committed; started consumer {new.pid}."
            )
            if demo.recorded(pk):
                self.say("  Its record committed just before the kill: a rescue sends nothing.")
            else:
                self.say("  A rescue will call the gateway again, with the same idempotency key.")
            return True
        return False

    def report_bookings(self, attempts):
        lost = sum(1 for attempt in attempts if attempt.lost_race)
        failed = [a for a in attempts if a.returncode != 0 and not a.lost_race]
        self.say(f"Booking attempts: {len(attempts)}")
        self.say(f'Seats lost to races: {lost} ("Seat N is already booked.", exit 1)')
        for attempt in failed:
            self.say(f"  book {attempt.seat} failed ({attempt.returncode}): {attempt.output}")
        return [f"{len(failed)} booking processes failed"] if failed else []

    def check(self, outcome, seats):
        problems = []
        if outcome.bookings != seats:
            problems.append(f"{outcome.bookings} bookings for {seats} seats")
        if outcome.sms_sent != outcome.bookings:
            problems.append(f"{outcome.sms_sent} SMS sent for {outcome.bookings} bookings")
        if outcome.recorded != outcome.bookings:
            problems.append(f"{outcome.recorded} sends recorded for {outcome.bookings} bookings")
        if outcome.duplicates:
            problems.append(f"{outcome.duplicates} duplicate SMS")
        return problems

    def summarise(self, outcome, seconds):
        calls = outcome.gateway_calls
        self.say(
            f"SMS queue: {outcome.items} items, {outcome.items_failed} failed; "
            f"{outcome.attempts} attempts ({outcome.attempts - outcome.items} retried or rescued)"
        )
        self.say(
            f"Gateway calls: {sum(calls.values())} ({calls['delivered']} delivered, "
            f"{calls['failed']} failed on purpose, {calls['repeated']} repeated a known key)"
        )
        self.say(f"Bookings with their SMS recorded: {outcome.recorded}")
        self.say(f"Time: {seconds:.1f} s")
        self.say(f"Bookings: {outcome.bookings}")
        self.say(f"SMS sent: {outcome.sms_sent}")
        self.say(f"Duplicates: {outcome.duplicates}")
