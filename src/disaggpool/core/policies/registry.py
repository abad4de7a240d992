"""Policy names -> constructors: the only list of built-in policies, and the switches on them.

`make_policy("uncalibrated", datasheet=...)` needs the datasheet profile of each instance, since
that policy is the calibrated scorer fed constants derived from datasheets instead of measurements.
`PolicyOptions` holds the switches every router exposes the same way (the simulator's scenario
and paper runs, the sidecar's config, the `DisaggPool` CRD): each is off by default.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Literal, get_args

from disaggpool.core.policies.base import Policy
from disaggpool.core.policies.baselines import (
    LeastLoaded,
    LengthHeuristic,
    PowerOfTwo,
    RandomChoice,
    RoundRobin,
)
from disaggpool.core.policies.calibrated import CalibratedPolicy
from disaggpool.core.policies.deciders import ThresholdDecider
from disaggpool.core.policies.prefix_baselines import CacheAware, DynamoKv, LlmdWeighted
from disaggpool.core.policies.study import StudyWeightedPolicy
from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "CALIBRATED_FAMILY",
    "DECODE_BINDINGS",
    "DEFAULT_DECODE_BINDING",
    "NEEDS_DATASHEET",
    "NEEDS_PREFIX_INDEX",
    "POLICY_NAMES",
    "ROUTER_POLICIES",
    "DecodeBinding",
    "PolicyOptions",
    "default_options",
    "make_policy",
]

Datasheet = Mapping[str, CalibrationProfile]

#: When a router that runs both legs chooses the decode pod: with the prefill pod on arrival, or
#: when the prefill leg answers (`late`), on what the pool looks like then. Every router's
#: default (the sidecar's config, the CRD, the simulator's scenarios) is `late`.
DecodeBinding = Literal["arrival", "late"]
DECODE_BINDINGS: tuple[DecodeBinding, ...] = get_args(DecodeBinding)
DEFAULT_DECODE_BINDING: DecodeBinding = "late"


@dataclasses.dataclass(frozen=True, slots=True)
class PolicyOptions:
    """Switches on top of a named policy (all off by default).

    `pd_decider` (calibrated policies only): price, for every request, prefilling it on a decode
    instance instead of the prefill pool, and take that path when it breaks fewer SLOs.
    `local_prefill_below` (any policy): prompts shorter than this many tokens always skip the
    prefill pool (a fixed-threshold decider, as llm-d's and Dynamo's simplest form); 0 is off.
    `priority_scheduling` (calibrated policies only): the engines run vLLM's
    `--scheduling-policy priority`, and the policy asks for priority 1 for every request it
    predicts misses its TTFT target anyway, so the ones that can still make theirs pass it
    (`RouteDecision.priority`).
    """

    pd_decider: bool = False
    local_prefill_below: int = 0
    priority_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.local_prefill_below < 0:
            raise ValueError(f"local_prefill_below must be >= 0, got {self.local_prefill_below}")


def default_options(policy: str) -> PolicyOptions:
    """The switches a router runs `policy` with unless told otherwise: the P/D decider is on for
    the calibrated policies (where they earn most: `sim paper`'s ablation), everything else off.
    The sidecar's config, the CRD, scenario files and the demo all default to this."""
    return PolicyOptions(pd_decider=policy in CALIBRATED_FAMILY)


Factory = Callable[[Datasheet | None, PolicyOptions], Policy]

_FACTORIES: dict[str, Factory] = {
    "round_robin": lambda _, o: RoundRobin(),
    "random": lambda _, o: RandomChoice(),
    "least_loaded": lambda _, o: LeastLoaded(),
    "length": lambda _, o: LengthHeuristic(),
    "p2c": lambda _, o: PowerOfTwo(),
    "calibrated": lambda _, o: CalibratedPolicy(
        pd_decider=o.pd_decider, priority_scheduling=o.priority_scheduling
    ),
    "calibrated_greedy": lambda _, o: CalibratedPolicy(
        "calibrated_greedy",
        guard_slack=None,
        pd_decider=o.pd_decider,
        priority_scheduling=o.priority_scheduling,
    ),
    "uncalibrated": lambda ds, o: CalibratedPolicy(
        "uncalibrated",
        profiles=_require(ds),
        pd_decider=o.pd_decider,
        priority_scheduling=o.priority_scheduling,
    ),
    "study_weighted": lambda _, o: StudyWeightedPolicy(),
    "study_weighted_datasheet": lambda ds, o: StudyWeightedPolicy(
        "study_weighted_datasheet", profiles=_require(ds)
    ),
    "cache_aware": lambda _, o: CacheAware(),
    "dynamo_kv": lambda _, o: DynamoKv(),
    "llmd_weighted": lambda _, o: LlmdWeighted(),
}

#: The policies `PolicyOptions.pd_decider` and `.priority_scheduling` apply to.
CALIBRATED_FAMILY: frozenset[str] = frozenset({"calibrated", "calibrated_greedy", "uncalibrated"})

POLICY_NAMES: tuple[str, ...] = tuple(_FACTORIES)


#: Policies that score with datasheet constants (they need `datasheet=`).
NEEDS_DATASHEET: frozenset[str] = frozenset({"uncalibrated", "study_weighted_datasheet"})

#: Policies that are only prefix-cache rules: without a router that keeps a prefix index (the
#: simulator's `RouterOptions.prefix_index`, the sidecar's `prefix_index`) they reduce to load
#: counting, so every router refuses them with the index off.
NEEDS_PREFIX_INDEX: frozenset[str] = frozenset({"cache_aware", "dynamo_kv", "llmd_weighted"})

#: What a deployed router (the sidecar, the CRD) can run.
ROUTER_POLICIES: tuple[str, ...] = tuple(p for p in _FACTORIES if p not in NEEDS_DATASHEET)


def _require(datasheet: Datasheet | None) -> Datasheet:
    if datasheet is None:
        raise ValueError("the datasheet policies need datasheet profiles for every instance")
    return datasheet


def make_policy(
    name: str,
    *,
    datasheet: Datasheet | None = None,
    options: PolicyOptions = PolicyOptions(),
) -> Policy:
    """A fresh policy instance; raises KeyError naming the valid policies for an unknown name,
    ValueError for a switch the policy does not have."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise KeyError(f"unknown policy {name!r}; valid: {', '.join(POLICY_NAMES)}") from None
    if options.pd_decider and name not in CALIBRATED_FAMILY:
        raise ValueError(f"pd_decider prices in seconds: only for {sorted(CALIBRATED_FAMILY)}")
    if options.priority_scheduling and name not in CALIBRATED_FAMILY:
        raise ValueError(
            f"priority_scheduling needs a predicted TTFT: only for {sorted(CALIBRATED_FAMILY)}"
        )
    policy = factory(datasheet, options)
    if options.local_prefill_below:
        return ThresholdDecider(policy, options.local_prefill_below)
    return policy
