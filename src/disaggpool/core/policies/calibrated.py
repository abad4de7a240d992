"""The calibrated policy: least additional completion time, within SLOs and a load bound.

For each request:

1. Prefill: the instance where the prompt is prefilled soonest (queue + own prefill time).
2. Decode: for every healthy decode instance, the cost model's additional completion time (ACT),
   predicted TTFT (including that prefill and the KV transfer) and TPOT.
3. Among instances allowed by the scarcity guard, the one with the fewest expected SLO
   violations wins, ties broken by ACT. The violations counted are the request's own (predicted
   TTFT or TPOT over its class target) plus those of the in-flight requests there whose TPOT
   budget (the time per remaining token they can still afford) lies between the step time
   without and with this request (they were on course and it would push them over), plus the
   chance that the KV cache runs out while it runs there (vLLM would preempt it). Goodput
   counts requests, so when a class cannot be met anywhere the request goes where it breaks
   nobody else's SLO: in a burst the overflow lands on an instance that is already late rather
   than spreading lateness over every instance. The decision then says `slo_feasible=False`.
4. With the P/D decider (`pd_decider`, on by default through `registry.default_options`): the
   same for every decode instance prefilling the prompt itself; that local path is taken when it
   causes fewer violations than step 3's choice and the decode pool has KV to spare beyond what
   the requests already routed will claim (COSTMODEL.md, "The local path").
5. Late binding (`route_decode`): steps 2-3 alone, when the prefill leg has returned.

In the terms of `core.policies.base` (filters, scorers, picker): the filter is the healthy pods,
each with the profile it is scored with (below); the prefill stage scores a pod by when the prompt
would be ready there and picks the soonest; the decode stage scores each (chosen prefill, decode)
pair by the lexicographic key (expected violations, ACT), the guard filters the scored pairs, and
the picker takes the least key, the first in pool order on a tie. The key is not a weighted sum:
no number of seconds of ACT is worth one SLO violation, so none is ever traded for the other.

**Scarcity guard (bounded load).** Greedy ACT minimisation trusts its estimates most exactly when
they are worst: when the pool is overloaded, every instance has a long admission queue, the queue
estimates are at their least accurate, and small differences steer a stream of requests onto one
instance. The guard caps each decode instance's in-flight count at ``(1 + slack)`` times its fair
share of all in-flight requests, the share weighted by its calibrated decode throughput. Under
light load the cap rarely binds and the cost model decides; under scarcity every instance sits
near its cap and the policy degenerates gracefully to capacity-weighted spreading, which is what
blind spreading does well. This is "consistent hashing with bounded loads" applied to cost
minimisation. `slack=None` disables it (the greedy variant, which shows the failure mode).

**Missing profiles.** An instance without a trusted profile is scored with the median trusted
profile of its pool, and the decision says ``fallback="median-profile"``; with no trusted profile
at all the policy routes least-loaded and says ``fallback="least-loaded"``. Never a silent default.
A profile is trusted when its fit is `good` or `fair`, every constant lies within the physical
bounds of `core.profile.BOUNDS` and the router has not distrusted it (`CalibrationProfile.trusted`,
computed once per profile). Scoring only with such profiles is what keeps every division here
defined and every estimate finite, whatever the profiles fed in: a decode step of at least 1 us
(the guard's weight divides by it), a chunk budget and a KV block of at least one token, a link
of at least 1 MB/s. Profiles given to the policy (`profiles=`) are scored as given unless a
constant is outside those bounds; such a pod then counts as one without a profile.

**Unmeasured KV transfer.** A decode profile probed without a prefill peer carries default KV
transfer constants, marked ``metadata.unmeasured: [kv_transfer]`` (PROFILES.md). Defaults are not
calibration: such a profile is scored with the median measured transfer model of its pool's
trusted decode profiles (`median_measured_transfer`), and keeps the defaults only when no pod
measured one. The median is taken over every decode pod, healthy or not: a link measured on a pod
that is briefly unreachable is still a measurement, and the stand-in does not flap with health.
The decision does not say so (its `fallback` is about whole profiles); the sidecar logs it.

`uncalibrated` is the same scorer fed fixed datasheet profiles instead of the calibrated ones.
"""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Iterable, Mapping, Sequence

