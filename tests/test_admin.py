"""The admin pages through Django's test client: pages, filters, search, actions, the
stuck page and its rescue, the dashboard, permissions, escaping and query counts.

The read model behind the stuck page and the dashboard is in test_reads.py."""

import datetime as dt
import re

import django
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
STUCK = reverse("admin:django_txqueue_queueitem_stuck")
DASHBOARD = reverse("admin:django_txqueue_dashboard_changelist")
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


def stuck_rows(response):
    """The stuck page's rows: item id -> (reason, overdue seconds)."""
    assert response.status_code == 200
    return {
        row.item.pk: (row.reason, row.overdue.total_seconds()) for row in response.context["stuck"]
    }


def queue_rows(response):
    """The dashboard's rows by queue name."""
    assert response.status_code == 200
    return {row.name: row for row in response.context["overview"].queues}


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

    @pytest.mark.parametrize("page", [DASHBOARD, STUCK])
    def test_breadcrumbs_in_the_markup_of_the_django_running(self, admin_client, world, page):
        """Django 5.2's admin styles <div class="breadcrumbs">, 6's <ol class="breadcrumbs">:
        in the other markup the trail is a numbered list (the browser test looks too)."""
        content = admin_client.get(page).content.decode()
        trail = re.search(r'<(div|ol) class="breadcrumbs">(.*?)</\1>', content, re.S)
        assert trail is not None
        assert trail[1] == ("ol" if django.VERSION >= (6, 0) else "div")
        links = re.findall(r'<a href="([^"]+)">([^<]+)</a>', trail[2])
        home = [("/admin/", "Home"), ("/admin/django_txqueue/", "Queue")]
        assert links == home + ([(ITEMS, "Queue items")] if page == STUCK else [])
        assert ("&rsaquo;" in trail[2]) == (trail[1] == "div")

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

    def test_delete_one_finished_item_from_its_page(self, admin_client, world):
        page = item_page(world["done"]).replace("change/", "delete/")
        assert admin_client.post(page, {"post": "yes"}).status_code == 302
        assert not QueueItem.objects.filter(pk=world["done"].pk).exists()

    def test_no_delete_of_unfinished_items(self, admin_client, world):
        chosen = [world["done"].pk, world["ready"].pk]
        data = {"action": "delete_selected", "_selected_action": chosen, "post": "yes"}
        assert admin_client.post(ITEMS, data).status_code == 403
        assert QueueItem.objects.filter(pk__in=chosen).count() == 2
        assert (
            admin_client.get(item_page(world["ready"]).replace("change/", "delete/")).status_code
            == 403
        )


class TestStuckPage:
    def test_lists_the_stuck_items_with_why_and_how_long(self, admin_client, world):
        rows = stuck_rows(admin_client.get(STUCK))
        assert set(rows) == {world["orphan"].pk, world["expired"].pk}
        reason, overdue = rows[world["orphan"].pk]
        # The dead consumer's heartbeat is 5 minutes old; it counts as dead after 60 s.
        assert reason == "consumer stopped heartbeating" and 230 < overdue < 250
        reason, overdue = rows[world["expired"].pk]
        assert reason == "lease expired" and 290 < overdue < 310

    def test_an_item_of_a_stopped_consumer(self, admin_client, world):
        item = in_progress("gamma", "host:3:gone")
        assert stuck_rows(admin_client.get(STUCK))[item.pk][0] == "consumer stopped"

    def test_the_page_shows_rows_links_and_the_button(self, admin_client, world):
        content = admin_client.get(STUCK).content.decode()
        assert f'<tr data-item-id="{world["orphan"].pk}">' in content
        assert f'href="{consumer_page(world["dead"])}"' in content
        assert 'id="rescue-form"' in content and "Rescue 2 stuck items" in content
        assert f'href="{STUCK}"' in admin_client.get(ITEMS).content.decode()

    def test_an_empty_page(self, admin_client, db):
        content = admin_client.get(STUCK).content.decode()
        assert 'id="no-stuck-items"' in content and "disabled" in content

    def test_rescue(self, admin_client, world):
        response = admin_client.post(STUCK, follow=True)
        assert response.redirect_chain == [(STUCK, 302)]
        assert "Rescued 2 stuck items." in message(response)
        for name in ("orphan", "expired"):
            assert status_of(world[name]) == Status.READY
        assert status_of(world["running"]) == Status.IN_PROGRESS
        assert stuck_rows(response) == {}

    def test_rescue_follows_each_queues_rescue_setting(self, admin_client, world, settings):
        settings.TXQUEUE = {"QUEUES": {"beta": {"RESCUE": "fail"}}}
        gamma = in_progress("gamma", DEAD)
        assert "Rescued 3 stuck items." in message(admin_client.post(STUCK, follow=True))
        assert status_of(world["orphan"]) == status_of(world["expired"]) == Status.FAILED
        assert status_of(gamma) == Status.READY

    def test_rescue_needs_a_csrf_token(self, admin_user, world):
        client = Client(enforce_csrf_checks=True)
        client.force_login(admin_user)
        assert client.post(STUCK).status_code == 403
        assert status_of(world["orphan"]) == Status.IN_PROGRESS


