"""A fake SMS provider: an outside service with records of its own.

It delivers into its own SQLite file, never into the site's database, so a message it
delivered stays delivered when the handler's transaction rolls back, as a real SMS does.
Like real providers' APIs (Stripe's and Twilio's idempotency keys), a call with a key it
has seen before returns the first call's message id and delivers nothing.

``CINEMA_SMS_GATEWAY`` can make it fail a fraction of calls (before delivering) and answer
slowly (after delivering: the window in which a consumer that dies has sent an SMS it never
recorded, and the idempotency key is what keeps the next attempt from sending it again).
"""

import random
import sqlite3
import time
import uuid
from collections import Counter
from contextlib import closing, contextmanager
from dataclasses import dataclass

from django.conf import settings

DELIVERED = "delivered"
REPEATED = "repeated"  # a known idempotency key: answered, not delivered again
FAILED = "failed"

SCHEMA = [
    """CREATE TABLE IF NOT EXISTS message (
        id TEXT PRIMARY KEY,
        recipient TEXT NOT NULL,
        body TEXT NOT NULL,
        idempotency_key TEXT NOT NULL UNIQUE,
        delivered_at REAL NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS call (
        id INTEGER PRIMARY KEY,
        idempotency_key TEXT NOT NULL,
        outcome TEXT NOT NULL,
        at REAL NOT NULL)""",
]


class GatewayError(Exception):
    """The provider did not take the message: nothing was delivered, try again later."""


@dataclass(frozen=True)
class Message:
    id: str
    recipient: str
    body: str
    idempotency_key: str
    delivered_at: float


class Gateway:
    def __init__(self, path, *, fail_rate=0.0, delay=0.0):
        self.path = str(path)
        self.fail_rate = fail_rate
        self.delay = delay

    def send(self, recipient, body, *, idempotency_key):
        """Deliver ``body`` to ``recipient`` once per ``idempotency_key``; the message id."""
        if random.random() < self.fail_rate:
            with self._transaction() as db:
                self._log(db, idempotency_key, FAILED)
            raise GatewayError(f"provider unavailable (simulated), key {idempotency_key}")
        with self._transaction() as db:
            known = db.execute(
                "SELECT id FROM message WHERE idempotency_key = ?", (idempotency_key,)
            ).fetchone()
            if known:
                message_id = known[0]
                self._log(db, idempotency_key, REPEATED)
            else:
                message_id = f"SM{uuid.uuid4().hex}"
                db.execute(
                    "INSERT INTO message (id, recipient, body, idempotency_key, delivered_at) "
                    "VALUES (?, ?, ?, ?, ?)",
                    (message_id, recipient, body, idempotency_key, time.time()),
                )
                self._log(db, idempotency_key, DELIVERED)
        time.sleep(self.delay)  # delivered; the answer is still on its way back
        return message_id

    def messages(self):
        """Every message delivered, oldest first."""
        with self._transaction() as db:
            rows = db.execute(
                "SELECT id, recipient, body, idempotency_key, delivered_at "
                "FROM message ORDER BY delivered_at, id"
            ).fetchall()
        return [Message(*row) for row in rows]

    def calls(self):
        """How many calls ended each way: {"delivered": n, "repeated": n, "failed": n}."""
        with self._transaction() as db:
            rows = db.execute("SELECT outcome, COUNT(*) FROM call GROUP BY outcome").fetchall()
        return Counter(dict(rows))

    @contextmanager
    def _transaction(self):
        # IMMEDIATE: the write lock up front, so that the read of a key and the insert
        # that follows it cannot interleave with another process's; the timeout waits
        # for that lock instead of failing. The schema is made under it too. (Not WAL:
        # switching a new file to it fails at once, "database is locked", when a second
        # caller opens the file meanwhile, and every call here writes anyway.)
        with closing(sqlite3.connect(self.path, timeout=20, isolation_level=None)) as db:
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in SCHEMA:
                    db.execute(statement)
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    @staticmethod
    def _log(db, idempotency_key, outcome):
        db.execute(
            "INSERT INTO call (idempotency_key, outcome, at) VALUES (?, ?, ?)",
            (idempotency_key, outcome, time.time()),
        )


def default_gateway():
    """The gateway the settings describe (``CINEMA_SMS_GATEWAY``)."""
    config = settings.CINEMA_SMS_GATEWAY
    return Gateway(config["PATH"], fail_rate=config["FAIL_RATE"], delay=config["DELAY"])
