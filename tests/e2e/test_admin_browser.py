"""The admin in a real browser: Playwright drives Debian's chromium against a live server of
the example project, with a real consumer process, on a database of the example's own.

Chromium is Debian's (``apt install chromium``), launched by its path: nothing is ever
downloaded (no ``playwright install``). Playwright comes with the ``browser`` extra. Without
either the tests skip, except under ``CI=true``, where that is a failure.

Screenshots go to ``TXQUEUE_ARTIFACTS`` (default: ``browser-artifacts/`` in pytest's
temporary directory); with ``TXQUEUE_UPDATE_SCREENSHOTS=1`` the SQLite run also copies them
to ``docs/screenshots/``, which docs/admin.md shows.
"""

import os
import re
import shutil
import time
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import ROOT

from .example import VENDOR, Example
from .servers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
# As this machine kind's notes start it: no sandbox (we are root), and no connections of
# its own to Google's services, which the closed network refuses.
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
USERNAME, PASSWORD = "admin", "browser-test-password"
CHANGELIST = "/admin/django_txqueue/queueitem/"
WAIT = 15  # seconds for anything the consumer or the server does; each takes about one


def browser_missing():
    """Why the browser tests cannot run here, or None."""
    if not Path(CHROMIUM).exists():
        return f"no {CHROMIUM}: apt install chromium"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[browser]'"
    return None


@pytest.fixture(scope="module")
def browser():
    reason = browser_missing()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI must run the browser tests: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import expect, sync_playwright

    expect.set_options(timeout=WAIT * 1000)
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield launched
        finally:
            launched.close()


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """The server's and the consumer's output, and the fake gateway's file."""
    return tmp_path_factory.mktemp("cinema")


@pytest.fixture(scope="module")
def cinema(browser, example_database, logs):
    """The example project with a superuser."""
    example = Example(example_database, logs / "gateway.sqlite3")
    example.manage(
        "createsuperuser",
        "--noinput",
        "--username",
        USERNAME,
        "--email",
        "admin@example.com",
        DJANGO_SUPERUSER_PASSWORD=PASSWORD,
    )
    return example


