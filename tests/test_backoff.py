"""django_txqueue.store.backoff: the back-off of a failed item's retries, and the pauses of a
consumer that cannot reach its database. Pure functions: no database.

test_store.py shows a retried item's ``run_at`` moved by ``backoff``.
"""

import random
from datetime import timedelta

import pytest

from django_txqueue.store.backoff import (
    FIRST_PAUSE,
    MAX_PAUSE,
    RECONNECT_MAX_PAUSE,
    backoff,
    jittered,
    next_pause,
)


def draws(function, *args, n=2000):
    """``n`` calls' values, from a seeded random generator (put back as it was after)."""
    state = random.getstate()
    random.seed(24)
    try:
        return [function(*args) for _ in range(n)]
    finally:
        random.setstate(state)


class TestBackoff:
    @pytest.mark.parametrize(
        ("attempts", "ceiling"), [(0, 10), (1, 10), (2, 20), (3, 40), (4, 80), (10, 300)]
    )
    def test_doubles_from_the_base_up_to_the_cap_drawn_from_the_upper_half(
        self, attempts, ceiling
    ):
        waits = draws(backoff, attempts, 10.0, 300.0)
        assert all(
            timedelta(seconds=ceiling / 2) <= wait <= timedelta(seconds=ceiling) for wait in waits
        )
        # Spread over the whole upper half: retries that failed together do not retry together.
        seconds = [wait.total_seconds() for wait in waits]
        assert min(seconds) < ceiling * 0.55 and max(seconds) > ceiling * 0.95

    def test_never_zero_with_a_base(self):
        assert min(draws(backoff, 1, 0.001, 0.001)) >= timedelta(seconds=0.0005)

    def test_a_zero_base_retries_at_once(self):
        assert set(draws(backoff, 3, 0.0, 60.0, n=10)) == {timedelta(0)}


class TestDatabasePauses:
    def test_from_half_a_second_doubling_up_to_thirty(self):
        pauses, pause = [], 0.0
        for _ in range(9):
            pause = next_pause(pause)
            pauses.append(pause)
        assert pauses == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
        assert (pauses[0], pauses[-1]) == (FIRST_PAUSE, MAX_PAUSE)

    def test_jitter_is_a_fifth_either_way(self):
        jittered_pauses = draws(jittered, 10.0)
        assert all(8.0 <= pause <= 12.0 for pause in jittered_pauses)
        assert min(jittered_pauses) < 8.2 and max(jittered_pauses) > 11.8


def test_the_consumers_reconnection_pause_stays_short():
    """In its loop a consumer tries its database again at least every second (with
    jitter): a failover's new primary is claimed from at once, not after 16-30 s."""
    pauses, pause = [], 0.0
    for _ in range(6):
        pause = next_pause(pause, RECONNECT_MAX_PAUSE)
        pauses.append(pause)
    assert pauses == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0]