class TestDashboard:
    @pytest.fixture(autouse=True)
    def no_configured_queues(self, settings):
        settings.TXQUEUE = {"QUEUES": {}}

    def test_configured_queues_show_with_zeros_before_their_first_item(
        self, admin_client, world, settings
    ):
        """A new queue is on the dashboard at once, not after its first item."""
        settings.TXQUEUE = {"QUEUES": {"emails": {"LEASE": 5}, "alpha": {}}}
        rows = queue_rows(admin_client.get(DASHBOARD))
        assert set(rows) == {"alpha", "beta", "emails"}
        emails = rows["emails"]
        counts = (emails.ready, emails.in_progress, emails.failed, emails.stuck, emails.consumers)
        assert counts == (0, 0, 0, 0, 0)
        assert (emails.done_last_hour, emails.oldest_ready) == (0, None)
        assert rows["alpha"].ready == 1  # one with items: counted as before
        content = admin_client.get(DASHBOARD).content.decode()
        assert '<tr data-queue="emails">' in content

    def test_a_row_per_queue(self, admin_client, world):
        rows = queue_rows(admin_client.get(DASHBOARD))
        assert set(rows) == {"alpha", "beta"}
        alpha, beta = rows["alpha"], rows["beta"]
        assert (alpha.ready, alpha.in_progress, alpha.failed, alpha.stuck) == (1, 1, 1, 0)
        assert (beta.ready, beta.in_progress, beta.failed, beta.stuck) == (0, 2, 0, 2)
        assert (alpha.consumers, beta.consumers) == (1, 0)  # the live consumer serves alpha
        assert (alpha.done_last_hour, alpha.failed_last_hour) == (0, 1)
        assert (beta.done_last_hour, beta.failed_last_hour) == (1, 0)
        assert alpha.oldest_ready is not None and beta.oldest_ready is None

    def test_oldest_ready_age(self, admin_client, db):
        make("alpha", run_at=timezone.now() - dt.timedelta(minutes=3))
        make("alpha", run_at=timezone.now() + dt.timedelta(hours=1))  # not due: not waiting
        age = queue_rows(admin_client.get(DASHBOARD))["alpha"].oldest_ready
        assert dt.timedelta(minutes=3) <= age < dt.timedelta(minutes=4)

    def test_throughput_per_minute(self, admin_client, db):
        now = timezone.now()
        for minutes_ago, status in ((0, Status.DONE), (0, Status.DONE), (5, Status.FAILED)):
            make("alpha", status, finished_at=now - dt.timedelta(minutes=minutes_ago))
        make("alpha", Status.DONE, finished_at=now - dt.timedelta(hours=2))  # too old
        response = admin_client.get(DASHBOARD)
        minutes = response.context["overview"].minutes
        assert len(minutes) == 60
        # By start, not by position: the page's clock may have passed into the next minute.
        by_start = {minute.start: minute for minute in minutes}
        this_minute = now.replace(second=0, microsecond=0)
        assert (by_start[this_minute].done, by_start[this_minute].failed) == (2, 0)
        assert by_start[this_minute - dt.timedelta(minutes=5)].failed == 1
        assert sum(m.done + m.failed for m in minutes) == 3
        content = response.content.decode()
        assert '<svg id="throughput-chart"' in content
        assert "last 60 minutes: 2 done, 1 failed; busiest minute 2." in content

    def test_the_page_links_and_refreshes(self, admin_client, world):
        content = admin_client.get(DASHBOARD).content.decode()
        assert '<tr data-queue="alpha">' in content
        assert f'href="{ITEMS}?queue=alpha&amp;status__exact=4">1</a>' in content
        assert 'id="dashboard-live" data-refresh-url="?fragment=1"' in content
        assert "django_txqueue/dashboard.js" in content
        fragment = admin_client.get(DASHBOARD, {"fragment": "1"}).content.decode()
        assert '<table id="queue-table">' in fragment and "<html" not in fragment

    def test_fair_and_ordered_queues_show_their_keys(self, admin_client, db, settings):
        settings.TXQUEUE = {"QUEUES": {"fair": {"FAIR": True}}}
        for key, n in (("heavy", 3), ("light", 1)):
            for _ in range(n):
                enqueue("fair", {}, key=key)
        enqueue("plain", {})
        response = admin_client.get(DASHBOARD, {"fragment": "1"})
        [fair] = response.context["overview"].keyed
        assert fair.name == "fair"
        assert fair.keys == {"keys_waiting": 2, "top_keys": [["heavy", 3], ["light", 1]]}
        content = response.content.decode()
        assert '<table id="key-table">' in content
        assert f'href="{ITEMS}?queue=fair&amp;q=heavy">heavy</a> (3)' in content

    def test_linked_from_the_app_index(self, admin_client, db):
        app_index = reverse("admin:app_list", args=["django_txqueue"])
        assert f'href="{DASHBOARD}"' in admin_client.get(app_index).content.decode()

    def test_only_the_dashboard_page_exists(self, admin_client, world):
        for suffix in ("add/", f"{world['ready'].pk}/change/", f"{world['ready'].pk}/delete/"):
            assert admin_client.get(DASHBOARD + suffix).status_code == 404

    def test_queries_do_not_grow_with_queues(self, admin_client, db):
        def queries():
            with CaptureQueriesContext(connection) as captured:
                assert admin_client.get(DASHBOARD).status_code == 200
            return len(captured)

        make("q0", Status.FAILED, finished_at=timezone.now())
        few = queries()
        for n in range(1, 20):
            make(f"q{n}", Status.FAILED, finished_at=timezone.now())
            in_progress(f"q{n}", DEAD, expired=True)
            Consumer.objects.create(identity=f"c{n}", host="h", os_pid=n, queues=[f"q{n}"])
        assert queries() == few


