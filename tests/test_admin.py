"""The admin pages through Django's test client: pages, filters, search, actions,
permissions, escaping and query counts."""

import datetime as dt

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import reverse
from django.utils import timezone

from django_txqueue import Status, enqueue
from django_txqueue.models import Consumer, QueueItem

ITEMS = reverse("admin:django_txqueue_queueitem_changelist")
CONSUMERS = reverse("admin:django_txqueue_consumer_changelist")
SCRIPT = "<script>alert(1)</script>"
LIVE, DEAD = "host:1:live", "host:2:dead"


def item_page(item):
    return reverse("admin:django_txqueue_queueitem_change", args=[item.pk])


def consumer_page(consumer):
    return reverse("admin:django_txqueue_consumer_change", args=[consumer.pk])


def make(queue, status=Status.READY, **fields):
    item = enqueue(queue, {"n": 1})
    QueueItem.objects.filter(pk=item.pk).update(status=status, **fields)
    return QueueItem.objects.get(pk=item.pk)


def in_progress(queue, pid, *, expired=False):
    lease = timezone.now() + dt.timedelta(minutes=-5 if expired else 5)
    return make(queue, Status.IN_PROGRESS, pid=pid, claim_token=7, lease_expires_at=lease)


def shown(response):
    """The ids of the changelist's rows."""
    assert response.status_code == 200
    return {item.pk for item in response.context["cl"].result_list}


def message(response):
    return " ".join(str(m) for m in response.context["messages"])


def act(client, action, items):
    data = {"action": action, "_selected_action": [item.pk for item in items], "index": 0}
    return client.post(ITEMS, data, follow=True)


def status_of(item):
    return QueueItem.objects.get(pk=item.pk).status


@pytest.fixture
def world(db):
    """One item in each state, across two queues, with a live and a dead consumer."""
    now = timezone.now()
    live = Consumer.objects.create(identity=LIVE, host="host", os_pid=1, queues=["alpha"])
    dead = Consumer.objects.create(
        identity=DEAD, host="host", os_pid=2, last_heartbeat_at=now - dt.timedelta(minutes=5)
    )
    stopped = Consumer.objects.create(identity="host:3:gone", host="h", os_pid=3, stopped_at=now)
    return {
        "ready": make("alpha", key="k-ready", dedup_key="d-ready"),
        "running": in_progress("alpha", LIVE),
        "orphan": in_progress("beta", DEAD),
        "expired": in_progress("beta", "script:9", expired=True),
        "done": make("beta", Status.DONE, finished_at=now),
        "failed": make("alpha", Status.FAILED, finished_at=now, last_error="boom"),
        "live": live,
        "dead": dead,
        "stopped": stopped,
    }


def staff(username, *codenames):
    user = User.objects.create_user(username, password="pw", is_staff=True)  # noqa: S106
    user.user_permissions.set(Permission.objects.filter(codename__in=codenames))
    return user


@pytest.fixture
def viewer(client, db):
    client.force_login(staff("viewer", "view_queueitem", "view_consumer"))
    return client