@pytest.fixture(scope="module")
def site_url(cinema, logs):
    """``runserver`` on a free port: the base URL. DEBUG on (the example's default), so
    that Django's staticfiles serves the admin's CSS and JavaScript with no other server."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ("runserver", "--noreload", f"127.0.0.1:{port}")
    with cinema.running(*args, log=logs / "runserver.log", DJANGO_DEBUG="1") as server:
        deadline = time.monotonic() + WAIT
        while True:
            try:
                urllib.request.urlopen(f"{base}/admin/login/", timeout=5).close()  # noqa: S310
                break
            except OSError:
                log = (logs / "runserver.log").read_text()
                assert server.poll() is None, f"runserver exited:\n{log}"
                assert time.monotonic() < deadline, f"runserver did not answer:\n{log}"
                time.sleep(0.1)
        yield base


@pytest.fixture(scope="session")
def artifacts(request, tmp_path_factory):
    """Where the screenshots go; the path is printed."""
    path = Path(
        os.environ.get("TXQUEUE_ARTIFACTS") or tmp_path_factory.getbasetemp() / "browser-artifacts"
    )
    path.mkdir(parents=True, exist_ok=True)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter:
        reporter.write_line(f"browser screenshots: {path}")
    return path


def screenshot(page, artifacts, name):
    """A full-page PNG ``{name}-{vendor}.png``; copied to docs/screenshots/{name}.png from
    the SQLite run when TXQUEUE_UPDATE_SCREENSHOTS=1."""
    path = artifacts / f"{name}-{VENDOR}.png"
    page.screenshot(path=path, full_page=True)
    if os.environ.get("TXQUEUE_UPDATE_SCREENSHOTS") == "1" and VENDOR == "sqlite":
        docs = ROOT / "docs" / "screenshots"
        docs.mkdir(exist_ok=True)
        shutil.copyfile(path, docs / f"{name}.png")


def new_page(browser, site_url, **options):
    """A page in a context of its own (cookies, storage), a fixed size for screenshots."""
    context = browser.new_context(
        base_url=site_url, viewport={"width": 1280, "height": 800}, **options
    )
    context.set_default_timeout(WAIT * 1000)
    return context.new_page()


@pytest.fixture(scope="module")
def logged_in(browser, site_url):
    """The session cookie of a login through the admin's form, once per module: each login
    costs a password hash."""
    from playwright.sync_api import expect

    page = new_page(browser, site_url)
    try:
        page.goto("/admin/login/")
        page.get_by_label("Username").fill(USERNAME)
        page.get_by_label("Password").fill(PASSWORD)
        page.get_by_role("button", name="Log in").click()
        expect(page.get_by_role("heading", name="Site administration")).to_be_visible()
        return page.context.storage_state()
    finally:
        page.context.close()


@pytest.fixture
def page(browser, site_url, logged_in):
    """A fresh browser context with the admin session of ``logged_in``."""
    page = new_page(browser, site_url, storage_state=logged_in)
    try:
        yield page
    finally:
        page.context.close()


# -- making items in the states the pages show ------------------------------------------


# Each in one ``manage.py shell``: a process start is most of what a step costs.
BOOKED = """
from cinema import sms
from cinema.booking import book_seat
from django_txqueue import QueueItem
booking = book_seat({seat}, "+15550100{seat:02d}")  # the booking page's code path
item = QueueItem.objects.filter(key=sms.item_key(booking.pk))
{then}
print(item.get().pk)
"""
# FAILED as after its last attempt, through the API the admin's action uses.
FAILED = 'item.mark_failed("cinema.gateway.GatewayError: provider unavailable")'
# IN_PROGRESS under a consumer that is gone, its lease expired a minute ago.
STRANDED = """
import datetime as dt
from django.utils import timezone
ago = timezone.now() - dt.timedelta(minutes=2)
item.update(status=2, pid="gone:1", claim_token=1, attempts=1, claimed_at=ago,
            lease_expires_at=ago + dt.timedelta(minutes=1))
"""

# An hour of SMS sent before the tests (DONE rows, a few each minute), so that the
# throughput chart, and its screenshot, have something to draw.
HISTORY = """
import datetime as dt
import random
from django.utils import timezone
from django_txqueue import QueueItem
now = timezone.now()
QueueItem.objects.bulk_create(
    QueueItem(queue="sms", payload={}, status=3, attempts=1,
              finished_at=now - dt.timedelta(minutes=minute, seconds=10 + n))
    for minute in range(1, 60) for n in range(random.Random(minute).randint(1, 6))
)
"""


def booked(cinema, seat, then=""):
    """Book ``seat`` (its SMS is queued), then run ``then`` on its item; the item's pk."""
    return int(cinema.shell(BOOKED.format(seat=seat, then=then)))


def status_of(cinema, pk):
    code = f"from django_txqueue import QueueItem; print(QueueItem.objects.get(pk={pk}).status)"
    return int(cinema.shell(code))


def reload_until(page, locator, text):
    """Reload until ``locator`` contains ``text``: the page shows a row as it was read."""
    deadline = time.monotonic() + WAIT
    while text not in locator.inner_text():
        assert time.monotonic() < deadline, f"no {text!r} in {locator.inner_text()!r}"
        page.wait_for_timeout(250)
        page.reload()


# -- the scenarios ----------------------------------------------------------------------


