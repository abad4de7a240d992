"""Which boards of a pool prefill and which decode: every assignment, and the one that carries most.

DistServe places instances by the goodput capacity each placement reaches, and so does `sim
paper` for its pool of one board type (`studies.paper_setup.placed`), where only the number of
prefill instances matters. When the boards run at different speeds, which board takes which
role matters as well: `placements` lists every distinct assignment of `boards` (at least one
board per role; boards of equal speed are interchangeable, so an assignment that only swaps them
is listed once), and `best_placement` picks the one whose rate at the operating point is
highest, ties going to more decode instances (the study's rule), then to the earlier listed.
The rates come from `sim.operating_point`; this module only enumerates and chooses. Pure; used
by `disaggpool demo`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

__all__ = ["Placement", "best_placement", "describe", "placements"]

Placement = tuple[tuple[float, ...], tuple[float, ...]]
"""(prefill boards' speeds, decode boards' speeds), each in the order `boards` lists them."""


def placements(boards: Sequence[float]) -> list[Placement]:
    """Every distinct assignment of `boards` to the two roles, fewest prefill boards first."""
    if len(boards) < 2:
        raise ValueError(f"a placement needs at least two boards, got {len(boards)}")
    if min(boards) <= 0:
        raise ValueError(f"board speeds must be positive, got {tuple(boards)}")
    seen: set[tuple[tuple[float, ...], tuple[float, ...]]] = set()
    out: list[Placement] = []
    for n_prefill in range(1, len(boards)):
        for chosen in itertools.combinations(range(len(boards)), n_prefill):
            prefill = tuple(boards[i] for i in chosen)
            decode = tuple(b for i, b in enumerate(boards) if i not in chosen)
            key = (tuple(sorted(prefill)), tuple(sorted(decode)))
            if key not in seen:
                seen.add(key)
                out.append((prefill, decode))
    return out


def best_placement(options: Sequence[Placement], rates: Sequence[float]) -> int:
    """The index of the placement with the highest rate; ties (to a micro-request per second) go
    to more decode boards, then to the one listed first."""
    if not options or len(options) != len(rates):
        raise ValueError(f"{len(options)} placements but {len(rates)} rates")
    return max(range(len(options)), key=lambda i: (round(rates[i], 6), len(options[i][1]), -i))


def describe(placement: Placement) -> str:
    """``2P (1.0x, 1.0x) + 2D (0.55x, 1.25x)``."""
    prefill, decode = placement
    return (
        f"{len(prefill)}P ({', '.join(f'{s:g}x' for s in prefill)}) + "
        f"{len(decode)}D ({', '.join(f'{s:g}x' for s in decode)})"
    )
