"""The Django admin pages: queue items (with requeue, mark failed and delete), the stuck
items (with a rescue button), consumers, a dashboard of every queue (with pause and
resume buttons), and the schedule's entries kept in the database (edited here, with run
now, enable and disable; the settings' entries shown beside them, read-only).

The queue pages only read; every change goes through the queryset methods and so through
``store``, in one statement that re-checks each row's state, never through a form that
writes a whole row back (which would undo a consumer's acknowledgement in between).
Everything users wrote (payloads, keys, errors, queue names) goes out escaped.
"""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any, cast

import django
from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.auth import get_permission_codename
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.core.serializers.json import DjangoJSONEncoder
from django.db import router
from django.db.models import (
    BooleanField,
    Case,
    Count,
    Exists,
    IntegerField,
    OuterRef,
    Q,
    QuerySet,
    Subquery,
    Value,
    When,
)
from django.db.models.functions import Coalesce
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import URLPattern, path, reverse
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import escape, format_html
from django.utils.http import urlencode
from django.utils.safestring import SafeString
from django.utils.timesince import timesince

from . import conf, schedule
from .api import Queue, configured_queues, queue_databases, requeue_all_stuck
from .checks import schedule_task_problems
from .db import dialect_for
from .flows import Flow
from .models import (
    Consumer,
    Dashboard,
    QueueDependency,
    QueueItem,
    QueueItemQuerySet,
    Schedule,
    Status,
    stuck_condition,
)
from .observe.chart import throughput_chart
from .observe.flowchart import MOST_DRAWN, flow_chart
from .observe.logs import counted
from .observe.reads import overview_of, progress_text, stuck_items
from .status import FINISHED

# A colour per state; the label is always written too, so the colour is never the only cue.
STATUS_COLOURS: dict[int, str] = {
    Status.READY: "#2563eb",
    Status.IN_PROGRESS: "#d97706",
    Status.DONE: "#16a34a",
    Status.FAILED: "#dc2626",
    Status.CANCELLED: "#6b7280",
    Status.WAITING: "#0891b2",
}
STUCK_COLOUR = "#9333ea"
# A flow's page lists at most this many of its items (its counts cover all).
FLOW_PAGE_ROWS = 500

# ModelAdmin and Paginator are generic only in django-stubs; at run time neither can be
# subscripted.
if TYPE_CHECKING:
    QueueItemModelAdmin = admin.ModelAdmin[QueueItem]
    ConsumerModelAdmin = admin.ModelAdmin[Consumer]
    DashboardModelAdmin = admin.ModelAdmin[Dashboard]
    ScheduleModelAdmin = admin.ModelAdmin[Schedule]
    ScheduleModelForm = forms.ModelForm[Schedule]
    AnyPaginator = Paginator[Any]
else:
    QueueItemModelAdmin = ConsumerModelAdmin = DashboardModelAdmin = admin.ModelAdmin
    ScheduleModelAdmin = admin.ModelAdmin
    ScheduleModelForm = forms.ModelForm
    AnyPaginator = Paginator

STUCK_PAGE_ROWS = 500  # the page lists the longest-claimed; the rescue takes them all


def pretty(value: Any) -> SafeString:
    """JSON indented inside <pre>, escaped."""
    text = json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, cls=DjangoJSONEncoder)
    return format_html("<pre>{}</pre>", text)


def dot(colour: str, label: str) -> SafeString:
    """A coloured dot and its label: the colour is never the only cue."""
    return format_html('<b style="color: {}">● {}</b>', colour, label)


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


# Django 6 writes the admin's breadcrumbs as <ol class="breadcrumbs">, which only its
# stylesheet styles; Django 5.2's styles <div class="breadcrumbs"> with &rsaquo; between.
OL_BREADCRUMBS = django.VERSION >= (6, 0)


def breadcrumbs(opts: Any, *trail: tuple[str, str]) -> dict[str, Any]:
    """admin/django_txqueue/breadcrumbs.html's context: Home, the app, ``trail``'s (title,
    url) pairs, then the page's title, in the markup of the Django running."""
    app = reverse("admin:app_list", kwargs={"app_label": opts.app_label})
    links = [("Home", reverse("admin:index")), (opts.app_config.verbose_name, app), *trail]
    return {"ol": OL_BREADCRUMBS, "links": links}


