"""Everything that differs by database vendor: one ``Dialect`` subclass per vendor.

``dialect(connection)`` picks it from ``connection.vendor``; the vendor's facts that
depend on the server version (SKIP LOCKED on MySQL 8+ and MariaDB 10.6+) are read
from Django's ``connection.features``. No SQL that differs by vendor lives outside
this package.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.db import NotSupportedError, connections

from .base import Dialect, Listener, NotificationsLost
from .mysql import MySQL
from .postgresql import PostgreSQL
from .sqlite import SQLite

if TYPE_CHECKING:
    from django.db.backends.base.base import BaseDatabaseWrapper

__all__ = ["Dialect", "Listener", "NotificationsLost", "dialect", "dialect_for"]

DIALECTS: dict[str, Dialect] = {found.vendor: found() for found in (PostgreSQL, MySQL, SQLite)}


def dialect(connection: BaseDatabaseWrapper) -> Dialect:
    """The dialect of ``connection``'s database vendor."""
    try:
        return DIALECTS[connection.vendor]
    except KeyError:
        raise NotSupportedError(
            "django-txqueue runs on PostgreSQL, MySQL/MariaDB and SQLite, "
            f"not {connection.display_name}"
        ) from None


def dialect_for(alias: str) -> Dialect:
    """The dialect of database ``alias``."""
    return dialect(connections[alias])
