"""django_txqueue.consumer.supervisor: ``run_queue_consumer --processes N``'s supervisor,
with plain Python children that record the signals they get (e2e/test_consumer_processes.py runs
it with real consumers).

Children are started again when they die, after a pause that grows while they keep dying
young; signals are passed on to each, once, and a second one too; children that exit 0
are done.
"""

import os
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest

from django_txqueue.consumer import supervisor
from django_txqueue.consumer.supervisor import MAX_RESTART_PAUSE, Supervisor, child_argv
from tests.helpers import ROOT, child_pids, kill_tree, wait_for

# A child: writes a file named by its pid when up, and one per signal it gets,
# "<pid>.<SIGNAL>.<n>". It exits 0 on a signal; "stubborn" only on the second one;
# "burst" at once; "hung-once" the first one started exits 75, as one that stopped a hung
# handler does.
CHILD = r"""
import os, signal, sys, time
from pathlib import Path

here, mode, got = Path(sys.argv[1]), sys.argv[2], []

def on_signal(signum, frame):
    got.append(signum)
    (here / f"{os.getpid()}.{signal.Signals(signum).name}.{len(got)}").touch()
    if mode != "stubborn" or len(got) > 1:
        sys.exit(0)

for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    if signal.getsignal(signum) is not signal.SIG_IGN:
        signal.signal(signum, on_signal)
(here / str(os.getpid())).touch()
if mode == "hung-once" and not (here / "hung").exists():
    (here / "hung").touch()
    sys.exit(75)
while mode != "burst":
    time.sleep(0.05)
"""
# The supervisor, as run_queue_consumer runs it; "nohup" starts it with SIGHUP ignored.
SUPERVISOR = r"""
import signal, sys
if sys.argv[1] == "nohup":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
from django_txqueue.consumer.supervisor import Supervisor
child = [sys.executable, "-c", sys.argv[2], sys.argv[3], sys.argv[4]]
sys.exit(Supervisor(child, int(sys.argv[5])).run())
"""


SUPERVISED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def signals_got(here, pid):
    """The signals child ``pid`` (a CHILD in ``here``) got, in order, by name."""
    found = [p.name.split(".") for p in here.glob(f"{pid}.*")]
    return [name for _, name, _ in sorted(found, key=lambda parts: int(parts[2]))]


class Supervised:
    """A supervisor process of ``processes`` children in ``mode``, in a session of its own."""

    def __init__(self, tmp_path, mode, processes, *, nohup=False):
        self.here = tmp_path
        self.log = tmp_path / "supervisor.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    SUPERVISOR,
                    "nohup" if nohup else "-",
                    CHILD,
                    str(tmp_path),
                    mode,
                    str(processes),
                ],
                cwd=ROOT,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
                stderr=log,
                start_new_session=True,  # as in a terminal: its own process group
            )

    def started(self):
        """The pids of every child started so far."""
        return sorted(int(path.name) for path in self.here.iterdir() if path.name.isdigit())

    def got(self, pid):
        return signals_got(self.here, pid)

    def children(self):
        return sorted(child_pids(self.process.pid))

    def output(self):
        return self.log.read_text()

    def exit_code(self, timeout=10):
        return self.process.wait(timeout=timeout)

    def kill(self):
        kill_tree(self.process)


@pytest.fixture
def supervise(tmp_path):
    made = []

    def start(mode, processes, **options):
        made.append(Supervised(tmp_path, mode, processes, **options))
        assert wait_for(lambda: len(made[-1].started()) == processes), made[-1].output()
        return made[-1]

    yield start
    for supervised in made:
        supervised.kill()


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class TestChildArgv:
    def test_the_command_line_without_processes_run_by_this_interpreter(self):
        argv = ["-m", "django", "run_queue_consumer", "sms", "--processes", "4", "--burst"]
        assert child_argv(argv) == [
            sys.executable,
            "-m",
            "django",
            "run_queue_consumer",
            "sms",
            "--burst",
        ]
        assert child_argv(["manage.py", "run_queue_consumer", "--processes=4", "-v", "2"]) == [
            sys.executable,
            "manage.py",
            "run_queue_consumer",
            "-v",
            "2",
        ]

    def test_by_default_this_processs_own_command_line(self, monkeypatch):
        """``sys.orig_argv`` keeps ``-m django``; ``sys.argv`` would name django/__main__.py."""
        monkeypatch.setattr(
            sys, "orig_argv", ["python3", "-m", "django", "run_queue_consumer", "--processes=2"]
        )
        assert child_argv() == [sys.executable, "-m", "django", "run_queue_consumer"]


