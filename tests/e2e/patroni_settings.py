"""Settings of the Django processes on the Patroni cluster (test_patroni.py): the test
settings, with the database reached as a user would reach a Patroni cluster.

HOST and PORT are libpq's comma lists of every node (TXQUEUE_TEST_HOST and
TXQUEUE_TEST_PORT); ``target_session_attrs=read-write`` makes libpq skip the replicas
and connect to whichever node accepts writes, at every (re)connection.
"""

from tests.settings import *  # noqa: F403
from tests.settings import DATABASES

DATABASES["default"]["OPTIONS"] = {
    "target_session_attrs": "read-write",
    # A node that does not answer is skipped after 2 s, not the OS's TCP timeout.
    "connect_timeout": 2,
}
