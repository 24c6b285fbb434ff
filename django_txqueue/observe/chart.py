"""The dashboard's throughput chart: an SVG of the last hour's minutes, escaped as the
admin renders it (``format_html``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

if TYPE_CHECKING:
    from .reads import Minute

WIDTH, HEIGHT, BAR = 600, 120, 10  # viewBox units: 60 bars 10 wide, 8 drawn
DONE_COLOUR, FAILED_COLOUR = "#16a34a", "#dc2626"


def throughput_chart(minutes: list[Minute]) -> SafeString:
    """Stacked bars, done under failed, one per minute, scaled to the busiest minute; each
    bar's tooltip gives its numbers, and the figure has a text alternative."""
    peak = max((m.done + m.failed for m in minutes), default=0)
    scale = HEIGHT / (peak or 1)
    bars = []
    for i, minute in enumerate(minutes):
        done, failed = minute.done * scale, minute.failed * scale
        x = i * BAR + 1
        bars.append(
            (
                f"{minute.start:%H:%M} UTC: {minute.done} done, {minute.failed} failed",
                x,
                f"{HEIGHT - done:.1f}",
                f"{done:.1f}",
                DONE_COLOUR,
                x,
                f"{HEIGHT - done - failed:.1f}",
                f"{failed:.1f}",
                FAILED_COLOUR,
            )
        )
    body = format_html_join(
        "",
        '<g><title>{}</title><rect x="{}" y="{}" width="8" height="{}" fill="{}"/>'
        '<rect x="{}" y="{}" width="8" height="{}" fill="{}"/></g>',
        bars,
    )
    done = sum(m.done for m in minutes)
    failed = sum(m.failed for m in minutes)
    summary = (
        f"Throughput, last {len(minutes)} minutes: {done} done, {failed} failed; "
        f"busiest minute {peak}."
    )
    return format_html(
        '<svg id="throughput-chart" role="img" aria-label="{}" viewBox="0 0 {} {}" '
        'preserveAspectRatio="none" width="100%" height="{}">'
        '<line x1="0" y1="{}" x2="{}" y2="{}" stroke="#9ca3af"/>{}</svg>',
        summary,
        WIDTH,
        HEIGHT,
        HEIGHT,
        HEIGHT,
        WIDTH,
        HEIGHT,
        body,
    )