def may(request: HttpRequest, action: str) -> bool:
    """Whether the user holds QueueItem's ``action`` permission ("view", "change")."""
    opts = QueueItem._meta
    return request.user.has_perm(f"{opts.app_label}.{get_permission_codename(action, opts)}")


class EstimatedCountPaginator(AnyPaginator):
    """A count that never reads the whole table: COUNT(*) over a million rows alone
    outlasts a page's budget, even from an index.

    Unfiltered, the table's statistics answer (PostgreSQL, MySQL, MariaDB). Filtered,
    the count is exact up to ``exact_up_to`` rows (the filters' indexes find them),
    and beyond that the planner's estimate (never below the rows counted). SQLite, and
    tables estimated smaller than ``exact_up_to``, count exactly."""

    exact_up_to = 10_000

    @cached_property
    def count(self) -> int:
        queryset = self.object_list
        if not isinstance(queryset, QuerySet):
            return super().count
        dialect = dialect_for(queryset.db)
        if not queryset.query.where:
            rows = dialect.table_rows(queryset)
            if rows is not None and rows > self.exact_up_to:
                return rows
            return queryset.count()
        return dialect_for(queryset.db).estimated_count(queryset, self.exact_up_to)


class QueueNameFilter(admin.SimpleListFilter):
    title = "queue"
    parameter_name = "queue"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        # Every queue with items, as the filter promises. No index is led by the queue
        # over every row (the unique dedup constraint is on active_dedup_queue), so at a
        # million rows this reads the table once per name: the Prometheus scrape lists
        # known names instead (reads.known_queue_names).
        names = dialect_for(QueueItem.objects.db).distinct_values(QueueItem.objects.all(), "queue")
        return [(name, name) for name in names]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        return queryset.filter(queue=self.value()) if self.value() else queryset


class StuckFilter(admin.SimpleListFilter):
    """Stuck as ``QueueItem.objects.stuck()`` means it: IN_PROGRESS, lease expired or
    consumer dead."""

    title = "stuck"
    parameter_name = "stuck"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        return [("yes", "Yes"), ("no", "No")]

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if self.value() == "yes":
            return queryset.filter(stuck_condition())
        if self.value() == "no":
            return queryset.exclude(stuck_condition())
        return queryset


class FlowFilter(admin.SimpleListFilter):
    """The items of one flow (``?flow=<id>``), linked from its page. Flows are too many
    to list: the filter shows only while one is chosen (a filter with no choice shown is
    not applied)."""

    title = "flow"
    parameter_name = "flow"

    def lookups(self, request: HttpRequest, model_admin: Any) -> list[tuple[str, str]]:
        chosen = self.value()
        return [(str(chosen), "this flow")] if chosen else []

    def queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> QuerySet[Any]:
        if not self.value():
            return queryset
        try:
            flow = uuid.UUID(str(self.value()))
        except ValueError:
            return queryset.none()  # no flow has such an id
        return cast(QueueItemQuerySet, queryset).in_flow(flow)


def item_id(text: str) -> int | None:
    """``text`` as an item id, or None: ASCII digits only ("²" is a digit to Python, not
    to int()), and within a BIGINT, beyond which no id exists."""
    if text.isascii() and text.isdigit() and int(text) < 2**63:
        return int(text)
    return None


