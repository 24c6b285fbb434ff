"""Wake-ups: how an idle consumer learns of new work before its next poll.

- PostgreSQL: LISTEN/NOTIFY (a trigger on the items table notifies at commit).
- Elsewhere: each consumer binds a UDP socket on the loopback and registers its address
  in its ``Consumer`` row; a producer on the same host sends the queue name there after
  commit. A datagram carries no data a consumer trusts: any one, stray or not, can only
  cause one extra poll.

A busy consumer never waits, but passes over its idle queues until a wake-up names one
(``rotation``): it asks ``heard()`` once per turn, a look without blocking, for the names
that came (during waits too), or for "every queue" where some may have been missed (a
LISTEN just opened or broken, a new consumer's address just become known).

Polling stays the fallback everywhere: a lost datagram or notification costs at most
one ``POLL_INTERVAL``. A producer may hold an address list from before a consumer
registered for ``ADDRESS_CACHE_SECONDS``; so for that long after registering, a
consumer polls every ``NEW_CONSUMER_POLL`` instead of counting on datagrams.

A LISTEN that cannot hear notifications at all (through a transaction pool such as
PgBouncer's) is found by the listener's probe on the first wait, said in a WARNING that
names ``LISTEN_DATABASES``; that consumer polls, and tries again every
``REPROBE_INTERVAL``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import transaction

from .. import conf
from ..db import Listener, NotificationsLost, dialect_for
from ..models import Consumer
from ..observe.logs import one_line

logger = logging.getLogger(__name__)

# Producers look consumers' addresses up at most this often: at most 4 lookups a second
# per busy producer process, and a new consumer's fast polls last no longer than this.
ADDRESS_CACHE_SECONDS = 0.25
NEW_CONSUMER_POLL = 0.01  # seconds between polls while producers may not know us yet
MAX_DATAGRAM = 512
# A consumer whose LISTEN probe failed tries it again after this many seconds (a probe
# that was only slow must not turn wake-ups off for good).
REPROBE_INTERVAL = 300.0


class Waiter:
    """Blocks an idle consumer until a wake-up, a stop request or the timeout, listening
    on each of its databases (``aliases``, or one alias).

    Its first wait must come after the consumer's rows are registered with ``address``.
    """

    def __init__(self, aliases: str | list[str], queues: list[str]) -> None:
        self.aliases = [aliases] if isinstance(aliases, str) else list(aliases)
        self.queues = set(queues)
        self._stop_read, self._stop_write = os.pipe()
        self._closed = False
        self._closing = threading.RLock()
        os.set_blocking(self._stop_write, False)
        # The LISTEN connections open on the first wait: building a Waiter needs no database.
        self.notifying = [alias for alias in self.aliases if dialect_for(alias).has_notify]
        self.listeners: dict[str, Listener] = {}
        # For each, the alias whose connection settings its LISTEN connection takes (a
        # direct one or a session pool's, when the queue's own goes through a transaction
        # pool).
        self.listen_via = {
            alias: conf.get("LISTEN_DATABASES").get(alias, alias) for alias in self.notifying
        }
        # Notifications could not reach a LISTEN through listen_via: poll only, until then
        # (monotonic), when the probe is tried again; absent while not found deaf.
        self.deaf_until: dict[str, float] = {}
        self.socket: socket.socket | None = None
        # Heard since the last ``heard()``: our queues named by wake-ups, and whether some
        # wake-ups may have been missed.
        self._heard: set[str] = set()
        self._missed = False
        self._failed_at: dict[str, float] = {}  # a LISTEN's last failure (monotonic)
        self._known = False  # past unknown_until, as heard() found
        # Until then producers may not know this consumer's address: set on the first wait.
        self.unknown_until: float | None = None
        if len(self.notifying) < len(self.aliases) and conf.get("LOCAL_WAKEUP"):
            self.socket = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.socket.bind(("127.0.0.1", 0))
            self.socket.setblocking(False)

    @property
    def listener(self) -> Listener | None:
        """The LISTEN connection of a waiter on one PostgreSQL database (or None)."""
        return next(iter(self.listeners.values()), None)

    @property
    def address(self) -> str:
        """Where producers send datagrams ("" when this consumer has none)."""
        if self.socket is None:
            return ""
        host, port = self.socket.getsockname()
        return f"{host}:{port}"

    def _listen(self, alias: str) -> None:
        try:
            listener = dialect_for(alias).listen(alias, self.listen_via[alias])
        except NotificationsLost as exc:
            # Said once; tried again now and then, in case the probe was only slow.
            log = logger.debug if alias in self.deaf_until else logger.warning
            self.deaf_until[alias] = time.monotonic() + REPROBE_INTERVAL
            log(
                "wake-ups off, idle consumers poll every %s s: %s. A transaction pool "
                "(PgBouncer pool_mode=transaction) loses them: set TXQUEUE"
                "['LISTEN_DATABASES'] = {%r: ALIAS}, ALIAS a database alias that connects "
                "to PostgreSQL directly or through a session pool.",
                conf.get("POLL_INTERVAL"),
                exc,
                alias,
            )
            return
        except Exception as exc:  # the database is down: poll until it is back
            logger.warning("LISTEN on %r failed, polling instead: %s", alias, one_line(exc))
            return
        if self.deaf_until.pop(alias, None) is not None:
            logger.info("wake-ups on again: notifications reach the LISTEN on %r", alias)
        if listener is not None:
            self.listeners[alias] = listener

    def wait(self, timeout: float, down: frozenset[str] = frozenset()) -> bool:
        """Sleep up to ``timeout`` seconds; True if woken for one of our queues. Databases
        ``down`` (their consumer lost them a moment ago) are not asked to LISTEN now, nor
        those found deaf until their next probe."""
        self._open_listeners(down)
        if self.socket is not None:
            if self.unknown_until is None:
                self.unknown_until = time.monotonic() + ADDRESS_CACHE_SECONDS
            if time.monotonic() < self.unknown_until:
                timeout = min(timeout, NEW_CONSUMER_POLL)
        sources = [self._stop_read, *self._sources()]
        deadline = time.monotonic() + timeout
        while (remaining := deadline - time.monotonic()) > 0:
            ready, _, _ = select.select(sources, [], [], remaining)
            if not ready:
                return False
            if self._stop_read in ready:
                os.read(self._stop_read, MAX_DATAGRAM)
                return True
            if self._woken(ready):
                return True
        return False

    def heard(self, down: frozenset[str] = frozenset()) -> set[str] | None:
        """Without blocking: the queue names announced since the last call (during waits
        too), or None when some may have been missed (a LISTEN that opened or broke since,
        or a new consumer's first ADDRESS_CACHE_SECONDS just ended): then every queue may
        have new work. A busy consumer asks once per turn while some queue is idle."""
        # Not a connection attempt per turn while a LISTEN fails: once a POLL_INTERVAL.
        # Nor a probe of a deaf one, which blocks up to its timeout: the idle waits reprobe.
        self._open_listeners(down, retry_after=conf.get("POLL_INTERVAL"), reprobe=False)
        if self.socket is not None and not self._known:
            if self.unknown_until is None:
                self.unknown_until = time.monotonic() + ADDRESS_CACHE_SECONDS
            if time.monotonic() >= self.unknown_until:
                # Producers know this address now; until then their datagrams missed it.
                self._known = self._missed = True
        if sources := self._sources():
            ready, _, _ = select.select(sources, [], [], 0)
            if ready:
                self._woken(ready)
        names, self._heard = self._heard, set()
        missed, self._missed = self._missed, False
        return None if missed else names

    def _open_listeners(
        self, down: frozenset[str], retry_after: float = 0.0, reprobe: bool = True
    ) -> None:
        """LISTEN on each database that has none yet, unless ``down``, found deaf (for
        good unless ``reprobe``), or failed less than ``retry_after`` seconds ago."""
        now = time.monotonic()
        for alias in self.notifying:
            if (
                alias not in self.listeners
                and alias not in down
                and (
                    self.deaf_until.get(alias, now) <= now
                    if reprobe
                    else alias not in self.deaf_until
                )
                and self._failed_at.get(alias, -retry_after) + retry_after <= now
            ):
                self._listen(alias)
                if alias in self.listeners:  # items committed before it went unannounced
                    self._missed = True
                    self._failed_at.pop(alias, None)
                else:
                    self._failed_at[alias] = now

    def _sources(self) -> list[Any]:
        """What becomes readable on a wake-up (not the stop pipe)."""
        sources: list[Any] = list(self.listeners.values())
        if self.socket is not None:
            sources.append(self.socket)
        return sources

    def _woken(self, ready: list[Any]) -> bool:
        """Read the wake-ups ``ready`` (kept for ``heard``); True if one is for our
        queues, or a LISTEN connection broke (what it would have heard is lost)."""
        names: set[str] = set()
        if self.socket is not None and self.socket in ready:
            while True:
                try:
                    names.add(self.socket.recv(MAX_DATAGRAM).decode(errors="replace"))
                except BlockingIOError:
                    break
        names &= self.queues  # a stray datagram's text is kept nowhere
        lost = False
        for alias, listener in list(self.listeners.items()):
            if listener not in ready:
                continue
            try:
                names |= listener.drain() & self.queues
            except Exception as exc:
                logger.warning(
                    "lost the LISTEN connection to %r, polling until back: %s", alias, exc
                )
                self.close_listener(alias)
                self._missed = lost = True
        self._heard |= names
        return bool(names) or lost

    def interrupt(self) -> None:
        """Wake the waiting thread now (safe from a signal handler; a no-op once closed)."""
        # Under the lock: another thread's close() could otherwise free the pipe between
        # the check and the write, whose number a new file may already have taken.
        # Reentrant, for a signal handler that runs while this thread is in close().
        with self._closing:
            if self._closed:
                return
            with contextlib.suppress(BlockingIOError):  # already pending
                os.write(self._stop_write, b"x")

    def close_listener(self, alias: str | None = None) -> None:
        """Close the LISTEN connection to ``alias`` (None: every one)."""
        for name in [alias] if alias is not None else list(self.listeners):
            listener = self.listeners.pop(name, None)
            if listener is not None:
                with contextlib.suppress(Exception):  # closing a broken connection
                    listener.close()

    def close(self) -> None:
        with self._closing:
            if self._closed:
                return
            self._closed = True
        self.close_listener()
        if self.socket is not None:
            self.socket.close()
        os.close(self._stop_read)
        os.close(self._stop_write)


# -- producers --------------------------------------------------------------------

_addresses: dict[str, tuple[float, list[tuple[str, list[str]]]]] = {}
_sender: socket.socket | None = None


# Set by a test's inline mode (``testing.inline()``): called with each enqueue's queue and
# database, where the enqueue is, to run the queue's items at once.
inline: Callable[[str, str], None] | None = None


def wake_local_consumers(queue: str, using: str) -> None:
    """After the caller's commit, send ``queue`` to idle consumers on this host (in a
    test's inline mode, run its items now)."""
    if inline is not None:
        inline(queue, using)
    if not conf.get("LOCAL_WAKEUP") or dialect_for(using).has_notify:
        return
    transaction.on_commit(lambda: _send(queue, using), using=using)


def _send(queue: str, using: str) -> None:
    global _sender
    try:
        targets = [address for address, queues in _local_consumers(using) if queue in queues]
        if not targets:
            return
        if _sender is None:
            _sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            _sender.setblocking(False)
            atexit.register(_sender.close)  # one per process, kept until it exits
        payload = queue.encode()
        for address in targets:
            host, _, port = address.rpartition(":")
            with contextlib.suppress(OSError):  # a consumer that just exited
                _sender.sendto(payload, (host, int(port)))
    except Exception as exc:  # a wake-up is an optimisation: never fail the producer
        logger.debug("local wake-up failed: %s", exc)


def _local_consumers(using: str) -> list[tuple[str, list[str]]]:
    """Live consumers on this host with a wake-up address, cached for ADDRESS_CACHE_SECONDS."""
    fetched_at, rows = _addresses.get(using, (0.0, []))
    if time.monotonic() - fetched_at > ADDRESS_CACHE_SECONDS:
        # Timed from before the query: a consumer registered during it may be missing.
        fetched_at = time.monotonic()
        rows = list(
            Consumer.objects.using(using)
            .filter(host=socket.gethostname(), stopped_at__isnull=True)
            .exclude(wakeup_address="")
            .values_list("wakeup_address", "queues")
        )
        _addresses[using] = (fetched_at, rows)
    return rows
