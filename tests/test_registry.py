"""django_txqueue.consumer.registry: ``@handler("queue")``, the handlers a consumer serves, and
``autodiscover()`` of the installed apps' ``queues.py``."""

import subprocess
import sys

import pytest

from django_txqueue.consumer import registry
from django_txqueue.consumer.registry import handler
from django_txqueue.tasks.backend import TASKS_FRAMEWORK, run_task
from tests.helpers import ROOT, child_env


@pytest.fixture
def registered():
    """Queue names registered by the test, forgotten afterwards."""
    names = []
    yield names.append
    for name in names:
        registry.unregister(name)


class TestHandler:
    def test_registers_the_function_and_returns_it_unchanged(self, registered):
        def send(item):
            return "sent"

        registered("registry-send")
        assert handler("registry-send")(send) is send
        assert registry.handlers()["registry-send"] is send
        assert not registry.is_atomic("registry-send")

    def test_a_second_handler_for_a_queue_is_refused_naming_the_first(self, registered):
        @handler("registry-taken")
        def first(item):
            pass

        registered("registry-taken")

        def second(item):
            pass

        with pytest.raises(ValueError) as refused:
            handler("registry-taken")(second)
        assert str(refused.value) == (
            "queue 'registry-taken' already has a handler: "
            f"{first.__module__}.{first.__qualname__}"
        )
        assert registry.handlers()["registry-taken"] is first

    def test_registering_the_same_function_again_is_harmless(self, registered):
        """A queues module imported twice (autodiscover, then a test) registers it again."""

        def send(item):
            pass

        registered("registry-again")
        handler("registry-again", atomic=True)(send)
        handler("registry-again")(send)
        assert registry.handlers()["registry-again"] is send
        assert not registry.is_atomic("registry-again")  # the latest registration counts

    @pytest.mark.parametrize(
        ("name", "error"), [("", ValueError), ("x" * 101, ValueError), (7, TypeError)]
    )
    def test_a_bad_queue_name_is_refused_when_decorating(self, name, error):
        with pytest.raises(error, match="queue name"):
            handler(name)
        assert name not in registry.handlers()

    def test_unregister_forgets_the_handler_and_its_atomic_flag(self):
        @handler("registry-gone", atomic=True)
        def gone(item):
            pass

        registry.unregister("registry-gone")
        assert "registry-gone" not in registry.handlers()
        assert not registry.is_atomic("registry-gone")
        registry.unregister("registry-gone")  # twice: nothing to forget, no error


class TestAtomic:
    def test_atomic_is_remembered_per_queue(self):
        @handler("atomic-registration", atomic=True)
        def first(item):
            pass

        try:
            assert registry.is_atomic("atomic-registration")
            assert not registry.is_atomic("echo")
        finally:
            registry.unregister("atomic-registration")
        assert not registry.is_atomic("atomic-registration")

    def test_atomic_must_be_a_bool(self):
        with pytest.raises(TypeError, match="atomic must be True or False, not 'yes'"):
            handler("atomic-bad", atomic="yes")
        assert "atomic-bad" not in registry.handlers()


def test_autodiscover_imports_each_installed_apps_queues_module(monkeypatch):
    """tests/testapp/queues.py, imported afresh into an empty registry."""
    monkeypatch.setattr(registry, "_handlers", {})
    monkeypatch.setattr(registry, "_atomic", set())
    monkeypatch.delitem(sys.modules, "tests.testapp.queues", raising=False)
    registry.autodiscover()
    found = registry._handlers
    assert {"echo", "boom", "slow", "atomic", "sms"} <= set(found)
    assert found["echo"].__module__ == "tests.testapp.queues"
    assert registry.is_atomic("atomic") and not registry.is_atomic("echo")


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Django Tasks framework installed")
class TestWithTheTasksBackend:
    def test_handlers_include_the_tasks_backends_queues(self):
        known = registry.handlers()
        assert known["default"] is run_task and known["tasks-other"] is run_task

    def test_a_registered_handler_wins_over_the_tasks_backend_for_its_queue(self, registered):
        @handler("tasks-other")
        def own(item):
            pass

        registered("tasks-other")
        assert registry.handlers()["tasks-other"] is own
        assert registry.handlers()["default"] is run_task


class Source:
    """Handlers from elsewhere than @handler: ``known`` by name, ``found`` as they come."""

    def __init__(self, known=None, found=None):
        self.known, self.found = known or {}, found or {}

    def handlers(self):
        return dict(self.known)

    def takes_any_queue(self):
        return bool(self.found)

    def find(self, queue):
        return self.found.get(queue)


def test_a_source_adds_its_handlers_and_finds_queues_nobody_named(monkeypatch):
    monkeypatch.setattr(registry, "_sources", [])
    monkeypatch.setattr(registry, "_handlers", {})
    assert (registry.handlers(), registry.takes_any_queue(), registry.find("x")) == (
        {},
        False,
        None,
    )

    def known(item):
        pass

    def found(item):
        pass

    source = Source(known={"known": known}, found={"arrived": found})
    registry.add_source(source)
    registry.add_source(source)  # once, however often
    assert registry._sources == [source]
    assert registry.handlers() == {"known": known}
    assert registry.takes_any_queue() is True
    assert (registry.find("arrived"), registry.find("other")) == (found, None)


@pytest.mark.skipif(TASKS_FRAMEWORK is None, reason="no Django Tasks framework installed")
def test_autodiscover_imports_the_tasks_backends_named_in_settings():
    """In a fresh process the registry knows no Tasks queue until autodiscover() imports the
    backend named in TASKS, which registers them: the registry never imports it."""
    code = (
        "import sys, django; django.setup(); from django_txqueue.consumer import registry; "
        "before = sorted(registry.handlers()); registry.autodiscover(); "
        "print(before, 'django_txqueue.backends' in sys.modules, "
        "registry.handlers()['tasks-other'].__name__)"
    )
    env = {**child_env(), "TXQUEUE_TEST_NAME": ""}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[]", "True", "run_task"]
