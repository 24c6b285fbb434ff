"""django_txqueue.consumer.wakeup: the Waiter an idle consumer blocks in, and producers' wake-ups.

PostgreSQL wakes consumers with LISTEN/NOTIFY; MySQL, MariaDB and SQLite with a datagram
on the loopback. Waiters are made inside a database test, so that the PostgreSQL
listener opens the test database.
"""

import os
import socket
import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.utils import timezone

from django_txqueue import Queue, Status
from django_txqueue.consumer import wakeup
from django_txqueue.consumer.wakeup import Waiter, wake_local_consumers
from django_txqueue.models import Consumer
from tests.helpers import running, wait_for, worker_for

# Consumers of a database without LISTEN/NOTIFY are woken by datagrams on the loopback.
datagrams = pytest.mark.lacks("notify")
notify = pytest.mark.requires("notify")


class Waiters:
    """Makes waiters, and closes those a test left open."""

    def __init__(self):
        self.open = []

    def __call__(self, queues=("mine",), known=True):
        """``known``: as if producers knew its address already (no fast polls first)."""
        waiter = Waiter("default", list(queues))
        if known:
            waiter.unknown_until = 0.0
        self.open.append(waiter)
        return waiter

    def close(self, waiter):
        self.open.remove(waiter)
        waiter.close()


@pytest.fixture
def make_waiter():
    waiters = Waiters()
    yield waiters
    for waiter in waiters.open:
        waiter.close()


@pytest.fixture
def waiter(db, make_waiter):
    return make_waiter()


def timed(wait, timeout):
    started = time.monotonic()
    woken = wait(timeout)
    return woken, time.monotonic() - started


def later(delay, function, *args):
    """Call ``function`` on another thread after ``delay`` seconds; returns the thread."""

    def run():
        time.sleep(delay)
        try:
            function(*args)
        finally:
            connections.close_all()  # this thread's own

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def listening(waiter):
    """Open the waiter's LISTEN connection, which opens on its first wait."""
    assert waiter.wait(0) is False
    assert waiter.listener is not None
    return waiter


def send(address, payload):
    host, _, port = address.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
        sender.sendto(payload, (host, int(port)))


class TestWait:
    def test_times_out_without_a_wake_up(self, waiter):
        woken, took = timed(waiter.wait, 0.2)
        assert woken is False
        assert 0.19 <= took < 2

    def test_a_zero_timeout_returns_at_once(self, waiter):
        assert timed(waiter.wait, 0)[0] is False

    def test_interrupt_wakes_it_at_once(self, waiter):
        thread = later(0.1, waiter.interrupt)
        try:
            woken, took = timed(waiter.wait, 10)
        finally:
            thread.join()
        assert woken is True
        assert took < 2

    def test_an_interrupt_before_the_wait_is_not_lost(self, waiter):
        waiter.interrupt()
        woken, took = timed(waiter.wait, 10)
        assert woken is True and took < 1
        assert waiter.wait(0.05) is False  # consumed

    def test_interrupt_never_blocks_even_with_many_pending(self, waiter):
        """Called from a signal handler: a full pipe must not block or raise."""
        for _ in range(100_000):  # far past the pipe's buffer
            waiter.interrupt()
        assert waiter.wait(1) is True


@datagrams
class TestDatagrams:
    def test_a_datagram_naming_one_of_its_queues_wakes_it(self, make_waiter, db):
        waiter = make_waiter(["mine", "also-mine"])
        assert waiter.address.startswith("127.0.0.1:")
        thread = later(0.1, send, waiter.address, b"also-mine")
        woken, took = timed(waiter.wait, 10)
        thread.join()
        assert woken is True and took < 2

    def test_a_datagram_naming_another_queue_does_not(self, waiter):
        send(waiter.address, b"theirs")
        send(waiter.address, b"\xff" * 600)  # garbage, longer than a datagram it reads
        woken, took = timed(waiter.wait, 0.3)
        assert woken is False and took >= 0.29
        send(waiter.address, b"mine")  # still listening after them
        assert waiter.wait(5) is True

    def test_a_queue_added_later_wakes_it_too(self, waiter):
        waiter.queues.add("found-later")  # as the consumer's discovery does
        send(waiter.address, b"found-later")
        assert waiter.wait(5) is True

    def test_a_new_waiter_polls_often_while_producers_may_not_know_it(self, make_waiter, db):
        waiter = make_waiter(known=False)
        woken, took = timed(waiter.wait, 5)
        assert woken is False and took < 1  # back to claim: a producer may have missed it
        time.sleep(wakeup.ADDRESS_CACHE_SECONDS)
        woken, took = timed(waiter.wait, 0.3)
        assert woken is False and took >= 0.29  # known by now: idle waits are whole again

    def test_without_local_wakeup_there_is_no_socket(self, make_waiter, db, settings):
        settings.TXQUEUE = {"LOCAL_WAKEUP": False}
        waiter = make_waiter()
        assert waiter.socket is None and waiter.address == ""
        assert waiter.wait(0.05) is False