def exits_with(code):
    return [sys.executable, "-c", f"import sys; sys.exit({code})"]


@pytest.mark.slow
class TestRestart:
    """``Supervisor.check`` of one child, its pauses recorded instead of slept."""

    @pytest.fixture
    def pauses(self, monkeypatch):
        slept = []
        monkeypatch.setattr(
            supervisor, "time", SimpleNamespace(monotonic=time.monotonic, sleep=slept.append)
        )
        return slept

    def finished(self, argv, born=None):
        child = subprocess.Popen(argv)
        child.wait(timeout=30)
        return child, time.monotonic() if born is None else born

    def test_a_running_child_is_kept(self):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            born = time.monotonic()
            assert Supervisor(exits_with(1), 1).check(child, born) == (child, born)
        finally:
            child.kill()
            child.wait()

    def test_a_child_that_exits_0_is_done(self, pauses):
        assert Supervisor(exits_with(1), 1).check(*self.finished(exits_with(0))) is None
        assert pauses == []

    def test_a_dead_child_is_started_again_after_a_pause_that_grows_while_they_die_young(
        self, pauses, caplog
    ):
        watched = Supervisor(exits_with(1), 1)
        child, born = self.finished(exits_with(3))
        for _ in range(7):
            restarted, born = watched.check(child, born)
            assert restarted.pid != child.pid and restarted.wait(timeout=30) == 1
            child = restarted
        assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_RESTART_PAUSE, MAX_RESTART_PAUSE]
        assert "exited with 3 after 0 s; restarting in 1 s" in caplog.text

    def test_a_child_that_lived_long_is_started_again_at_once(self, pauses):
        watched = Supervisor(exits_with(1), 1)
        watched.restart_pause = 16.0  # after a crash loop
        long_ago = time.monotonic() - supervisor.YOUNG_DEATH - 1
        restarted, _ = watched.check(*self.finished(exits_with(1), born=long_ago))
        restarted.wait(timeout=30)
        assert pauses == [0]

    def test_no_restart_once_told_to_stop(self, pauses):
        watched = Supervisor(exits_with(1), 1)
        watched.received.append(signal.SIGTERM)
        assert watched.check(*self.finished(exits_with(1))) is None
        assert pauses == []

    def test_no_restart_when_told_to_stop_during_the_pause(self, monkeypatch):
        watched = Supervisor(exits_with(1), 1)

        def signalled(seconds):
            watched.received.append(signal.SIGTERM)  # it arrived while it waited

        monkeypatch.setattr(
            supervisor, "time", SimpleNamespace(monotonic=time.monotonic, sleep=signalled)
        )
        assert watched.check(*self.finished(exits_with(1))) is None