@admin.register(QueueItem)
class QueueItemAdmin(QueueItemModelAdmin):
    list_display = (
        "id",
        "queue",
        "status_label",
        "priority",
        "key",
        "attempts_of_max",
        "run_at",
        "age",
        "pid",
    )
    list_filter = ("status", QueueNameFilter, StuckFilter, FlowFilter)
    search_fields = ("key", "dedup_key")  # read by get_search_results below, exactly
    search_help_text = "An id, a key or a dedup key (exact)."
    ordering = ("-id",)
    # No COUNT(*) of the whole table: an estimate when unfiltered, and no second count of
    # the unfiltered total beside a filtered one.
    paginator = EstimatedCountPaginator
    show_full_result_count = False
    actions = ("requeue", "mark_failed", "cancel", "delete_selected")
    fields = (
        ("id", "queue", "status_label"),
        ("priority", "run_at", "created_at", "finished_at"),
        ("key", "dedup_key"),
        ("attempts", "max_attempts", "snoozes"),
        ("pid", "claimed_at", "lease_expires_at"),
        "cancel_requested_at",
        "progress_live",
        "flow_link",
        "trace_context",  # the enqueuer's W3C trace context, to find its trace (tracing)
        "payload_pretty",
        "result_pretty",
        "error_class",
        "last_error_pretty",
    )
    readonly_fields = tuple(
        name for row in fields for name in (row if isinstance(row, tuple) else (row,))
    )

    class Media:
        js = ("django_txqueue/dashboard.js",)  # re-reads a running item's progress

    def get_queryset(self, request: HttpRequest) -> QuerySet[QueueItem]:
        stuck = Case(When(stuck_condition(), then=Value(True)), default=Value(False))
        return super().get_queryset(request).annotate(is_stuck=stuck)

    # -- columns and fields ------------------------------------------------------------

    @admin.display(description="status", ordering="status")
    def status_label(self, item: QueueItem) -> SafeString:
        if getattr(item, "is_stuck", False):
            return dot(STUCK_COLOUR, "in progress, stuck")
        return dot(STATUS_COLOURS[item.status], Status(item.status).label)

    @admin.display(description="attempts")
    def attempts_of_max(self, item: QueueItem) -> str:
        return f"{item.attempts} / {item.max_attempts}"

    @admin.display(description="age", ordering="created_at")
    def age(self, item: QueueItem) -> str:
        return timesince(item.created_at)

    @admin.display(description="payload")
    def payload_pretty(self, item: QueueItem) -> SafeString:
        return pretty(item.payload)

    @admin.display(description="result")
    def result_pretty(self, item: QueueItem) -> SafeString:
        return pretty(item.result)

    @admin.display(description="last error")
    def last_error_pretty(self, item: QueueItem) -> SafeString:
        return format_html("<pre>{}</pre>", item.last_error)

    @admin.display(description="progress")
    def progress_live(self, item: QueueItem) -> SafeString:
        """The item's last progress report, re-read every 2 s while it runs."""
        text = progress_text(item.progress)
        if item.status != Status.IN_PROGRESS:
            return format_html("<span>{}</span>", text)
        url = reverse("admin:django_txqueue_queueitem_progress", args=[item.pk])
        return format_html(
            '<span data-refresh-url="{}" data-refresh-ms="2000">{}</span>', url, text
        )

    def progress_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """The item's progress as the change page's live field re-reads it: plain text."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        pk = item_id(object_id)
        item = QueueItem.objects.filter(pk=pk).first() if pk is not None else None
        if item is None:
            raise Http404("no such item")
        return HttpResponse(escape(progress_text(item.progress)))  # the script sets innerHTML

    @admin.display(description="flow")
    def flow_link(self, item: QueueItem) -> SafeString | str:
        if item.flow is None:
            return "–"
        url = reverse("admin:django_txqueue_queueitem_flow", args=[item.pk])
        waiting = f", waiting for {item.waiting_for}" if item.status == Status.WAITING else ""
        return format_html('<a href="{}">the whole flow</a>{}', url, waiting)

    def _items_crumb(self) -> tuple[str, str]:
        url = reverse("admin:django_txqueue_queueitem_changelist")
        return (str(self.opts.verbose_name_plural).capitalize(), url)

    # -- a flow's page -----------------------------------------------------------------

    def flow_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        """GET: the flow of item ``object_id``: a picture of its items and edges, and the
        items. POST (change permission): cancel its unfinished items."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        pk = item_id(object_id)
        item = QueueItem.objects.filter(pk=pk).first() if pk is not None else None
        if item is None or item.flow is None:
            raise Http404("no such item, or it belongs to no flow")
        flow = Flow.of(item)
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            cancelled = QueueItem.objects.in_flow(flow.id).cancel()
            self.message_user(
                request, f"Cancelled {counted(cancelled, 'item')} of the flow.", messages.SUCCESS
            )
            return HttpResponseRedirect(request.path)
        pks = [i.pk for i in flow.items]
        parents: dict[Any, list[Any]] = {}
        for waiter, parent in QueueDependency.objects.filter(item_id__in=pks).values_list(
            "item_id", "parent_id"
        ):
            parents.setdefault(waiter, []).append(parent)
        for each in flow.items:  # what each waits for, as the table says it
            each.parents_text = ", ".join(  # type: ignore[attr-defined]
                f"#{p}" for p in sorted(parents.get(each.pk, []))
            )
        shown = [
            (i.pk, i.queue, Status(i.status).label, STATUS_COLOURS[i.status]) for i in flow.items
        ]
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": f"Flow of item {item.pk}",
            "breadcrumbs": breadcrumbs(self.opts, self._items_crumb()),
            "flow": flow,
            "items": flow.items[:FLOW_PAGE_ROWS],
            "parents": parents,
            "counts": {Status(s).label: n for s, n in flow.counts().items()},
            "chart": flow_chart(shown, parents) if len(shown) <= MOST_DRAWN else None,
            "can_cancel": self.has_change_permission(request),
        }
        return TemplateResponse(request, "admin/django_txqueue/queueitem/flow.html", context)

    # -- the stuck page ----------------------------------------------------------------

    def get_urls(self) -> list[URLPattern]:
        stuck = path(
            "stuck/",
            self.admin_site.admin_view(self.stuck_view),
            name="django_txqueue_queueitem_stuck",
        )
        flow = path(
            "<path:object_id>/flow/",
            self.admin_site.admin_view(self.flow_view),
            name="django_txqueue_queueitem_flow",
        )
        progress = path(
            "<path:object_id>/progress/",
            self.admin_site.admin_view(self.progress_view),
            name="django_txqueue_queueitem_progress",
        )
        # Before "<path:object_id>/" can take them.
        return [stuck, flow, progress, *super().get_urls()]

    def stuck_view(self, request: HttpRequest) -> HttpResponse:
        """GET: the stuck items, why and how long. POST (change permission): rescue them all,
        as ``txqueue_requeue_stuck`` does, and say how many."""
        if not self.has_view_or_change_permission(request):
            raise PermissionDenied
        if request.method == "POST":
            if not self.has_change_permission(request):
                raise PermissionDenied
            rescued = requeue_all_stuck(router.db_for_write(QueueItem))
            self.message_user(
                request, f"Rescued {counted(rescued, 'stuck item')}.", messages.SUCCESS
            )
            return HttpResponseRedirect(request.path)
        items = QueueItem.objects.all()  # on the database the item pages read
        shown = stuck_items(items, Consumer.objects.using(items.db), STUCK_PAGE_ROWS)
        total = len(shown) if len(shown) < STUCK_PAGE_ROWS else items.stuck().count()
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Stuck items",
            "breadcrumbs": breadcrumbs(self.opts, self._items_crumb()),
            "stuck": shown,
            "total": total,
            "can_rescue": self.has_change_permission(request),
            "consumer_timeout": conf.get("CONSUMER_TIMEOUT"),
        }
        return TemplateResponse(request, "admin/django_txqueue/queueitem/stuck.html", context)

    def response_action(
        self, request: HttpRequest, queryset: QuerySet[Any], *args: Any, **kwargs: Any
    ) -> Any:
        """Django's, once every selected value is an id: Django filters by them as they
        come, and a forged one that is not a number would be a server error."""
        selected = request.POST.getlist(helpers.ACTION_CHECKBOX_NAME)
        if any(item_id(value) is None for value in selected):
            self.message_user(request, "The selection holds a value that is no item id.")
            return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset, *args, **kwargs)

    # -- search ------------------------------------------------------------------------

    def get_search_results(
        self, request: HttpRequest, queryset: QuerySet[QueueItem], search_term: str
    ) -> tuple[QuerySet[QueueItem], bool]:
        """Exact matches only, which indexes can serve: an id, a key or a dedup key."""
        term = search_term.strip()
        if not term:
            return queryset, False
        match = Q(key=term) | Q(dedup_key=term)
        if (pk := item_id(term)) is not None:
            match |= Q(pk=pk)
        return queryset.filter(match), False

    # -- permissions: nothing is edited by hand ----------------------------------------

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # items come from enqueue(), which validates them

    def has_change_permission(self, request: HttpRequest, obj: QueueItem | None = None) -> bool:
        # The change permission runs the actions; a detail page is a view for everyone, as
        # saving a form would write the whole row back over a consumer's acknowledgement.
        return obj is None and super().has_change_permission(request)

    def has_delete_permission(self, request: HttpRequest, obj: QueueItem | None = None) -> bool:
        finished_or_any = obj is None or obj.status in FINISHED
        return finished_or_any and super().has_delete_permission(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[QueueItem]) -> None:
        QueueItem.objects.filter(pk__in=queryset.values("pk")).delete_finished()

    def delete_model(self, request: HttpRequest, obj: QueueItem) -> None:
        # Through the store, as every row change, and only while the row is finished: a
        # requeue since the page was shown leaves it alone.
        QueueItem.objects.filter(pk=obj.pk).delete_finished()

    # -- actions -----------------------------------------------------------------------

    @admin.action(
        description="Requeue selected items (ready now, attempts kept)", permissions=["change"]
    )
    def requeue(self, request: HttpRequest, queryset: QuerySet[QueueItem]) -> None:
        selected, total = self._selection(queryset)
        census = self._census(selected)
        changed = selected.requeue()
        left_alone = {
            "running": census["running"],
            "already done": census["done"],
            "cancelled": census["cancelled"],
        }
        left_alone["held back by an unfinished item with the same dedup key"] = (
            total - changed - sum(left_alone.values())
        )
        headline = f"Requeued {changed} of {plural(total, 'selected item')}"
        self._report(request, headline, total - changed, left_alone)

    @admin.action(description="Mark selected items failed", permissions=["change"])
    def mark_failed(self, request: HttpRequest, queryset: QuerySet[QueueItem]) -> None:
        selected, total = self._selection(queryset)
        census = self._census(selected)
        changed = selected.mark_failed(f"marked failed in the admin by {request.user}")
        left_alone = {
            "running": census["running"],
            "already finished": census["done"] + census["failed"] + census["cancelled"],
        }
        headline = f"Marked {changed} of {plural(total, 'selected item')} failed"
        self._report(request, headline, total - changed, left_alone)

    @admin.action(description="Cancel selected items", permissions=["change"])
    def cancel(self, request: HttpRequest, queryset: QuerySet[QueueItem]) -> None:
        """READY items end CANCELLED; running ones are asked to stop (``QueueItem.cancel``)."""
        selected, total = self._selection(queryset)
        census = self._census(selected)
        changed = selected.cancel()
        left_alone = {
            "already finished": census["done"] + census["failed"] + census["cancelled"],
            "asked to stop before": census["asked"],
        }
        headline = f"Cancelled {changed} of {plural(total, 'selected item')}"
        if census["in_progress"] - census["asked"] > 0:
            headline += " (running ones are asked to stop, and end cancelled when they do)"
        self._report(request, headline, total - changed, left_alone)

    def _selection(self, queryset: QuerySet[QueueItem]) -> tuple[QueueItemQuerySet, int]:
        """The selected rows as a plain QueueItem queryset (no annotation), and how many."""
        pks = list(queryset.values_list("pk", flat=True))
        return QueueItem.objects.filter(pk__in=pks), len(pks)

    def _census(self, selected: QuerySet[QueueItem]) -> dict[str, int]:
        """How many of the selection run under a live consumer, and how many are finished:
        the reasons an action leaves items alone. Read before the action, in one query."""
        counts = selected.aggregate(
            in_progress=Count("pk", filter=Q(status=Status.IN_PROGRESS)),
            stuck=Count("pk", filter=stuck_condition()),
            done=Count("pk", filter=Q(status=Status.DONE)),
            failed=Count("pk", filter=Q(status=Status.FAILED)),
            cancelled=Count("pk", filter=Q(status=Status.CANCELLED)),
            asked=Count(
                "pk",
                filter=Q(status=Status.IN_PROGRESS, cancel_requested_at__isnull=False),
            ),
        )
        return {**counts, "running": counts["in_progress"] - counts["stuck"]}

    def _report(
        self, request: HttpRequest, headline: str, left: int, reasons: dict[str, int]
    ) -> None:
        """Says, e.g., "Requeued 3 of 5 selected items; 2 were left alone (2 running).\""""
        if left <= 0:
            self.message_user(request, f"{headline}.", messages.SUCCESS)
            return
        why = ", ".join(f"{count} {reason}" for reason, count in reasons.items() if count > 0)
        verb = "was" if left == 1 else "were"
        message = f"{headline}; {left} {verb} left alone ({why})."
        self.message_user(request, message, messages.WARNING)