@notify
@pytest.mark.django_db(transaction=True)
class TestNotify:
    def test_listen_opens_on_the_first_wait(self, make_waiter):
        waiter = make_waiter()  # building it needs no database
        assert waiter.address == "" and waiter.socket is None
        assert waiter.listener is None
        listening(waiter)

    def test_a_committed_enqueue_wakes_it(self, make_waiter):
        waiter = listening(make_waiter())
        thread = later(0.1, Queue("mine").enqueue, {})
        woken, took = timed(waiter.wait, 10)
        thread.join()
        assert woken is True and took < 2

    def test_another_queue_or_a_rollback_does_not(self, make_waiter):
        waiter = listening(make_waiter())
        Queue("theirs").enqueue({})
        with pytest.raises(RuntimeError), transaction.atomic():
            Queue("mine").enqueue({})
            raise RuntimeError("roll back")
        assert waiter.wait(0.3) is False

    def test_notified_only_at_commit(self, make_waiter):
        waiter = listening(make_waiter())
        with transaction.atomic():
            Queue("mine").enqueue({})
            assert waiter.wait(0.3) is False
        assert waiter.wait(5) is True

    def test_a_lost_listen_connection_wakes_it_and_is_opened_again(self, make_waiter):
        waiter = listening(make_waiter())
        backend_pid = waiter.listener.connection.info.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
        woken, took = timed(waiter.wait, 10)
        assert woken is True and took < 5  # to poll, since notifications may be lost
        assert waiter.listener is None
        thread = later(0.3, Queue("mine").enqueue, {})
        assert waiter.wait(10) is True  # listening again
        thread.join()
        assert waiter.listener is not None


@pytest.mark.django_db(transaction=True)
class TestHeard:
    """``heard()``: what a busy consumer, which never waits, asks once per turn while
    some of its queues are idle: the names announced, at once, without blocking."""

    def announce(self, waiter, name):
        """A producer's wake-up naming ``name``: a committed enqueue on PostgreSQL, a
        datagram elsewhere."""
        if waiter.notifying:
            Queue(name).enqueue({})
        else:
            send(waiter.address, name.encode())

    def ready(self, make_waiter, queues=("mine", "also-mine")):
        waiter = make_waiter(queues)
        # The first look opens the LISTEN or finds producers know the address: what was
        # announced before may have been missed, so it says so (None: every queue).
        assert waiter.heard() is None
        assert waiter.heard() == set()
        return waiter

    def heard_soon(self, waiter):
        """Asked as a busy consumer does, each turn, until something comes."""
        found: set[str] = set()
        deadline = time.monotonic() + 5
        while not found and time.monotonic() < deadline:
            started = time.monotonic()
            found = waiter.heard()
            assert time.monotonic() - started < 0.1  # a look, not a wait
            time.sleep(0.01)
        return found

    def test_names_of_its_queues_and_no_others(self, make_waiter):
        waiter = self.ready(make_waiter)
        self.announce(waiter, "theirs")
        self.announce(waiter, "also-mine")
        self.announce(waiter, "mine")
        time.sleep(0.1)  # all three arrived
        assert self.heard_soon(waiter) == {"mine", "also-mine"}
        assert waiter.heard() == set()  # each told once

    def test_what_a_wait_heard_is_kept_for_it(self, make_waiter):
        waiter = self.ready(make_waiter)
        thread = later(0.1, self.announce, waiter, "mine")
        try:
            assert waiter.wait(10) is True
        finally:
            thread.join()
        assert waiter.heard() == {"mine"}

    def test_it_leaves_a_stop_request_for_the_wait(self, make_waiter):
        waiter = self.ready(make_waiter)
        waiter.interrupt()
        assert waiter.heard() == set()
        woken, took = timed(waiter.wait, 10)
        assert woken is True and took < 1

    @notify
    def test_a_lost_listen_connection_means_every_queue(self, make_waiter):
        waiter = self.ready(make_waiter)
        backend_pid = waiter.listener.connection.info.backend_pid
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_terminate_backend(%s)", [backend_pid])
        lost = []
        while waiter.listener is not None and len(lost) < 500:  # until a look finds it lost
            lost.append(waiter.heard())
            time.sleep(0.01)
        assert waiter.listener is None and lost[-1] is None
        assert waiter.heard() is None  # opened again: what came meanwhile was missed
        assert waiter.listener is not None
        self.announce(waiter, "mine")
        assert self.heard_soon(waiter) == {"mine"}

    @notify
    def test_a_failing_listen_is_tried_once_per_poll_interval(self, make_waiter, settings):
        """Not a connection attempt on every turn of a busy consumer (the database or
        LISTEN_DATABASES' alias down); an idle wait tries as before."""
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 60}
        waiter = make_waiter()
        tries = []
        waiter._listen = tries.append  # fails: opens nothing
        for _ in range(5):
            assert waiter.heard() == set()
        assert tries == ["default"]
        assert waiter.wait(0) is False
        assert tries == ["default", "default"]

    @datagrams
    def test_a_new_consumer_hears_of_every_queue_once_producers_know_it(self, make_waiter):
        waiter = make_waiter(known=False)
        assert waiter.heard() == set()  # producers may not know its address yet
        time.sleep(wakeup.ADDRESS_CACHE_SECONDS + 0.05)
        assert waiter.heard() is None  # what they sent meanwhile went elsewhere
        assert waiter.heard() == set()