@pytest.mark.slow
class TestRun:
    def test_starts_n_children_each_in_a_session_of_its_own(self, supervise):
        running = supervise("loop", 3)
        pids = running.started()
        assert running.children() == pids
        assert all(os.getsid(pid) == pid for pid in pids)
        assert os.getsid(running.process.pid) != os.getsid(pids[0])

    def test_a_killed_child_is_replaced_and_sigterm_stops_every_child(self, supervise):
        running = supervise("loop", 2)
        first, second = running.started()
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: len(running.started()) == 3, timeout=15), running.output()
        replacement = (set(running.started()) - {first, second}).pop()
        assert wait_for(lambda: running.children() == sorted([second, replacement]))
        assert f"consumer process {first} exited with -9" in running.output()

        running.process.send_signal(signal.SIGTERM)
        assert running.exit_code() == 0, running.output()
        assert running.got(second) == running.got(replacement) == ["SIGTERM"]
        assert not alive(second) and not alive(replacement)

    def test_children_that_exit_0_are_done_and_so_is_the_supervisor(self, supervise):
        running = supervise("burst", 2)
        assert running.exit_code() == 0, running.output()
        assert len(running.started()) == 2  # none started again
        assert "exited" not in running.output()

    def test_a_second_signal_is_passed_on_too(self, supervise):
        running = supervise("stubborn", 2)
        pids = running.started()
        running.process.send_signal(signal.SIGTERM)
        assert wait_for(lambda: all(running.got(pid) == ["SIGTERM"] for pid in pids))
        time.sleep(0.5)
        assert running.process.poll() is None and all(alive(pid) for pid in pids)
        running.process.send_signal(signal.SIGTERM)
        assert running.exit_code() == 0, running.output()
        assert [running.got(pid) for pid in pids] == [["SIGTERM", "SIGTERM"]] * 2

    def test_ctrl_c_reaches_each_child_once_through_the_supervisor(self, supervise):
        """The terminal signals the supervisor's process group; its children, in sessions of
        their own, hear it from the supervisor only: once, a graceful stop."""
        running = supervise("stubborn", 2)
        pids = running.started()
        os.killpg(running.process.pid, signal.SIGINT)
        assert wait_for(lambda: all(running.got(pid) == ["SIGINT"] for pid in pids))
        time.sleep(0.5)
        assert [running.got(pid) for pid in pids] == [["SIGINT"]] * 2
        assert all(alive(pid) for pid in pids)
        running.process.send_signal(signal.SIGTERM)
        assert running.exit_code() == 0, running.output()

    def test_sighup_is_passed_on(self, supervise):
        running = supervise("loop", 2)
        pids = running.started()
        running.process.send_signal(signal.SIGHUP)
        assert running.exit_code() == 0, running.output()
        assert [running.got(pid) for pid in pids] == [["SIGHUP"]] * 2

    def test_under_nohup_sighup_stops_nothing(self, supervise):
        running = supervise("loop", 2, nohup=True)
        pids = running.started()
        running.process.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert running.process.poll() is None and all(alive(pid) for pid in pids)
        assert [running.got(pid) for pid in pids] == [[], []]
        running.process.send_signal(signal.SIGTERM)
        assert running.exit_code() == 0, running.output()

    def test_a_child_started_as_a_signal_arrives_gets_it_too(self, tmp_path, monkeypatch):
        """A child that stopped a hung handler exits 75 and is replaced; SIGTERM reaches the
        supervisor as the replacement starts, before the supervisor holds it among its
        children: the replacement is stopped too, and the supervisor ends."""
        watched = Supervisor([sys.executable, "-c", CHILD, str(tmp_path), "hung-once"], 1)
        spawn, started = watched.spawn, []

        def spawn_as_sigterm_arrives():
            started.append(spawn())
            if len(started) == 2:
                watched.on_signal(signal.SIGTERM, None)
            return started[-1]

        monkeypatch.setattr(watched, "spawn", spawn_as_sigterm_arrives)
        handlers = {signum: signal.getsignal(signum) for signum in SUPERVISED_SIGNALS}
        # Were it missed, the replacement would run on: killed after a while, run() ends.
        killer = threading.Timer(20, lambda: started[-1][0].kill())
        killer.start()
        try:
            assert watched.run() == 0
        finally:
            killer.cancel()
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        replacement = started[1][0]
        # Stopped by SIGTERM: by its handler, or before Python had installed it (not SIGKILL).
        stopped = (replacement.returncode, signals_got(tmp_path, replacement.pid))
        assert stopped in ((0, ["SIGTERM"]), (-signal.SIGTERM, []))