class TestPermissions:
    @staticmethod
    def pages(world):
        return (
            ITEMS,
            CONSUMERS,
            STUCK,
            DASHBOARD,
            f"{DASHBOARD}?fragment=1",
            item_page(world["ready"]),
            consumer_page(world["live"]),
        )

    def test_anonymous_users_go_to_the_login_page(self, client, world):
        for url in self.pages(world):
            response = client.get(url)
            assert response.status_code == 302
            assert response.url.startswith(reverse("admin:login"))
        assert client.post(STUCK).url.startswith(reverse("admin:login"))
        assert status_of(world["orphan"]) == Status.IN_PROGRESS

    def test_staff_without_view_permission_get_403(self, client, world):
        client.force_login(staff("nobody", "view_consumer"))
        for url in self.pages(world):
            expected = 200 if url.startswith(CONSUMERS) else 403
            assert client.get(url).status_code == expected, url
        assert client.post(STUCK).status_code == 403
        assert status_of(world["orphan"]) == Status.IN_PROGRESS

    def test_view_only_staff_see_the_pages(self, viewer, world):
        assert len(shown(viewer.get(ITEMS))) == 6
        assert len(shown(viewer.get(CONSUMERS))) == 3
        for url in self.pages(world):
            assert viewer.get(url).status_code == 200, url
        assert 'id="rescue-form"' not in viewer.get(STUCK).content.decode()
        app_index = reverse("admin:app_list", args=["django_txqueue"])
        assert f'href="{DASHBOARD}"' in viewer.get(app_index).content.decode()

    def test_view_only_staff_cannot_rescue(self, viewer, world):
        assert viewer.post(STUCK).status_code == 403
        assert status_of(world["orphan"]) == status_of(world["expired"]) == Status.IN_PROGRESS

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

    def test_the_stuck_page_and_dashboard_escape(self, admin_client, db):
        in_progress(SCRIPT, SCRIPT, expired=True)
        Consumer.objects.create(identity="c", host="h", os_pid=1, queues=[SCRIPT])
        for url in (STUCK, DASHBOARD, f"{DASHBOARD}?fragment=1"):
            content = admin_client.get(url).content.decode()
            assert SCRIPT not in content, url
            assert "&lt;script&gt;alert(1)&lt;/script&gt;" in content, url

    def test_a_fair_queues_keys_are_escaped_on_the_dashboard(self, admin_client, db):
        enqueue("fair", {}, key=SCRIPT)
        content = admin_client.get(DASHBOARD).content.decode()
        assert SCRIPT not in content
        assert "&lt;script&gt;alert(1)&lt;/script&gt;</a> (1)" in content

    def test_consumer_fields_are_escaped(self, admin_client, db):
        Consumer.objects.create(identity=SCRIPT, host=SCRIPT, os_pid=1, queues=[SCRIPT])
        content = admin_client.get(CONSUMERS).content.decode()
        assert SCRIPT not in content
        assert "&lt;script&gt;" in content