class TestClose:
    def test_close_after_waiting(self, make_waiter, db):
        waiter = make_waiter()
        waiter.interrupt()
        waiter.wait(0.1)
        make_waiter.close(waiter)

    def test_close_after_the_listener_was_dropped(self, make_waiter, db):
        waiter = make_waiter()
        waiter.close_listener()
        waiter.close_listener()  # twice is fine
        make_waiter.close(waiter)

    @notify
    def test_close_with_a_broken_listen_connection(self, make_waiter, db):
        waiter = listening(make_waiter())
        waiter.listener.connection.pgconn.finish()  # gone underneath
        make_waiter.close(waiter)

    def test_a_late_interrupt_or_close_is_harmless(self, make_waiter, db):
        waiter = make_waiter()
        make_waiter.close(waiter)
        read, write = os.pipe()  # the lowest free numbers: likely the waiter's old pipe
        try:
            os.set_blocking(read, False)
            waiter.interrupt()  # Worker.stop() after run() returned
            with pytest.raises(BlockingIOError):
                os.read(read, 1)  # nothing written into someone else's pipe
        finally:
            os.close(read)
            os.close(write)
        waiter.interrupt()
        waiter.close()


@pytest.mark.django_db(transaction=True)
class TestWakeLocalConsumers:
    @pytest.fixture(autouse=True)
    def no_cached_addresses(self, monkeypatch):
        monkeypatch.setattr(wakeup, "_addresses", {})

    def register(self, waiter, queues=("mine",), **fields):
        wakeup._addresses.clear()  # producers cache addresses for a second
        return Consumer.objects.create(
            identity=f"c{time.monotonic_ns()}",
            host=socket.gethostname(),
            os_pid=os.getpid(),
            queues=list(queues),
            wakeup_address=waiter.address,
            **fields,
        )

    @datagrams
    def test_sends_only_after_commit(self, make_waiter):
        waiter = make_waiter()
        self.register(waiter)
        with transaction.atomic():
            wake_local_consumers("mine", "default")
            assert waiter.wait(0.3) is False
        woken, took = timed(waiter.wait, 5)
        assert woken is True and took < 1

    @datagrams
    def test_never_on_rollback(self, make_waiter):
        waiter = make_waiter()
        self.register(waiter)
        with pytest.raises(RuntimeError), transaction.atomic():
            wake_local_consumers("mine", "default")
            raise RuntimeError("roll back")
        assert waiter.wait(0.3) is False

    @datagrams
    def test_an_enqueue_outside_a_transaction_wakes_at_once(self, make_waiter):
        waiter = make_waiter()
        self.register(waiter)
        Queue("mine").enqueue({})
        assert waiter.wait(5) is True

    @datagrams
    def test_only_consumers_of_the_queue_that_run_on_this_host(self, make_waiter):
        # The waiters would accept "mine"; only the rows tell the producer where to send.
        other_queue = make_waiter()
        self.register(other_queue, queues=["theirs"])
        stopped = make_waiter()
        self.register(stopped, stopped_at=timezone.now())
        elsewhere = make_waiter()
        Consumer.objects.create(
            identity="elsewhere",
            host="another-host",
            os_pid=1,
            queues=["mine"],
            wakeup_address=elsewhere.address,
        )
        wakeup._addresses.clear()
        wake_local_consumers("mine", "default")
        for waiter in (other_queue, stopped, elsewhere):
            assert waiter.wait(0.2) is False

    @datagrams
    def test_nothing_without_local_wakeup(self, make_waiter, settings):
        waiter = make_waiter()
        self.register(waiter)
        settings.TXQUEUE = {"LOCAL_WAKEUP": False}
        with transaction.atomic():
            wake_local_consumers("mine", "default")
            assert connection.run_on_commit == []
        assert waiter.wait(0.2) is False

    @notify
    def test_postgresql_leaves_it_to_notify(self, monkeypatch):
        sent = []
        monkeypatch.setattr(wakeup, "_send", lambda *args: sent.append(args))
        with transaction.atomic():
            wake_local_consumers("mine", "default")
            assert connection.run_on_commit == []
        assert sent == []


