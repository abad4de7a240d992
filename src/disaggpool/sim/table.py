"""Plain-text tables of JSON rows, as the terminal shows simulation results.

One column per key (in first-seen order), floats to 4 decimals below 10 and 2 above. `disaggpool
sim run` prints its runs with it, and the paper study (`studies.paper_report`) its tables. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["render"]


def render(title: str, rows: Sequence[Mapping[str, Any]]) -> str:
    """`title`, then the rows under a header of their keys, and a blank line."""
    if not rows:
        return f"{title}\n  (no rows)\n\n"
    cols = list(dict.fromkeys(k for r in rows for k in r))
    widths = {c: max(len(c), *(len(_fmt(r.get(c, ""))) for r in rows)) for c in cols}
    lines = [title, "  " + "  ".join(c.ljust(widths[c]) for c in cols)]
    for r in rows:
        lines.append("  " + "  ".join(_fmt(r.get(c, "")).ljust(widths[c]) for c in cols))
    return "\n".join(lines) + "\n\n"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 10 else f"{v:.2f}"
    return str(v)
