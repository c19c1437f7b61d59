"""HTML for the console: every value escaped unless it is already :class:`Html`.

Pages are built from small functions here, never by pasting strings: :func:`h` escapes
whatever it is given (a message body, a header, an error text) so nothing read from a
broker or the database can become markup. :func:`show_body` limits a body to the page
limit and says when it cut it; :func:`mask_headers` hides secrets in header values.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any
from urllib.parse import urlencode

from mqdedup.masking import MASK, is_secret_parameter, mask_text

#: The most bytes of a message body shown on a page (``--body-limit``).
DEFAULT_BODY_LIMIT = 64 * 1024


class Html(str):
    """Markup that is already safe (built by these functions)."""

    __slots__ = ()


def h(value: Any) -> Html:
    """``value`` as safe markup: Html as is, anything else escaped (quotes too)."""
    if isinstance(value, Html):
        return value
    if value is None:
        return Html("")
    return Html(html.escape(str(value), quote=True))


def join(parts: Iterable[Any], separator: str = "") -> Html:
    """Escaped parts, joined."""
    return Html(separator.join(h(part) for part in parts))


def tag(element: str, /, *children: Any, **attributes: Any) -> Html:
    """``<name attr="…">children</name>``; attribute names end in ``_`` to dodge keywords."""
    attrs = "".join(
        f' {key.rstrip("_").replace("_", "-")}="{h(value)}"'
        for key, value in attributes.items()
        if value is not None and value is not False
    )
    if element in ("input", "br", "meta", "link"):
        return Html(f"<{element}{attrs}>")
    return Html(f"<{element}{attrs}>{join(children)}</{element}>")


def link(text: Any, path: str, **query: Any) -> Html:
    """A link to a console page with an escaped query string."""
    return tag("a", text, href=url(path, **query))


def url(path: str, **query: Any) -> str:
    """``path?query`` (None values left out)."""
    pairs = {k: v for k, v in query.items() if v is not None}
    return f"{path}?{urlencode(pairs)}" if pairs else path


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *, klass: str = "") -> Html:
    """A table; each cell escaped unless it is Html."""
    head = tag("tr", *(tag("th", name) for name in headers))
    body = [tag("tr", *(tag("td", cell) for cell in row)) for row in rows]
    if not body:
        return tag("p", "none", class_="empty")
    return tag("table", tag("thead", head), tag("tbody", *body), class_=klass or None)


def post_form(
    action: str,
    csrf: str,
    label: str,
    fields: Mapping[str, Any] | None = None,
    *,
    danger: bool = False,
) -> Html:
    """A form that POSTs ``fields`` and the session's CSRF token to ``action``."""
    hidden = [tag("input", type="hidden", name="csrf", value=csrf)]
    for name, value in (fields or {}).items():
        values = value if isinstance(value, list | tuple) else [value]
        hidden.extend(tag("input", type="hidden", name=name, value=v) for v in values)
    button = tag("button", label, type="submit", class_="danger" if danger else "primary")
    return tag("form", *hidden, button, method="post", action=action)


def when(moment: datetime | None) -> str:
    """A timestamp as ISO text (seconds), '-' for None."""
    return "-" if moment is None else moment.isoformat(timespec="seconds")


def age(seconds: float | None) -> str:
    """``3s``, ``4m 10s``, ``2h 5m``, ``3d 4h``; '-' for None."""
    if seconds is None:
        return "-"
    s = int(max(seconds, 0))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def as_json(value: Any) -> str:
    """A stored JSON value for display (indented)."""
    return json.dumps(value, indent=2, sort_keys=True, default=str, ensure_ascii=False)


def show_body(body: bytes, limit: int = DEFAULT_BODY_LIMIT) -> Html:
    """A message body as escaped text in a ``<pre>``, at most ``limit`` bytes of it.

    A longer body is cut and says so (its full size); bytes that are not UTF-8 are shown
    as replacement characters, with a note.
    """
    shown = body[:limit]
    text = shown.decode("utf-8", errors="replace")
    notes: list[Html] = []
    if len(body) > limit:
        notes.append(
            tag(
                "p",
                f"truncated: showing the first {limit:,} of {len(body):,} bytes",
                class_="truncated",
            )
        )
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < limit:  # the cut may split a character: only say so for real bytes
            notes.append(tag("p", "not UTF-8: undecodable bytes shown as \ufffd", class_="note"))
    return join([*notes, tag("pre", text, class_="body")])


def mask_headers(headers: Iterable[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Header values for display: secret-looking names' values as ``***``, URLs masked."""
    shown: list[tuple[str, str]] = []
    for name, value in headers:
        if isinstance(value, bytes | bytearray):
            text = bytes(value).decode("utf-8", errors="replace")
        else:
            text = "" if value is None else str(value)
        shown.append((str(name), MASK if is_secret_parameter(str(name)) else mask_text(text)))
    return shown


def page(
    title: str, body: Html, *, nav: Sequence[tuple[str, str]], current: str, note: str = ""
) -> Html:
    """The whole HTML document: head, navigation, ``body``."""
    links = [
        tag("a", label, href=path, class_="current" if path == current else None)
        for path, label in nav
    ]
    banner = tag("p", note, class_="banner") if note else Html("")
    return Html(
        "<!doctype html>"
        + tag(
            "html",
            tag(
                "head",
                tag("meta", charset="utf-8"),
                tag("title", f"{title} - mqdedup console"),
                tag("link", rel="stylesheet", href="/static/console.css"),
            ),
            tag(
                "body",
                tag("header", tag("strong", "mqdedup console"), tag("nav", *links)),
                banner,
                tag("main", tag("h1", title), body),
            ),
            lang="en",
        )
    )
