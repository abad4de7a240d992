"""`sim.placement`: every assignment of boards to the two roles, and the choice among them."""

from __future__ import annotations

import pytest

from disaggpool.sim.placement import best_placement, describe, placements


def test_every_distinct_assignment_once_fewest_prefill_boards_first() -> None:
    options = placements((1.0, 1.0, 0.55, 1.25))
    assert options == [
        ((1.0,), (1.0, 0.55, 1.25)),
        ((0.55,), (1.0, 1.0, 1.25)),
        ((1.25,), (1.0, 1.0, 0.55)),
        ((1.0, 1.0), (0.55, 1.25)),
        ((1.0, 0.55), (1.0, 1.25)),
        ((1.0, 1.25), (1.0, 0.55)),
        ((0.55, 1.25), (1.0, 1.0)),
        ((1.0, 1.0, 0.55), (1.25,)),
        ((1.0, 1.0, 1.25), (0.55,)),
        ((1.0, 0.55, 1.25), (1.0,)),
    ]
    # boards of one speed: only the split count is left to choose (the paper run's case)
    assert placements((1.0,) * 4) == [((1.0,) * p, (1.0,) * (4 - p)) for p in (1, 2, 3)]


@pytest.mark.parametrize("boards", [(), (1.0,), (1.0, 0.0), (1.0, -2.0)])
def test_placements_refuse_what_is_not_a_pool(boards: tuple[float, ...]) -> None:
    with pytest.raises(ValueError):
        placements(boards)


def test_the_most_traffic_wins_and_a_tie_goes_to_more_decode_boards() -> None:
    options = placements((1.0, 1.0, 1.0))  # 1P+2D, 2P+1D
    assert best_placement(options, [2.0, 3.0]) == 1
    assert best_placement(options, [3.0, 2.0]) == 0
    assert best_placement(options, [3.0, 3.0]) == 0  # more decode boards
    assert best_placement(options, [3.0, 3.0 + 1e-9]) == 0  # within a micro-request per second
    with pytest.raises(ValueError):
        best_placement(options, [1.0])


def test_describe_names_the_boards_of_each_role() -> None:
    assert describe(((1.0, 1.0), (0.55, 1.25))) == "2P (1x, 1x) + 2D (0.55x, 1.25x)"