@pytest.mark.django_db(transaction=True)
class TestNewConsumer:
    """A producer that looked consumers up before this one registered does not keep
    missing it: polls are 5 s long, so only a wake-up or the new consumer's fast polls
    explain a start within a second."""

    def test_starts_work_at_once_though_the_producer_looked_up_before_it_started(
        self, settings, monkeypatch
    ):
        settings.TXQUEUE = {**settings.TXQUEUE, "POLL_INTERVAL": 5}
        # Cached this long, the producer's list would outlast several of the growing polls.
        monkeypatch.setattr(wakeup, "ADDRESS_CACHE_SECONDS", 3.0)
        monkeypatch.setattr(wakeup, "_addresses", {})
        wake_local_consumers("echo", "default")  # the producer looks up: no consumer yet
        worker = worker_for("echo")
        with running(worker):
            assert wait_for(lambda: Consumer.objects.filter(identity=worker.identity).exists())
            # Without fast polls its waits have grown by now (0.05 s doubling: the next poll
            # comes 3.15 s after start), and the producer still sends to nobody.
            time.sleep(1.8)
            started = time.monotonic()
            Queue("echo").enqueue({"ping": 1})
            assert wait_for(lambda: Queue("echo").count(status=Status.DONE) == 1, timeout=5)
            assert time.monotonic() - started < 1


@pytest.fixture
def elsewhere():
    """A database alias of the same server whose LISTEN no notification of the test
    database reaches (notifications are per database): what a LISTEN through a
    transaction pool amounts to, without one."""
    connections.settings["elsewhere"] = {**connection.settings_dict, "NAME": "postgres"}
    yield "elsewhere"
    connections["elsewhere"].close()
    del connections["elsewhere"]
    del connections.settings["elsewhere"]


@notify
@pytest.mark.django_db(transaction=True)
class TestProbe:
    """The listener's probe: notifications that cannot reach its LISTEN are said once,
    the consumer polls, and the probe is tried again every REPROBE_INTERVAL."""

    def test_a_deaf_listen_is_said_polled_and_probed_again(
        self, make_waiter, elsewhere, caplog, monkeypatch
    ):
        monkeypatch.setattr("django_txqueue.db.postgresql.PROBE_TIMEOUT", 0.3)
        waiter = make_waiter()
        waiter.listen_via["default"] = elsewhere
        with caplog.at_level("DEBUG", logger="django_txqueue.consumer.wakeup"):
            assert waiter.wait(0) is False
            assert waiter.listener is None and "default" in waiter.deaf_until
            [warned] = [r for r in caplog.records if r.levelname == "WARNING"]
            assert "did not reach a LISTEN through 'elsewhere'" in warned.getMessage()
            assert "set TXQUEUE['LISTEN_DATABASES'] = {'default': ALIAS}" in warned.getMessage()
            woken, took = timed(waiter.wait, 0.1)  # polls: no probe before REPROBE_INTERVAL
            assert woken is False and took < 0.25

            waiter.deaf_until["default"] = time.monotonic()  # REPROBE_INTERVAL has passed
            assert waiter.wait(0) is False
            assert len([r for r in caplog.records if r.levelname == "WARNING"]) == 1  # once

            waiter.listen_via["default"] = "default"
            waiter.deaf_until["default"] = time.monotonic()
            listening(waiter)
            assert waiter.deaf_until == {}
            assert "wake-ups on again" in caplog.records[-1].getMessage()
        thread = later(0.1, Queue("mine").enqueue, {})
        assert waiter.wait(10) is True
        thread.join()

    def test_a_busy_consumers_look_probes_once_and_leaves_reprobes_to_idle_waits(
        self, make_waiter, elsewhere, monkeypatch
    ):
        """A probe of a deaf LISTEN blocks up to its timeout: a busy consumer pays it at
        start, not every REPROBE_INTERVAL."""
        monkeypatch.setattr("django_txqueue.db.postgresql.PROBE_TIMEOUT", 0.3)
        waiter = make_waiter()
        waiter.listen_via["default"] = elsewhere
        assert waiter.heard() == set()
        assert waiter.listener is None and "default" in waiter.deaf_until
        waiter.deaf_until["default"] = time.monotonic()  # REPROBE_INTERVAL has passed
        started = time.monotonic()
        for _ in range(10):
            assert waiter.heard() == set()
        assert time.monotonic() - started < 0.25  # no probe
        assert waiter.wait(0) is False and "default" in waiter.deaf_until  # this one does
