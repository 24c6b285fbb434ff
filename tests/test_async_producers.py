"""``aenqueue`` and ``aenqueue_many`` (docs/producing.md): ``enqueue`` and ``enqueue_many``
for async code, run where Django runs synchronous database work."""

import inspect

import pytest
from asgiref.sync import async_to_sync

from django_txqueue import QueueItem, Status, aenqueue, aenqueue_many, enqueue, enqueue_many


@pytest.mark.django_db(transaction=True)
def test_aenqueue_commits_an_item_from_async_code():
    async def view():
        item = await aenqueue("echo", {"seat": 7}, priority=3, key="hall-1")
        # Django's async ORM sees it: committed on its own, at once.
        return item, await QueueItem.objects.filter(pk=item.pk).aexists()

    item, seen = async_to_sync(view)()
    assert seen is True
    stored = QueueItem.objects.get(pk=item.pk)
    assert (stored.queue, stored.payload, stored.priority, stored.key, stored.status) == (
        "echo",
        {"seat": 7},
        3,
        "hall-1",
        Status.READY,
    )


@pytest.mark.django_db
def test_aenqueue_many_writes_all_or_none():
    items = async_to_sync(aenqueue_many)("echo", [{"n": n} for n in range(3)])
    assert [item.payload for item in items] == [{"n": 0}, {"n": 1}, {"n": 2}]
    with pytest.raises(TypeError, match="payload"):
        async_to_sync(aenqueue_many)("echo", [{"n": 3}, {"bad": object()}])
    assert QueueItem.objects.filter(queue="echo").count() == 3


@pytest.mark.django_db
def test_bad_input_is_refused_as_by_enqueue():
    with pytest.raises(ValueError, match="a queue name must be 1 to 100 characters"):
        async_to_sync(aenqueue)("", {})
    assert not QueueItem.objects.exists()


def test_they_take_the_same_arguments():
    assert inspect.signature(aenqueue) == inspect.signature(enqueue)
    assert inspect.signature(aenqueue_many) == inspect.signature(enqueue_many)
    assert inspect.iscoroutinefunction(aenqueue) and aenqueue.__name__ == "aenqueue"
