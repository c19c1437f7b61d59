"""What the commands print: plain-text tables, ages and JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any


def render_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A left/right aligned text table (numbers right-aligned)."""
    cells = [[_text(value) for value in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]
    numeric = [
        all(isinstance(row[i], int | float) or row[i] is None for row in rows) and bool(rows)
        for i in range(len(headers))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if num else v.ljust(w)
            for v, w, num in zip(values, widths, numeric, strict=True)
        ).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out.extend(line(row) for row in cells)
    return "\n".join(out)


def _text(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def human_age(seconds: float | None) -> str:
    """``3.2s``, ``4m10s``, ``2h05m``, ``3d04h`` or ``-``."""
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, sec = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def print_json(data: Any) -> None:
    """``--json`` output: indented, keys sorted."""
    print(json.dumps(data, indent=2, sort_keys=True))