from disaggpool.core import costmodel
from disaggpool.core.contracts import (
    InstanceSnapshot,
    PoolSnapshot,
    RequestFeatures,
    RouteDecision,
    SLOClass,
)
from disaggpool.core.policies.base import DecodeChoice, healthy
from disaggpool.core.policies.baselines import LeastLoaded
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel

__all__ = ["CalibratedPolicy", "median_measured_transfer"]

#: Reference batch for the throughput weight of the guard: 32 sequences of 1024 context tokens.
_REF_SEQS = 32
_REF_CONTEXT = 32 * 1024
#: Reference prompt that orders KV transfer models for their median.
_REF_PROMPT = 1024

#: A decode profile, the stand-in for its unmeasured KV transfer, and the profile with it.
_StandIn = tuple[CalibrationProfile, KVTransferModel, CalibrationProfile]


def _violations(est: costmodel.DecodeEstimate, slo: SLOClass) -> float:
    """SLO violations a placement is expected to cause: the request's own predicted miss, the
    in-flight requests it pushes over their TPOT budget, and the chance the KV cache runs out
    while it runs (vLLM preempts it: recomputed, it all but certainly misses its TPOT, and the
    recomputation stalls the others, so the chance counts even where its own miss is certain)."""
    own_miss = 0.0 if est.ttft_s <= slo.ttft_s and est.tpot_s <= slo.tpot_s else 1.0
    return est.slo_harm + own_miss + est.preempt_p


