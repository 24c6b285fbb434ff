"""A flow's picture for the admin: its items as boxes in columns by how many steps come
before them, coloured by status, and its edges as lines; an SVG escaped as the admin
renders it (``format_html``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString

BOX_W, BOX_H, GAP_X, GAP_Y = 150, 34, 60, 14  # SVG units
# A flow of more items is listed, not drawn: the picture would not be read.
MOST_DRAWN = 300


def depths(pks: Sequence[Any], parents: Mapping[Any, Sequence[Any]]) -> dict[Any, int]:
    """Each item's column: 0 for one that waits for nothing in the flow, else one more than
    the deepest item it waits for. ``pks`` in enqueue order (a parent is always older)."""
    depth: dict[Any, int] = {}
    for pk in pks:
        waited = [depth[p] for p in parents.get(pk, ()) if p in depth]
        depth[pk] = max(waited) + 1 if waited else 0
    return depth


def flow_chart(
    items: Sequence[tuple[Any, str, str, str]], parents: Mapping[Any, Sequence[Any]]
) -> SafeString:
    """``items``: (pk, queue, status label, colour), in enqueue order; ``parents``: {pk:
    the pks it waits for}. Each box's tooltip names its item; the figure has a text
    alternative."""
    depth = depths([pk for pk, *_ in items], parents)
    rows: dict[int, int] = {}
    place: dict[Any, tuple[int, int]] = {}
    for pk, *_ in items:
        column = depth[pk]
        rows[column] = rows.get(column, -1) + 1
        place[pk] = (column * (BOX_W + GAP_X) + 1, rows[column] * (BOX_H + GAP_Y) + 1)
    width = (max(depth.values(), default=0) + 1) * (BOX_W + GAP_X)
    height = (max(rows.values(), default=0) + 1) * (BOX_H + GAP_Y)
    lines = format_html_join(
        "",
        '<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="#9ca3af" marker-end="url(#arrow)"/>',
        (
            (px + BOX_W, py + BOX_H // 2, x, y + BOX_H // 2)
            for pk, (x, y) in place.items()
            for parent in parents.get(pk, ())
            if parent in place
            for px, py in [place[parent]]
        ),
    )
    boxes = format_html_join(
        "",
        '<g class="flow-item" data-item="{}"><title>#{} {}: {}</title>'
        '<rect x="{}" y="{}" width="{}" height="{}" rx="4" fill="{}"/>'
        '<text x="{}" y="{}" fill="#fff" font-size="12">{} #{}</text></g>',
        (
            (pk, pk, queue, label, *place[pk], BOX_W, BOX_H, colour)
            + (place[pk][0] + 6, place[pk][1] + 21, queue[:16], pk)
            for pk, queue, label, colour in items
        ),
    )
    summary = f"A flow of {len(items)} items in {max(depth.values(), default=0) + 1} columns."
    return format_html(
        '<svg id="flow-chart" role="img" aria-label="{}" viewBox="0 0 {} {}" width="{}">'
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#9ca3af"/></marker>'
        "</defs>{}{}</svg>",
        summary,
        width,
        height,
        width,
        lines,
        boxes,
    )
