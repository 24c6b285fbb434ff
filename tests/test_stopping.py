"""django_txqueue.consumer.stopping: a stop signal counts once, whether Python's handler
or the watchdog takes it first. The watchdog itself, with real consumer processes hung in
handlers and C calls: tests/e2e/test_limits_processes.py."""

import os
import signal
import threading

import pytest

from django_txqueue.consumer.stopping import STOP_SIGNALS, StopSignals


@pytest.fixture
def signals():
    """StopSignals installed in this process, recording each stop; the handlers before
    are put back after."""
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    installed = StopSignals()
    installed.stops = []
    installed.install(lambda: installed.stops.append(True))
    yield installed
    for signum, handler in before.items():
        signal.signal(signum, handler)


def sigterm():
    """A real SIGTERM to this process: Python runs its handler before the next line."""
    os.kill(os.getpid(), signal.SIGTERM)


def test_the_first_signal_stops(signals):
    sigterm()
    assert signals.stops == [True]
    assert (signals.handled, signals.taken) == (1, 1)


def test_a_signal_python_took_is_not_taken_again_by_the_watchdog(signals):
    sigterm()
    signals.heard(1, signal.SIGTERM)  # the watchdog hears it too, past its grace
    assert signals.stops == [True]
    assert signals.taken == 1


def test_a_signal_the_watchdog_took_is_not_a_second_one_when_python_runs_its_handler(signals):
    """Heard by the watchdog while the main thread was in a C call; Python's handler runs
    once the call returns: the same signal, not a second (which would end the process)."""
    signals.heard(1, signal.SIGTERM)
    assert signals.stops == [True]
    sigterm()
    assert signals.stops == [True]
    assert (signals.handled, signals.taken) == (1, 1)


def test_sighup_stays_ignored_where_it_was():
    before = {signum: signal.getsignal(signum) for signum in STOP_SIGNALS}
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        StopSignals().install(lambda: None)
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("given_signals", "concurrency", "on_the_loops_thread"),
    [(True, 1, True), (True, 2, False), (False, 1, False)],
)
def test_handlers_run_on_the_loops_thread_only_for_the_processs_own_consumer_at_one(
    queue, given_signals, concurrency, on_the_loops_thread
):
    """``run_queue_consumer`` gives the Worker its StopSignals; a Worker made in one's own
    code keeps a handler thread, so that a hung handler never holds the caller's."""
    from django_txqueue.consumer.worker import Worker

    queue.enqueue_many([{"n": n} for n in range(3)])
    threads = []
    worker = Worker(
        {queue.name: lambda item: threads.append(threading.current_thread())},
        concurrency=concurrency,
        burst=True,
        signals=StopSignals() if given_signals else None,
    )
    assert worker.run() == 0
    assert len(threads) == 3
    assert all((thread is threading.current_thread()) == on_the_loops_thread for thread in threads)