def _median_profile(instances: Sequence[InstanceSnapshot]) -> CalibrationProfile | None:
    trusted = sorted(
        (i.profile for i in instances if i.profile is not None and i.profile.trusted),
        key=lambda p: p.decode.step(_REF_SEQS, _REF_CONTEXT) + p.prefill.prompt_time(1024),
    )
    return trusted[len(trusted) // 2] if trusted else None


def median_measured_transfer(
    profiles: Iterable[CalibrationProfile | None],
) -> KVTransferModel | None:
    """The median of the measured KV transfer models of the trusted `profiles`, ordered by the
    time of a reference prompt (of an even count the upper one, as `_median_profile`); None when
    none was measured. A whole model, not a median per constant: k0 and bandwidth are fitted
    together and the pair is what one link does."""
    measured = sorted(
        (p.kv_transfer for p in profiles if p is not None and p.trusted and p.transfer_measured),
        key=lambda m: m.time(_REF_PROMPT),
    )
    return measured[len(measured) // 2] if measured else None


class CalibratedPolicy:
    """Cost-model routing (see module docstring). `profiles` overrides per-instance profiles."""

    def __init__(
        self,
        name: str = "calibrated",
        *,
        guard_slack: float | None = 0.5,
        profiles: Mapping[str, CalibrationProfile] | None = None,
        pd_decider: bool = False,
        priority_scheduling: bool = False,
    ) -> None:
        self.name = name
        self.guard_slack = guard_slack
        self.pd_decider = pd_decider
        self.priority_scheduling = priority_scheduling
        self._override = profiles
        self._fallback = LeastLoaded()
        self._weights: dict[int, tuple[DecodeModel, float]] = {}  # guard weights (_weight)
        self._stand_ins: dict[int, _StandIn] = {}  # profiles with a pool transfer (_with_transfer)

    def _profiles(
        self, instances: Sequence[InstanceSnapshot]
    ) -> tuple[list[CalibrationProfile] | None, bool]:
        """Per-instance profile to score with (None when some instance has none at all), and
        whether the pool's median trusted profile stood in for any."""
        if self._override is not None:
            got = [self._override.get(i.name) for i in instances]
            got = [p if p is not None and not p.implausible else None for p in got]
            complete = [p for p in got if p is not None]
            return (complete if len(complete) == len(got) else None), False
        got = [
            i.profile if i.profile is not None and i.profile.trusted else None for i in instances
        ]
        complete = [p for p in got if p is not None]
        if len(complete) == len(got):
            return complete, False
        median = _median_profile(instances)
        if median is None:
            return None, True
        return [p if p is not None else median for p in got], True

    def _measured_transfers(
        self, profiles: list[CalibrationProfile], pool: Sequence[InstanceSnapshot]
    ) -> list[CalibrationProfile]:
        """Decode `profiles` with each unmeasured KV transfer replaced by the median measured one
        of `pool` (every decode pod), where there is one (module docstring). Profiles given to
        the policy (`profiles=`, e.g. `uncalibrated`'s datasheet) are scored as given."""
        if self._override is not None or all(p.transfer_measured for p in profiles):
            return profiles
        median = median_measured_transfer(i.profile for i in pool)
        if median is None:  # nobody measured the link: the defaults are all there is
            return profiles
        return [p if p.transfer_measured else self._with_transfer(p, median) for p in profiles]

    def _with_transfer(
        self, profile: CalibrationProfile, transfer: KVTransferModel
    ) -> CalibrationProfile:
        """`profile` with `transfer`, cached by identity as `_weight` is: a copy per decode pod
        per request would cost more than pricing it, and both change only with a re-probe."""
        hit = self._stand_ins.get(id(profile))
        if hit is not None and hit[0] is profile and hit[1] is transfer:
            return hit[2]
        if len(self._stand_ins) >= 4096:
            self._stand_ins.clear()
        out = dataclasses.replace(profile, kv_transfer=transfer)
        self._stand_ins[id(profile)] = (profile, transfer, out)
        return out

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        prefills = healthy(pool.prefill, "prefill")
        decodes = healthy(pool.decode, "decode")
        p_profiles, p_fallback = self._profiles(prefills)
        d_profiles, d_fallback = self._profiles(decodes)
        if p_profiles is None or d_profiles is None:
            d = self._fallback.route(req, pool, rng)
            return RouteDecision(d.prefill, d.decode, self.name, fallback="least-loaded")
        d_profiles = self._measured_transfers(d_profiles, pool.decode)

        # 1. Prefill: soonest ready.
        best_p = 0
        best_ready = math.inf
        for idx, inst in enumerate(prefills):
            ready = costmodel.prefill_ready_time(req, inst, p_profiles[idx])
            if ready < best_ready:
                best_p, best_ready = idx, ready
        return self._decode(
            req,
            prefills[best_p].name,
            best_ready,
            decodes,
            d_profiles,
            p_fallback or d_fallback,
            local_ok=self.pd_decider,
            unbound_kv_tokens=pool.unbound_kv_tokens,
        )

    def route_decode(self, choice: DecodeChoice, rng: random.Random) -> RouteDecision:
        pool, prefill = choice.pool, choice.prefill
        decodes = healthy(pool.decode, "decode")
        d_profiles, d_fallback = self._profiles(decodes)
        if d_profiles is None:
            d = self._fallback.route_decode(choice, rng)
            return RouteDecision(prefill, d.decode, self.name, fallback="least-loaded")
        d_profiles = self._measured_transfers(d_profiles, pool.decode)
        return self._decode(
            choice.req, prefill, choice.elapsed_s, decodes, d_profiles, d_fallback, bound_late=True
        )

    def _decode(
        self,
        req: RequestFeatures,
        prefill: str,
        ready_s: float,
        decodes: Sequence[InstanceSnapshot],
        d_profiles: Sequence[CalibrationProfile],
        fallback: bool,
        *,
        local_ok: bool = False,
        unbound_kv_tokens: float = 0.0,
        bound_late: bool = False,
    ) -> RouteDecision:
        """2. Decode: fewest expected SLO violations (the request's own, plus the in-flight
        requests whose TPOT target its extra step time would break), then least additional
        completion time; only among instances the bounded-load guard allows.

        With `local_ok` (the P/D decider), each decode instance is also priced prefilling the
        prompt itself; the local path wins only when it causes fewer SLO violations than the
        best two-leg placement. It spends decode capacity that later arrivals may need, which
        no estimate of this request's own cost sees, so it is kept for saving an SLO, and it may
        spend only decode KV that no routed request will claim, those still in the prefill pool
        included (`unbound_kv_tokens`; COSTMODEL.md, "The local path")."""
        allowed = self._allowed(decodes, d_profiles)
        slo = req.slo
        best = -1
        best_key = (math.inf, math.inf)
        cheapest_any = -1
        cheapest_any_key = (math.inf, math.inf)
        estimates: list[costmodel.DecodeEstimate] = []
        for idx, inst in enumerate(decodes):
            est = costmodel.decode_estimate(
                req, inst, d_profiles[idx], ready_s, bound_late=bound_late
            )
            estimates.append(est)
            key = (_violations(est, slo), est.act_s)
            if key < cheapest_any_key:
                cheapest_any, cheapest_any_key = idx, key
            if allowed[idx] and key < best_key:
                best, best_key = idx, key
        chosen = estimates[best]
        if (
            local_ok
            and best_key[0] > 0.0  # only a placement that breaks an SLO can be beaten
            and costmodel.decode_kv_spare(decodes, d_profiles, unbound_kv_tokens)
            >= req.prompt_tokens + req.predicted_output_tokens
        ):
            local = self._local(req, decodes, d_profiles, allowed, estimates)
            if local is not None:
                l_idx, l_est = local
                if _violations(l_est, slo) < best_key[0]:
                    return self._decision(req, None, decodes[l_idx].name, l_est, False, fallback)
        return self._decision(
            req, prefill, decodes[best].name, chosen, best != cheapest_any, fallback
        )

    def _local(
        self,
        req: RequestFeatures,
        decodes: Sequence[InstanceSnapshot],
        d_profiles: Sequence[CalibrationProfile],
        allowed: Sequence[bool],
        estimates: Sequence[costmodel.DecodeEstimate],
    ) -> tuple[int, costmodel.DecodeEstimate] | None:
        """The best decode instance to prefill `req` itself, by (violations, ACT)."""
        best: tuple[int, costmodel.DecodeEstimate] | None = None
        best_key = (math.inf, math.inf)
        for idx, inst in enumerate(decodes):
            if not allowed[idx]:
                continue
            est = costmodel.local_estimate(req, inst, d_profiles[idx], estimates[idx])
            key = (_violations(est, req.slo), est.act_s)
            if key < best_key:
                best, best_key = (idx, est), key
        return best

    def _decision(
        self,
        req: RequestFeatures,
        prefill: str | None,
        decode: str,
        chosen: costmodel.DecodeEstimate,
        guarded: bool,
        fallback: bool,
    ) -> RouteDecision:
        slo = req.slo
        # The chosen placement breaks the fewest SLOs of all it priced: if even it misses the
        # request's own, serving it anywhere costs at least one miss (its own or others').
        feasible = chosen.ttft_s <= slo.ttft_s and chosen.tpot_s <= slo.tpot_s
        return RouteDecision(
            prefill=prefill,
            decode=decode,
            policy=self.name,
            predicted_ttft_s=chosen.ttft_s,
            predicted_tpot_s=chosen.tpot_s,
            slo_feasible=feasible,
            guarded=guarded,
            fallback="median-profile" if fallback else None,
            shed=slo.sheddable and not feasible,
            # Late anyway: on engines scheduling by priority it lets the others pass. Its own
            # estimate left out the work of earlier late requests, which it queues behind.
            priority=1 if self.priority_scheduling and chosen.ttft_s > slo.ttft_s else 0,
        )

    def _weight(self, model: DecodeModel) -> float:
        """Sequences per second at a reference batch: the guard's share of the pool. Cached by
        identity (hashing the constants costs more than the step): a pod's profile object
        changes only when it is re-probed. The entry keeps its model alive, so an id is never
        reused while cached; the cache is cleared when it grows past any real pool."""
        hit = self._weights.get(id(model))
        if hit is not None and hit[0] is model:
            return hit[1]
        if len(self._weights) >= 4096:
            self._weights.clear()
        w = _REF_SEQS / model.step(_REF_SEQS, _REF_CONTEXT)
        self._weights[id(model)] = (model, w)
        return w

    def _allowed(
        self, decodes: Sequence[InstanceSnapshot], profiles: Sequence[CalibrationProfile]
    ) -> list[bool]:
        if self.guard_slack is None or len(decodes) == 1:
            return [True] * len(decodes)
        weights = [self._weight(p.decode) for p in profiles]
        total_w = sum(weights)
        total = sum(i.inflight for i in decodes) + 1
        factor = (1.0 + self.guard_slack) * total / total_w
        allowed = [
            inst.inflight + 1 <= max(1.0, math.ceil(factor * w))
            for inst, w in zip(decodes, weights, strict=True)
        ]
        if not any(allowed):  # cannot happen with slack >= 0, but never leave the request homeless
            loads = [inst.inflight / w for inst, w in zip(decodes, weights, strict=True)]
            allowed[loads.index(min(loads))] = True
        return allowed