@admin.register(Consumer)
class ConsumerAdmin(ConsumerModelAdmin):
    list_display = (
        "identity",
        "state",
        "host",
        "os_pid",
        "queues",
        "started_at",
        "last_heartbeat_at",
        "processed",
        "failed",
        "in_flight",
    )
    ordering = ("-started_at",)
    search_fields = ("identity", "host")
    readonly_fields = (
        "identity",
        "state",
        "host",
        "os_pid",
        "queues",
        "wakeup_address",
        "started_at",
        "last_heartbeat_at",
        "stopped_at",
        "processed",
        "failed",
        "in_flight",
    )
    fields = readonly_fields

    def get_queryset(self, request: HttpRequest) -> QuerySet[Consumer]:
        # Both per-row facts come from subqueries in the one page query: no N+1.
        in_flight = (
            QueueItem.objects.filter(status=Status.IN_PROGRESS, pid=OuterRef("identity"))
            .order_by()
            .values("pid")
            .annotate(count=Count("pk"))
            .values("count")
        )
        dead = Consumer.objects.dead().filter(pk=OuterRef("pk"))
        return (
            super()
            .get_queryset(request)
            .annotate(
                is_dead=Exists(dead, output_field=BooleanField()),
                in_flight_count=Coalesce(Subquery(in_flight), 0, output_field=IntegerField()),
            )
        )

    @admin.display(description="state")
    def state(self, consumer: Consumer) -> SafeString:
        if consumer.stopped_at is not None:
            return dot("#6b7280", "stopped")
        if getattr(consumer, "is_dead", False):
            return dot(STATUS_COLOURS[Status.FAILED], "dead")
        return dot(STATUS_COLOURS[Status.DONE], "live")

    @admin.display(description="in flight", ordering="in_flight_count")
    def in_flight(self, consumer: Consumer) -> SafeString:
        count = getattr(consumer, "in_flight_count", 0)
        query = urlencode(
            {"pid": consumer.identity, "status__exact": str(Status.IN_PROGRESS.value)}
        )
        url = reverse("admin:django_txqueue_queueitem_changelist") + "?" + query
        return format_html('<a href="{}">{}</a>', url, count)

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # consumers register themselves

    def has_change_permission(self, request: HttpRequest, obj: Consumer | None = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Consumer | None = None) -> bool:
        return False