def test_requeue_a_failed_item_and_see_the_consumer_send_it(cinema, page, logs):
    from playwright.sync_api import expect

    pk = booked(cinema, 1, then=FAILED)
    with cinema.running("run_queue_consumer", "sms", log=logs / "consumer.log"):
        page.goto(CHANGELIST)
        status_filter = page.locator('#changelist-filter details[data-filter-title="status"]')
        status_filter.get_by_role("link", name="failed", exact=True).click()
        expect(page).to_have_url(re.compile(r"status__exact=4"))
        row = page.locator("#result_list tbody tr", has=page.locator(f'input[value="{pk}"]'))
        expect(row).to_contain_text("failed")

        row.locator("input.action-select").check()
        page.locator("select[name=action]").select_option("requeue")
        # "Go" until Django 6.1, "Run" since: the button by its place, not its text.
        page.locator("div.actions button[name=index]").click()
        expect(page.locator("ul.messagelist")).to_contain_text("Requeued 1 of 1 selected item.")

        page.goto(f"{CHANGELIST}{pk}/change/")
        reload_until(page, page.locator(".fieldBox.field-status_label .readonly"), "done")
        expect(page.locator(".field-result_pretty")).to_contain_text('"sent_now": true')
        expect(page.locator(".fieldBox.field-attempts .readonly")).to_have_text("1")


def test_rescue_a_stuck_item_from_the_stuck_page(cinema, page, artifacts):
    from playwright.sync_api import expect

    # No consumer runs here: a live one would rescue the item before the page could.
    pk = booked(cinema, 2, then=STRANDED)
    page.goto(CHANGELIST)
    page.get_by_role("link", name="Stuck items").click()
    expect(page).to_have_url(re.compile(r"/admin/django_txqueue/queueitem/stuck/$"))
    row = page.locator(f'#stuck-items tr[data-item-id="{pk}"]')
    expect(row).to_be_visible()
    screenshot(page, artifacts, "stuck")

    page.locator("#rescue-form").get_by_role("button", name=re.compile(r"^Rescue")).click()
    expect(page.locator("ul.messagelist")).to_contain_text(
        re.compile(r"Rescued 1 stuck item(\(s\)|s)?\.")
    )
    expect(page).to_have_url(re.compile(r"/admin/django_txqueue/queueitem/stuck/$"))
    expect(row).to_have_count(0)
    assert status_of(cinema, pk) == 1  # READY


def test_dashboard_shows_the_queues_and_links_to_the_failed_items(cinema, page, artifacts):
    from playwright.sync_api import expect

    cinema.shell(HISTORY)
    failed = booked(cinema, 3, then=FAILED)
    booked(cinema, 4)  # ready: no consumer runs

    page.goto("/admin/")
    page.locator("#content-main").get_by_role("link", name="Dashboard", exact=True).click()
    expect(page).to_have_url(re.compile(r"/admin/django_txqueue/dashboard/$"))
    sms = page.locator('#queue-table tr[data-queue="sms"]')
    # Counts, not exact numbers: the earlier tests' items are there too, whatever their fate.
    failed_cell = sms.locator('td[data-column="failed"]')
    expect(failed_cell).to_have_text(re.compile(r"^[1-9]\d*$"))
    ready = sms.locator('td[data-column="ready"]')
    expect(ready).to_have_text(re.compile(r"^[1-9]\d*$"))
    expect(page.locator("svg#throughput-chart")).to_be_visible()
    screenshot(page, artifacts, "dashboard")

    # The live part reads the counts again by itself: a new booking shows without a reload.
    before = int(ready.inner_text())
    booked(cinema, 5)
    expect(ready).to_have_text(str(before + 1))

    failed_count = int(failed_cell.inner_text())
    failed_cell.locator("a").click()
    expect(page).to_have_url(re.compile(r"status__exact=4"))
    expect(page).to_have_url(re.compile(r"queue=sms"))
    expect(page.locator("#result_list tbody tr")).to_have_count(failed_count)
    expect(page.locator(f'#result_list input[value="{failed}"]')).to_have_count(1)