class TestPages:
    def test_changelist_shows_every_item(self, admin_client, world):
        items = {world[name].pk for name in ("ready", "running", "orphan", "expired", "done")}
        assert shown(admin_client.get(ITEMS)) == items | {world["failed"].pk}

    @pytest.mark.parametrize(
        ("query", "expected"),
        [
            ({"status__exact": Status.FAILED.value}, {"failed"}),
            ({"status__exact": Status.IN_PROGRESS.value}, {"running", "orphan", "expired"}),
            ({"queue": "beta"}, {"orphan", "expired", "done"}),
            ({"stuck": "yes"}, {"orphan", "expired"}),
            ({"stuck": "no"}, {"ready", "running", "done", "failed"}),
            ({"q": "k-ready"}, {"ready"}),
            ({"q": "d-ready"}, {"ready"}),
            ({"pid": LIVE}, {"running"}),
        ],
    )
    def test_filters_and_search(self, admin_client, world, query, expected):
        assert shown(admin_client.get(ITEMS, query)) == {world[name].pk for name in expected}

    def test_search_by_id(self, admin_client, world):
        assert shown(admin_client.get(ITEMS, {"q": str(world["done"].pk)})) == {world["done"].pk}

    def test_search_by_a_number_too_big_for_an_id(self, admin_client, world):
        assert shown(admin_client.get(ITEMS, {"q": "9" * 30})) == set()

    def test_queue_filter_lists_the_queue_names(self, admin_client, world):
        content = admin_client.get(ITEMS).content.decode()
        assert "?queue=alpha" in content and "?queue=beta" in content

    def test_status_column_has_a_label(self, admin_client, world):
        content = admin_client.get(ITEMS).content.decode()
        for label in ("ready", "in progress", "in progress, stuck", "done", "failed"):
            assert f"● {label}<" in content

    def test_detail_pages_are_read_only(self, admin_client, world):
        for name in ("ready", "running", "orphan", "done", "failed"):
            response = admin_client.get(item_page(world[name]))
            assert response.status_code == 200
            assert not response.context["has_change_permission"]
            assert 'name="_save"' not in response.content.decode()
        assert "<pre>boom</pre>" in admin_client.get(item_page(world["failed"])).content.decode()

    def test_no_add_page(self, admin_client, db):
        assert admin_client.get(reverse("admin:django_txqueue_queueitem_add")).status_code == 403

    def test_consumers(self, admin_client, world):
        response = admin_client.get(CONSUMERS)
        assert response.status_code == 200
        rows = {c.identity: c for c in response.context["cl"].result_list}
        assert rows[LIVE].in_flight_count == 1 and rows[DEAD].in_flight_count == 1
        content = response.content.decode()
        for state in ("live", "dead", "stopped"):
            assert f"● {state}<" in content
        link = f"{ITEMS}?pid=host%3A1%3Alive&amp;status__exact=2"
        assert f'<a href="{link}">1</a>' in content
        assert admin_client.get(consumer_page(world["live"])).status_code == 200

    def test_no_n_plus_1(self, admin_client, world, django_assert_max_num_queries):
        def page_queries():
            with CaptureQueriesContext(connection) as queries:
                assert admin_client.get(ITEMS).status_code == 200
                assert admin_client.get(CONSUMERS).status_code == 200
            return len(queries)

        few = page_queries()
        for n in range(50):
            enqueue("alpha", {"n": n}, key=f"k{n}")
            Consumer.objects.create(identity=f"c{n}", host="h", os_pid=n)
        with django_assert_max_num_queries(few):
            page_queries()


