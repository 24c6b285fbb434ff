"""``item.report_progress`` and ``item.progress``: written at most once a second, fenced
by the claim, read back by others, the last report written when the handler returns, a
later run not showing an earlier one's, and purged with the item (docs/consumers.md)."""

import math
import threading
import time

import pytest
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from django_txqueue import Queue, Status, models
from django_txqueue.models import QueueItem, QueueProgress
from django_txqueue.testing import drain

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def every_call(monkeypatch):
    """No throttle: each report is written, so that a test sees each one."""
    monkeypatch.setattr(models, "PROGRESS_EVERY", 0.0)


def claimed(queue="progress", **options):
    Queue(queue).enqueue({})
    (item,) = Queue(queue).claim(pid="test", **options)
    return item


def progress_of(item):
    """The item's progress as another reader sees it: a fresh instance."""
    return QueueItem.objects.get(pk=item.pk).progress


def test_no_progress_before_a_report():
    item = claimed()
    assert item.progress is None
    assert progress_of(item) is None


def test_a_report_is_read_back_at_once_and_by_another_reader(every_call):
    item = claimed()
    assert item.report_progress(40, 100, "rows") is True
    assert item.progress == {"done": 40, "total": 100, "message": "rows"}
    # Another connection, as the admin or a second process would read it.
    seen = []

    def read():
        seen.append(progress_of(item))
        connection.close()

    reader = threading.Thread(target=read)
    reader.start()
    reader.join()
    assert seen == [{"done": 40, "total": 100, "message": "rows"}]
    item.report_progress(41.5)
    assert progress_of(item) == {
        "done": 41.5,
        "total": None,
        "message": "",
    }


def test_reports_are_written_at_most_once_a_second_and_the_last_when_the_handler_returns():
    item = Queue("progress").enqueue({"calls": 500, "steps": 0})
    with CaptureQueriesContext(connection) as queries:
        assert drain("progress").counts == {"done": 1}
    writes = [q["sql"] for q in queries if "queueprogress" in q["sql"].lower()]
    # The first report (an UPDATE that finds no row, the claim's check, the upsert) and
    # the last, held back, written before the acknowledgement: not 501.
    assert len(writes) <= 4, writes
    stored = QueueItem.objects.get(pk=item.pk)
    assert stored.status == Status.DONE
    assert stored.progress == {"done": 0, "total": 0, "message": "all steps"}


def test_a_claim_taken_over_cannot_write_and_its_report_is_not_the_new_runs(every_call):
    first = claimed(lease=0.01)
    time.sleep(0.05)
    assert first.report_progress(7, 10, "first run")
    assert Queue("progress").requeue_stuck() == 1  # its lease ran out
    (second,) = Queue("progress").claim(pid="other")
    assert progress_of(first) is None  # the earlier run's
    assert first.report_progress(8, 10, "first run, late") is False
    assert second.report_progress(1, 10, "second run") is True
    assert first.write_progress() is False
    assert progress_of(first)["message"] == "second run"


def test_a_finished_item_keeps_its_last_report(every_call):
    item = claimed()
    item.report_progress(3, 3, "finished")
    assert item.ack()
    assert item.report_progress(4, 3) is False  # settled: no claim holds it
    assert progress_of(item) == {
        "done": 3,
        "total": 3,
        "message": "finished",
    }


@pytest.mark.parametrize(
    ("arguments", "error", "names"),
    [
        ((-1,), ValueError, "done"),
        (("many",), ValueError, "done"),
        ((True,), ValueError, "done"),
        ((math.nan,), ValueError, "done"),
        ((1, math.inf), ValueError, "total"),
        ((1, -2), ValueError, "total"),
        ((1, 2, 3), TypeError, "message"),
    ],
)
def test_bad_arguments_get_an_error_that_names_them_and_write_nothing(arguments, error, names):
    item = claimed()
    with pytest.raises(error, match=names):
        item.report_progress(*arguments)
    assert not QueueProgress.objects.exists()
    assert item.progress is None


def test_a_long_message_is_cut(every_call):
    item = claimed()
    item.report_progress(1, message="x" * 5000)
    assert len(progress_of(item)["message"]) == models.PROGRESS_MESSAGE_LENGTH


def test_purging_an_item_deletes_its_report(every_call):
    done, kept = claimed(), claimed()
    for item in (done, kept):
        item.report_progress(1, 1)
    assert done.ack()
    assert Queue("progress").purge() == 1
    assert list(QueueProgress.objects.values_list("item_id", flat=True)) == [kept.pk]
    assert kept.ack()
    assert QueueItem.objects.filter(pk=kept.pk).delete_finished() == 1
    assert not QueueProgress.objects.exists()


def test_an_atomic_handlers_last_report_is_written_before_its_acknowledgement():
    item = Queue("progress_atomic").enqueue({"calls": 50, "steps": 0})
    assert drain("progress_atomic").counts == {"done": 1}
    assert progress_of(item)["message"] == "all steps"


# -- in the admin ------------------------------------------------------------------------

SCRIPT = "<script>alert(1)</script>"


def test_the_items_page_shows_its_progress_live_and_escaped(admin_client, every_call):
    item = claimed()
    item.report_progress(40, 100, SCRIPT)
    page = admin_client.get(reverse("admin:django_txqueue_queueitem_change", args=[item.pk]))
    content = page.content.decode()
    url = reverse("admin:django_txqueue_queueitem_progress", args=[item.pk])
    assert f'data-refresh-url="{url}"' in content
    assert "40 of 100 (40%) · &lt;script&gt;" in content
    assert SCRIPT not in content
    assert "django_txqueue/dashboard.js" in content
    item.report_progress(50, 100, SCRIPT)
    live = admin_client.get(url).content.decode()
    assert live == "50 of 100 (50%) · &lt;script&gt;alert(1)&lt;/script&gt;"
    assert item.ack()  # finished: shown, no longer re-read
    content = admin_client.get(
        reverse("admin:django_txqueue_queueitem_change", args=[item.pk])
    ).content.decode()
    assert "50 of 100 (50%)" in content and "data-refresh-url" not in content


def test_the_progress_view_needs_the_view_permission(client, every_call):
    item = claimed()
    item.report_progress(1, 2)
    url = reverse("admin:django_txqueue_queueitem_progress", args=[item.pk])
    client.force_login(User.objects.create_user("nobody", password="pw", is_staff=True))  # noqa: S106
    assert client.get(url).status_code == 403
    user = User.objects.create_user("viewer", password="pw", is_staff=True)  # noqa: S106
    user.user_permissions.set(Permission.objects.filter(codename="view_queueitem"))
    client.force_login(user)
    assert client.get(url).content.decode() == "1 of 2 (50%)"


def test_the_dashboard_lists_running_items_with_their_progress(admin_client, every_call):
    reporting, silent = claimed(), claimed()
    reporting.report_progress(3, message=SCRIPT)
    fragment = admin_client.get(
        reverse("admin:django_txqueue_dashboard_changelist") + "?fragment=1"
    ).content.decode()
    table = fragment[fragment.index('id="running-table"') :]
    assert f'data-item="{reporting.pk}"' in table
    assert f'data-item="{silent.pk}"' not in table  # reports nothing: not listed
    assert "3 · &lt;script&gt;alert(1)&lt;/script&gt;" in table
    assert SCRIPT not in fragment