def test_pause_and_resume_a_queue_from_the_dashboard(cinema, page):
    from playwright.sync_api import expect

    booked(cinema, 6)  # the sms queue has an item: its row is there
    is_paused = "from django_txqueue import Queue; print(Queue('sms').is_paused())"
    page.goto("/admin/django_txqueue/dashboard/")
    sms = page.locator('#queue-table tr[data-queue="sms"]')
    expect(sms.locator('td[data-column="paused"]')).to_contain_text("running")

    sms.get_by_role("button", name="Pause").click()
    expect(page.locator("ul.messagelist")).to_contain_text("Queue 'sms' paused")
    expect(sms.locator('td[data-column="paused"]')).to_contain_text("paused")
    assert cinema.shell(is_paused).strip() == "True"

    sms.get_by_role("button", name="Resume").click()
    expect(page.locator("ul.messagelist")).to_contain_text("Queue 'sms' resumed")
    expect(sms.get_by_role("button", name="Pause")).to_be_visible()
    assert cinema.shell(is_paused).strip() == "False"


def test_schedule_an_entry_edit_it_disable_it_and_run_it_now(cinema, page):
    from playwright.sync_api import expect

    schedule_page = "/admin/django_txqueue/schedule/"
    items = "from django_txqueue import Queue; print(Queue('reports').items.count())"
    page.goto(f"{schedule_page}add/")
    page.locator("#id_name").fill("browser-beat")
    page.locator("#id_queue").fill("reports")
    page.locator("#id_cron").fill("0 25 * * *")  # no hour 25: refused before it is saved
    page.locator("input[name=_save]").click()
    expect(page.locator(".field-cron .errorlist")).to_contain_text("not a cron expression")
    page.locator("#id_cron").fill("0 3 * * *")
    page.locator("input[name=_save]").click()
    expect(page).to_have_url(re.compile(r"/admin/django_txqueue/schedule/$"))
    row = page.locator("#result_list tbody tr", has_text="browser-beat")
    expect(row).to_contain_text("cron 0 3 * * *")

    row.get_by_role("link", name="browser-beat").click()
    page.locator("#id_cron").fill("")
    page.locator("#id_every").fill("3600")
    page.locator("input[name=_save]").click()
    expect(row).to_contain_text("every 3600 s")

    def act(action, message):
        row.locator("input.action-select").check()
        page.locator("select[name=action]").select_option(action)
        page.locator("div.actions button[name=index]").click()
        expect(page.locator("ul.messagelist")).to_contain_text(message)

    act("disable", "1 entry disabled.")
    expect(row).to_contain_text("(disabled)")
    assert cinema.shell(items).strip() == "0"
    act("run_now", "Browser-beat: enqueued item")
    assert cinema.shell(items).strip() == "1"


# The breadcrumbs as laid out: each page's own markup per Django version (Django 5.2's
# stylesheet styles <div class="breadcrumbs">, 6's <ol class="breadcrumbs">; the other
# one is a numbered list down the page). Separators: 5.2's are text, 6's ::after.
TRAIL = """() => {
    const trail = document.querySelector("nav .breadcrumbs");
    const links = [...trail.querySelectorAll("a")];
    const items = [...trail.querySelectorAll("li")];
    const after = items.filter(li => getComputedStyle(li, "::after").content.includes("\u203a"));
    return {
        background: getComputedStyle(trail).backgroundColor,
        listItems: items.filter(li => getComputedStyle(li).display === "list-item").length,
        rows: new Set(links.map(a => Math.round(a.getBoundingClientRect().top))).size,
        links: links.map(a => a.textContent),
        separators: trail.innerText.split("\u203a").length - 1 + after.length,
    };
}"""


@pytest.mark.parametrize(
    ("path", "links"),
    [
        ("/admin/django_txqueue/dashboard/", ["Home", "Queue"]),
        ("/admin/django_txqueue/queueitem/stuck/", ["Home", "Queue", "Queue items"]),
    ],
)
def test_the_breadcrumbs_are_one_line_not_a_numbered_list(cinema, page, path, links):
    page.goto(path)
    trail = page.evaluate(TRAIL)
    assert trail["links"] == links
    assert trail["listItems"] == 0, trail
    assert trail["rows"] == 1, trail
    assert trail["separators"] == len(links), trail
    assert trail["background"] not in ("rgba(0, 0, 0, 0)", "transparent"), trail
