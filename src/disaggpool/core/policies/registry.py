"""Policy names -> constructors: the only list of built-in policies.

`make_policy("uncalibrated", datasheet=...)` needs the datasheet profile of each instance, since
that policy is the calibrated scorer fed constants derived from datasheets instead of measurements.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from disaggpool.core.policies.base import Policy
from disaggpool.core.policies.baselines import (
    LeastLoaded,
    LengthHeuristic,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
)
from disaggpool.core.policies.calibrated import CalibratedPolicy
from disaggpool.core.profile import CalibrationProfile

__all__ = ["POLICY_NAMES", "make_policy"]

Datasheet = Mapping[str, CalibrationProfile]

_FACTORIES: dict[str, Callable[[Datasheet | None], Policy]] = {
    "round_robin": lambda _: RoundRobin(),
    "random": lambda _: RandomChoice(),
    "least_loaded": lambda _: LeastLoaded(),
    "length": lambda _: LengthHeuristic(),
    "p2c": lambda _: PowerOfTwo(),
    "calibrated": lambda _: CalibratedPolicy(),
    "calibrated_greedy": lambda _: CalibratedPolicy("calibrated_greedy", guard_slack=None),
    "uncalibrated": lambda ds: CalibratedPolicy("uncalibrated", profiles=_require(ds)),
}

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


def _require(datasheet: Datasheet | None) -> Datasheet:
    if datasheet is None:
        raise ValueError("the uncalibrated policy needs datasheet profiles for every instance")
    return datasheet


def make_policy(name: str, *, datasheet: Datasheet | None = None) -> Policy:
    """A fresh policy instance; raises KeyError naming the valid policies for an unknown name."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    return factory(datasheet)