class TestActions:
    def test_requeue(self, admin_client, world):
        chosen = [world[name] for name in ("running", "orphan", "expired", "done", "failed")]
        response = act(admin_client, "requeue", chosen)
        assert "Requeued 3 of 5 selected items; 2 were left alone (1 running, 1 already done)" in (
            message(response)
        )
        assert status_of(world["running"]) == Status.IN_PROGRESS
        assert status_of(world["done"]) == Status.DONE
        for name in ("orphan", "expired", "failed"):
            item = QueueItem.objects.get(pk=world[name].pk)
            assert (item.status, item.pid, item.claim_token) == (Status.READY, "", None)
            assert item.attempts == world[name].attempts
        assert QueueItem.objects.ready().filter(pk=world["failed"].pk).exists()

    def test_requeue_leaves_a_failed_item_whose_dedup_key_is_held(self, admin_client, db):
        failed = enqueue("alpha", {}, dedup_key="once")
        QueueItem.objects.filter(pk=failed.pk).update(status=Status.FAILED)
        holder = enqueue("alpha", {}, dedup_key="once")
        other = make("alpha", Status.FAILED)
        response = act(admin_client, "requeue", [failed, holder, other])
        assert "Requeued 2 of 3" in message(response)
        assert "1 held back by an unfinished item with the same dedup key" in message(response)
        assert status_of(failed) == Status.FAILED

    def test_mark_failed(self, admin_client, world):
        chosen = [world[name] for name in ("ready", "running", "orphan", "done")]
        response = act(admin_client, "mark_failed", chosen)
        left = "2 were left alone (1 running, 1 already finished)."
        assert f"Marked 2 of 4 selected items failed; {left}" in message(response)
        assert status_of(world["running"]) == Status.IN_PROGRESS
        assert status_of(world["done"]) == Status.DONE
        for name in ("ready", "orphan"):
            item = QueueItem.objects.get(pk=world[name].pk)
            assert (item.status, item.claim_token) == (Status.FAILED, None)
            assert item.last_error == "marked failed in the admin by admin"

    def test_delete_finished_items(self, admin_client, world):
        chosen = [world["done"].pk, world["failed"].pk]
        data = {"action": "delete_selected", "_selected_action": chosen, "post": "yes"}
        admin_client.post(ITEMS, data)
        assert not QueueItem.objects.filter(pk__in=chosen).exists()

    def test_no_delete_of_unfinished_items(self, admin_client, world):
        chosen = [world["done"].pk, world["ready"].pk]
        data = {"action": "delete_selected", "_selected_action": chosen, "post": "yes"}
        assert admin_client.post(ITEMS, data).status_code == 403
        assert QueueItem.objects.filter(pk__in=chosen).count() == 2
        assert (
            admin_client.get(item_page(world["ready"]).replace("change/", "delete/")).status_code
            == 403
        )


class TestPermissions:
    def test_anonymous_users_go_to_the_login_page(self, client, world):
        for url in (ITEMS, CONSUMERS, item_page(world["ready"]), consumer_page(world["live"])):
            response = client.get(url)
            assert response.status_code == 302
            assert response.url.startswith(reverse("admin:login"))

    def test_staff_without_view_permission_get_403(self, client, world):
        client.force_login(staff("nobody"))
        for url in (ITEMS, CONSUMERS, item_page(world["ready"]), consumer_page(world["live"])):
            assert client.get(url).status_code == 403

    def test_view_only_staff_see_the_pages(self, viewer, world):
        assert len(shown(viewer.get(ITEMS))) == 6
        assert len(shown(viewer.get(CONSUMERS))) == 3
        assert viewer.get(item_page(world["ready"])).status_code == 200
        assert viewer.get(consumer_page(world["live"])).status_code == 200

    def test_view_only_staff_change_nothing(self, viewer, world):
        before = dict(QueueItem.objects.values_list("pk", "status"))
        for action in ("requeue", "mark_failed", "delete_selected"):
            response = act(viewer, action, [world["orphan"], world["failed"], world["done"]])
            assert response.status_code in (200, 403)
        data = {"action": "delete_selected", "_selected_action": [world["done"].pk], "post": "yes"}
        viewer.post(ITEMS, data)
        assert dict(QueueItem.objects.values_list("pk", "status")) == before

    def test_an_action_without_csrf_token_is_refused(self, admin_user, world):
        client = Client(enforce_csrf_checks=True)
        client.force_login(admin_user)
        assert act(client, "requeue", [world["failed"]]).status_code == 403
        assert status_of(world["failed"]) == Status.FAILED


class TestEscaping:
    def test_payload_key_and_error_are_escaped(self, admin_client, db):
        item = enqueue("alpha", {"text": SCRIPT}, key=SCRIPT, dedup_key=SCRIPT)
        QueueItem.objects.filter(pk=item.pk).update(last_error=SCRIPT, result=[SCRIPT])
        for url in (ITEMS, item_page(item), f"{ITEMS}?q={SCRIPT}"):
            content = admin_client.get(url).content.decode()
            assert SCRIPT not in content
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content

    def test_consumer_fields_are_escaped(self, admin_client, db):
        Consumer.objects.create(identity=SCRIPT, host=SCRIPT, os_pid=1, queues=[SCRIPT])
        content = admin_client.get(CONSUMERS).content.decode()
        assert SCRIPT not in content
        assert "&lt;script&gt;" in content
