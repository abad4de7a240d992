"""Typed contracts shared by the scorer, the simulator and the sidecar.

* `SLOClass`: a request class with its TTFT and TPOT targets.
* `RequestFeatures`: what the router knows about one request when it routes it.
* `InstanceSnapshot` / `PoolSnapshot`: what the router knows about each instance at that moment:
  scraped engine gauges (running, waiting, KV tokens in use) plus its own accounting of the
  requests it sent there and has not seen finish.
* `RouteDecision`: the chosen (prefill, decode) pair with the predictions that justified it.

All are frozen, slotted dataclasses: cheap to build on the hot path and safe to share.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "NO_BUDGETS",
    "Fallback",
    "InstanceSnapshot",
    "PoolSnapshot",
    "RequestFeatures",
    "Role",
    "RouteDecision",
    "SLOClass",
    "TpotBudgets",
]

Role = Literal["prefill", "decode"]
Fallback = Literal["median-profile", "least-loaded"]


@dataclasses.dataclass(frozen=True, slots=True)
class SLOClass:
    """A request class: a request meets its SLO when TTFT <= ttft_s and TPOT <= tpot_s.

    `sheddable`: a request of this class that the router predicts cannot meet its SLO without
    breaking another's is refused at once (the sidecar answers 429) instead of being served late;
    it still counts as missed, and the capacity it would have taken goes to requests that can
    make it. Only the calibrated policies shed (they price every instance).
    """

    name: str
    ttft_s: float
    tpot_s: float
    sheddable: bool = False

    def met(self, ttft: float, tpot: float) -> bool:
        return ttft <= self.ttft_s and tpot <= self.tpot_s


@dataclasses.dataclass(frozen=True, slots=True)
class RequestFeatures:
    """One request as the router sees it: exact prompt length, predicted output, SLO class, and
    `prefix_hits`: instance name -> prompt tokens the router believes that instance has cached
    (its prefix index; instances not named have none)."""

    request_id: str
    prompt_tokens: int
    predicted_output_tokens: float
    output_uncertainty: float
    slo: SLOClass
    prefix_hits: Mapping[str, int] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True, slots=True)
class TpotBudgets:
    """In-flight requests by the time per remaining output token each can afford and still meet
    its TPOT target: ``seconds`` in increasing order, with each group's predicted remaining
    tokens (``tokens``) and request count; ``cumulative[i]`` counts the requests of groups 0..i-1,
    so the scorer counts the requests in a range of budgets with two bisections."""

    seconds: tuple[float, ...] = ()
    tokens: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    cumulative: tuple[int, ...] = (0,)

    @classmethod
    def of(cls, groups: Iterable[tuple[float, int, int]]) -> TpotBudgets:
        """From ``(seconds, remaining tokens, count)`` groups in any order."""
        ordered = sorted(groups)
        cumulative = [0]
        for _, _, count in ordered:
            cumulative.append(cumulative[-1] + count)
        return cls(
            tuple(g[0] for g in ordered),
            tuple(g[1] for g in ordered),
            tuple(g[2] for g in ordered),
            tuple(cumulative),
        )

    @classmethod
    def of_counts(cls, counts: Mapping[tuple[float, int], int]) -> TpotBudgets:
        """From ``{(seconds, remaining tokens): count}``: the same as `of` on its items, built
        without their triples (the ledger's hot path; keys are distinct, so sorting them sorts
        the groups)."""
        if not counts:
            return cls()
        keys = sorted(counts)
        n = tuple(map(counts.__getitem__, keys))
        seconds, tokens = zip(*keys, strict=True)
        return cls(seconds, tokens, n, (0, *itertools.accumulate(n)))

    def __bool__(self) -> bool:
        return bool(self.seconds)

    def between(self, low: float, high: float) -> int:
        """Requests whose budget lies in [low, high)."""
        i = bisect.bisect_left(self.seconds, low)
        j = bisect.bisect_left(self.seconds, high, i)
        return self.cumulative[j] - self.cumulative[i] if j > i else 0

    def groups(self) -> list[tuple[float, int, int]]:
        return list(zip(self.seconds, self.tokens, self.counts, strict=True))


NO_BUDGETS = TpotBudgets()


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceSnapshot:
    """One instance at decision time.

    Scraped from the engine: `running`, `waiting`, `kv_tokens_used`.
    The router's own accounting of requests it sent here and has not seen finish:
    `inflight` (all stages), `queued` and `queued_tokens` (not yet started here: for a prefill
    instance not yet prefilled, for a decode instance not yet decoding), `queued_sq_tokens`
    (sum of squared prompt lengths of the queued ones), `remaining_output_tokens` (sum of their
    predicted remaining output tokens) and `tpot_budgets` (`TpotBudgets`): for the in-flight
    requests, the time per remaining output token each can still afford and meet its TPOT target,
    with its predicted remaining tokens, so the scorer can tell whom a slowdown or a stall pushes
    over. A request not decoding yet affords its target; one that has been slowed affords less
    (`core.ledger` says how they are grouped).
    `local_prefill_tokens` / `local_prefill_sq_tokens` (decode instances): prompt tokens (and their
    squares) of the requests routed there to be prefilled *on the decode instance itself* (the
    P/D decider's local path) that have not started decoding.
    `yielded_tokens` / `yielded_sq_tokens` (prefill instances): the part of `queued_tokens` /
    `queued_sq_tokens` routed with a priority above 0 (`RouteDecision.priority`): work that a
    priority-0 request passes on an engine scheduling by priority.
    `ttft_slack_s` (decode instances): for each request routed there that has not started
    decoding, the seconds left until its first token is due (negative when already late), in
    increasing order: a stall of S seconds there now breaks those with slack in [0, S).
    `foreign`: requests the last scrape showed there beyond the router's own the instance held at
    that moment: another client's or router replica's (`core.ledger` says how it is counted).
    `profile` is the calibration profile the router believes for this instance, or None.
    """

    name: str
    role: Role
    running: int = 0
    waiting: int = 0
    kv_tokens_used: int = 0
    inflight: int = 0
    queued: int = 0
    queued_tokens: int = 0
    queued_sq_tokens: float = 0.0
    yielded_tokens: int = 0
    yielded_sq_tokens: float = 0.0
    remaining_output_tokens: float = 0.0
    tpot_budgets: TpotBudgets = NO_BUDGETS
    local_prefill_tokens: int = 0
    local_prefill_sq_tokens: float = 0.0
    ttft_slack_s: tuple[float, ...] = ()
    foreign: int = 0
    healthy: bool = True
    profile: CalibrationProfile | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """All instances of one pool at time `now` (seconds, any epoch).

    `unbound_kv_tokens`: the decode KV that requests routed to the prefill pool without a decode
    instance yet (late binding) will claim when their prefill leg answers: their prompt tokens
    plus predicted output tokens, from the router's ledger. No decode instance's view counts it.
    """

    now: float
    prefill: Sequence[InstanceSnapshot]
    decode: Sequence[InstanceSnapshot]
    unbound_kv_tokens: float = 0.0


@dataclasses.dataclass(frozen=True, slots=True)
class RouteDecision:
    """Where one request goes and what the scorer expected to happen there.

    `prefill` is None when the decode instance prefills the prompt itself (the P/D decider chose
    the local path: no prefill leg, no KV transfer).
    `policy` is the name of the policy that decided, whatever it fell back on. `fallback` says
    what it fell back on when it could not score every instance with a trusted profile: None (it
    did not), ``"median-profile"`` (an instance without one was scored with its pool's median
    trusted profile) or ``"least-loaded"`` (no trusted profile at all: counted in-flight requests).
    `slo_feasible` is None when the policy did not evaluate the SLO, False when the scorer found no
    instance on which the class target can be met (the request was then placed to protect
    others), True otherwise. `guarded` says the scarcity guard overrode the cheapest instance.
    `shed`: the request's class is sheddable and the placement breaking the fewest SLOs still
    misses its own: the router refuses it rather than serve it late (only a policy that priced
    every instance says so).
    `priority`: what to ask the engines for (vLLM's `priority`, lower runs first, on engines
    started with `--scheduling-policy priority`): 1 when the policy predicts the request misses
    its TTFT target wherever it goes, so that requests which can still make theirs go first;
    0 otherwise, and always 0 unless the router runs with `priority_scheduling`.
    """

    prefill: str | None
    decode: str
    policy: str
    predicted_ttft_s: float | None = None
    predicted_tpot_s: float | None = None
    slo_feasible: bool | None = None
    guarded: bool = False
    fallback: Fallback | None = None
    shed: bool = False
    priority: int = 0