@admin.register(Dashboard)
class DashboardAdmin(DashboardModelAdmin):
    """One page, no rows of its own: every queue's counts, consumers and throughput. It
    needs QueueItem's view (or change) permission, like the item pages."""

    refresh_seconds = 5

    def get_urls(self) -> list[URLPattern]:
        # The changelist's name, so that the app index and the sidebar link to it.
        view = self.admin_site.admin_view(self.dashboard_view)
        control = self.admin_site.admin_view(self.pause_view)
        return [
            path("", view, name="django_txqueue_dashboard_changelist"),
            path("pause/", control, name="django_txqueue_dashboard_pause"),
        ]

    def pause_view(self, request: HttpRequest) -> HttpResponse:
        """POST (QueueItem's change permission): pause or resume one queue, as
        ``txqueue_pause`` and ``txqueue_resume`` do, and say so."""
        if request.method != "POST":
            return HttpResponseRedirect(reverse("admin:django_txqueue_dashboard_changelist"))
        if not may(request, "change"):
            raise PermissionDenied
        name, database = request.POST.get("queue", ""), request.POST.get("database", "")
        if database not in queue_databases():  # "" when the dashboard shows one database
            database = ""
        try:
            queue = Queue(name, using=database or None)
        except (TypeError, ValueError) as exc:
            self.message_user(request, str(exc), messages.ERROR)
        else:
            if request.POST.get("action") == "resume":
                done = queue.resume()
                said = "resumed" if done else "was not paused"
            else:
                done = queue.pause()
                said = "paused: consumers claim none of its items" if done else "was paused"
            self.message_user(request, f"Queue {name!r} {said}.", messages.SUCCESS)
        return HttpResponseRedirect(reverse("admin:django_txqueue_dashboard_changelist"))

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        """The page, or with ``?fragment=1`` only its live part, which the page re-reads
        every ``refresh_seconds``."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        # Every database queues are placed on (the item pages read the router's).
        aliases = queue_databases()
        shown = overview_of(aliases, {alias: configured_queues(alias) for alias in aliases})
        context = {
            **self.admin_site.each_context(request),
            "opts": self.opts,
            "title": "Queue dashboard",
            "breadcrumbs": breadcrumbs(self.opts),
            "overview": shown,
            "chart": throughput_chart(shown.minutes),
            "can_pause": may(request, "change"),
            "refresh_ms": self.refresh_seconds * 1000,
        }
        if not request.GET.get("fragment"):  # the periodic items: on the page, not re-read
            context["schedule"] = schedule.overview(schedule.every_entry())
        if request.GET.get("fragment"):
            template = "admin/django_txqueue/dashboard/live.html"
        else:
            template = "admin/django_txqueue/dashboard/dashboard.html"
        return TemplateResponse(request, template, context)

    def has_view_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return may(request, "view") or may(request, "change")

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


class ScheduleForm(ScheduleModelForm):
    """The model's checks (``Schedule.clean``), and a TASK's, which loads the task."""

    class Meta:
        model = Schedule
        fields = "__all__"

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        if data.get("task"):
            options = {
                "TASK": data["task"],
                "ARGS": data.get("args"),
                "KWARGS": data.get("kwargs"),
            }
            for problem in schedule_task_problems(options):
                self.add_error("task", problem)
        return data


@admin.register(Schedule)
class ScheduleAdmin(ScheduleModelAdmin):
    """The entries kept in the database: saved rows reach the consumers on their next
    look. The changelist shows ``TXQUEUE["SCHEDULE"]``'s entries too, read-only."""

    form = ScheduleForm
    list_display = ("name", "enqueues", "timing", "enabled", "last_run", "next_run")
    list_filter = ("enabled", "catch_up")
    search_fields = ("name", "queue", "task")
    ordering = ("name",)
    actions = ("run_now", "enable", "disable", "delete_selected")
    readonly_fields = ("created_at", "updated_at")
    fieldsets = (
        (None, {"fields": ("name", "enabled")}),
        (
            "What it enqueues: a queue's item, or a task",
            {"fields": ("queue", "payload", "priority", "key", "task", "args", "kwargs")},
        ),
        ("When: a cron expression or an interval", {"fields": ("cron", "every", "catch_up")}),
        ("Record", {"fields": ("created_at", "updated_at")}),
    )
    change_list_template = "admin/django_txqueue/schedule/change_list.html"

    def get_changelist_instance(self, request: HttpRequest) -> Any:
        # The page's last and next runs: one query per database the entries go to.
        changelist = super().get_changelist_instance(request)
        rows = list(changelist.result_list)
        runs = {
            run.name: run for run in schedule.overview([schedule.Entry.of_row(r) for r in rows])
        }
        for row in rows:
            row.runs = runs[row.name]
        changelist.result_list = rows
        return changelist

    def changelist_view(
        self, request: HttpRequest, extra_context: dict[str, Any] | None = None
    ) -> HttpResponse:
        context = {**(extra_context or {}), "schedule": schedule.overview()}
        return super().changelist_view(request, context)

    @admin.display(description="enqueues")
    def enqueues(self, row: Schedule) -> str:
        return f"queue {row.queue}" if row.queue else f"task {row.task}"

    @admin.display(description="schedule")
    def timing(self, row: Schedule) -> str:
        return schedule.Entry.of_row(row).timing()

    @admin.display(description="last run")
    def last_run(self, row: Schedule) -> Any:
        runs = getattr(row, "runs", None)
        return runs.last_run if runs and runs.last_run else "never"

    @admin.display(description="next run")
    def next_run(self, row: Schedule) -> Any:
        runs = getattr(row, "runs", None)
        if not row.enabled:
            return "– (disabled)"
        return runs.next_run if runs and runs.next_run else "–"

    @admin.action(description="Run selected entries now (one item each)", permissions=["change"])
    def run_now(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        for row in queryset.order_by("name"):
            try:
                pk = schedule.run_now(row)
            except Exception as exc:  # a task that does not load, a queue that refuses
                self.message_user(request, f"{row.name}: not enqueued: {exc}", messages.ERROR)
                continue
            self.message_user(request, f"{row.name}: enqueued item {pk}.")

    @admin.action(description="Enable selected entries", permissions=["change"])
    def enable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        count = queryset.update(enabled=True, updated_at=timezone.now())
        self.message_user(request, f"{counted(count, 'entry', 'entries')} enabled.")

    @admin.action(description="Disable selected entries", permissions=["change"])
    def disable(self, request: HttpRequest, queryset: QuerySet[Schedule]) -> None:
        count = queryset.update(enabled=False, updated_at=timezone.now())
        self.message_user(request, f"{counted(count, 'entry', 'entries')} disabled.")
