"""Cost model: the additional completion time of admitting one request on one instance.

Pure arithmetic over (request features, instance snapshot, profile): no I/O, no clock. The
formulas, with the reasoning behind each term, are written down in COSTMODEL.md next to this file;
the symbols there are the local variable names here. Called by `core.policies` (the calibrated
policies, and the baselines to report predictions), hence by the simulator and the sidecar alike.

The code is written for speed (one decision must cost microseconds): plain floats, locals, no
allocation beyond the returned named tuples.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import NamedTuple

from disaggpool.core.contracts import InstanceSnapshot, RequestFeatures
from disaggpool.core.profile import CalibrationProfile

__all__ = [
    "DecodeEstimate",
    "decode_estimate",
    "decode_kv_spare",
    "local_estimate",
    "local_prefill_time",
    "prefill_ready_time",
]

#: Fraction of the KV capacity kept free before admission waits (vLLM keeps a watermark too).
KV_HEADROOM = 0.02


class DecodeEstimate(NamedTuple):
    """What admitting one request on one decode instance costs (all times in seconds).

    A named tuple rather than a dataclass: it is built once per instance per decision on the hot
    path, and a tuple subclass costs no more to build than a bare tuple.
    """

    act_s: float
    """Additional completion time: the request's own time there plus the delay it adds to others."""
    ttft_s: float
    """Predicted time to first token, prefill queue and KV transfer included."""
    tpot_s: float
    """Predicted time per output token, preemption risk included."""
    harm_s: float
    """Seconds of delay the request imposes on the sequences already there."""
    slo_harm: int
    """In-flight requests on course for their TPOT target that the added step time would break."""
    tau_s: float = 0.0
    """The step time of the batch the request joins (kept for `local_estimate`)."""
    wait_s: float = 0.0
    """Admission wait plus the stalls of local prefills queued there (kept for `local_estimate`)."""
    ahead: int = 0
    """Sequences there before the request (kept for `local_estimate`)."""
    preempt_p: float = 0.0
    """Probability the KV cache runs out while the request runs (vLLM then preempts it)."""
    hidden_s: float = 0.0
    """Admission wait that clears while the prompt is prefilled elsewhere (two-leg path only)."""


def prefill_ready_time(
    req: RequestFeatures, inst: InstanceSnapshot, prof: CalibrationProfile
) -> float:
    """Seconds until `req`'s prompt is prefilled on `inst`: its queue, then itself (FCFS).

    The queue is the router's own prompt tokens not yet prefilled there (less what it expected
    cached), plus the requests the scrape showed beyond the router's own (`foreign`: another
    client's), priced at this request's length. With h of its n tokens cached there, the request
    itself costs the partial prefill ``p1 * (n - h) + p2 * (n**2 - h**2)`` (COSTMODEL.md, "The
    prefix cache"). Work routed there with a priority above 0 is not ahead of it: the router gives
    that only to requests it predicts late, on engines scheduling by priority (COSTMODEL.md,
    "Priority").
    """
    n = req.prompt_tokens
    h = req.prefix_hits.get(inst.name, 0) if req.prefix_hits else 0
    q_tokens = inst.queued_tokens - inst.yielded_tokens
    q_sq = inst.queued_sq_tokens - inst.yielded_sq_tokens
    # Work the router did not send itself, of unknown length: priced at this request's.
    foreign = inst.foreign
    if foreign:
        q_tokens += foreign * n
        q_sq += foreign * n * n
    tokens = q_tokens + (n - h)
    pf = prof.prefill
    iterations = math.ceil(tokens / prof.max_num_batched_tokens)
    return iterations * pf.p0 + pf.p1 * tokens + pf.p2 * (q_sq + n * n - h * h)


def local_prefill_time(inst: InstanceSnapshot, prof: CalibrationProfile) -> float:
    """Seconds the local prefills already routed to decode instance `inst` will stall it."""
    q = inst.local_prefill_tokens
    if q <= 0:
        return 0.0
    pf = prof.prefill
    return (
        math.ceil(q / prof.max_num_batched_tokens) * pf.p0
        + pf.p1 * q
        + pf.p2 * inst.local_prefill_sq_tokens
    )


def decode_kv_spare(
    decodes: Sequence[InstanceSnapshot],
    profiles: Sequence[CalibrationProfile],
    unbound_kv_tokens: float,
) -> float:
    """Decode KV tokens no routed request will claim (COSTMODEL.md, "The local path"): each
    instance's capacity less what it holds and what the requests routed there still need (their
    prompts as `decode_estimate` counts them, and their predicted remaining output), summed, less
    what the requests still in the prefill pool without a decode instance will claim."""
    spare = -unbound_kv_tokens
    for inst, prof in zip(decodes, profiles, strict=True):
        free = (
            prof.kv_capacity_tokens * (1.0 - KV_HEADROOM)
            - inst.kv_tokens_used
            - inst.queued_tokens
            - inst.remaining_output_tokens
        )
        if free > 0.0:
            spare += free
    return spare


def decode_estimate(
    req: RequestFeatures,
    inst: InstanceSnapshot,
    prof: CalibrationProfile,
    prefill_ready_s: float,
    *,
    local: bool = False,
    bound_late: bool = False,
) -> DecodeEstimate:
    """Additional completion time of admitting `req` on decode instance `inst` (COSTMODEL.md).

    `local`: the decode instance prefills the prompt itself (no prefill leg, no KV transfer);
    `prefill_ready_s` is then the time already spent before the decision (0 at arrival).
    `bound_late`: the prefill is done (`prefill_ready_s` is the time it took) and the decode leg
    arrives now; otherwise it arrives `prefill_ready_s` from now, and the instance's queue keeps
    draining meanwhile.
    """
    n = req.prompt_tokens
    o = req.predicted_output_tokens if req.predicted_output_tokens > 1.0 else 1.0
    dm = prof.decode
    cap = prof.kv_capacity_tokens * (1.0 - KV_HEADROOM)
    max_seqs = prof.max_num_seqs

    # Sequences and KV tokens that will be on the instance before this request.
    # Ours, exactly, and what the last scrape showed beyond ours (the gauges themselves still
    # count our requests that finished since).
    b_ahead = inst.inflight + inst.foreign
    k_ahead = inst.kv_tokens_used + inst.queued_tokens
    r_bar = inst.remaining_output_tokens / b_ahead if b_ahead else o  # mean remaining output

    b_join = b_ahead + 1
    b_run = b_join if b_join < max_seqs else max_seqs
    growth = (o if o < r_bar else r_bar) * 0.5  # context each sequence gains while r overlaps
    k_mid = k_ahead + n + b_run * growth
    # A step never holds more than the capacity; the context beyond it is paid in preemptions
    # and recomputation instead, at no less than a held token costs, so the completion time
    # charges it (`over`). Without that every full instance looked as cheap as a merely busy one
    # (COSTMODEL.md).
    over = dm.d2 * (k_mid - cap) if k_mid > cap else 0.0
    tau = dm.d0 + dm.d1 * b_run + dm.d2 * (k_mid if k_mid < cap else cap)  # the step r joins

    # Whose TPOT target the extra step time breaks: in-flight requests meeting theirs without r.
    slo_harm = 0
    budgets = inst.tpot_budgets
    if budgets.seconds:
        b_before = b_ahead if b_ahead < max_seqs else max_seqs
        k_before = k_ahead + b_before * growth
        tau_before = dm.d0 + dm.d1 * b_before + dm.d2 * (k_before if k_before < cap else cap)
        slo_harm = budgets.between(tau_before, tau)

    # Admission wait: requests that must finish before r gets a slot and its KV blocks.
    excess_seqs = b_join - max_seqs
    avg_ctx = k_ahead / b_ahead if b_ahead else n
    excess_tokens = (k_ahead + n - cap) / (avg_ctx if avg_ctx > 1.0 else 1.0)
    must_finish = excess_seqs if excess_seqs > excess_tokens else excess_tokens
    wait = 0.0
    if must_finish > 0.0:
        b_now = b_ahead if b_ahead < max_seqs else max_seqs
        wait = must_finish * r_bar * tau / (b_now if b_now else 1)

    # Slowdown r imposes on the sequences already there while they overlap.
    overlap = o if o < r_bar else r_bar
    harm = (b_run - 1) * (dm.d1 + dm.d2 * (n + 0.5 * o)) * overlap

    # Preemption risk: the KV peak while r runs against the capacity, under output uncertainty.
    # The batch grows a token per sequence per step while finishing sequences free their whole
    # context; with remaining outputs spread evenly over [0, 2R] the KV changes by
    # b * (t - t^2 / 4R - t * avg_ctx / 2R) after t steps, which peaks at t = 2R - avg_ctx
    # (never, when contexts are longer than twice what is left to generate).
    grows = o + req.output_uncertainty
    big_r = grows if grows < r_bar else r_bar
    room = 2.0 * big_r - avg_ctx
    peak = k_ahead + n + (b_run * room * room / (4.0 * big_r) if room > 0.0 else 0.0)
    spread = req.output_uncertainty * math.sqrt(b_run) + prof.block_size
    z = (peak - cap) / spread
    if z > -4.0:
        p_over = 0.5 * math.erfc(-z * 0.7071067811865476)
        recompute = prof.prefill.prompt_time(n + int(0.5 * o))
        penalty = p_over * (recompute + 0.5 * o * tau)
        harm += penalty
    else:
        p_over = penalty = 0.0

    # Local prefills queued there stall every step they run in: r waits for them too.
    stall = local_prefill_time(inst, prof)
    # The decode leg reaches the instance when its prefill is done: the slots and stalls that
    # clear before then cost it nothing (the engine admits it on arrival, then pulls the KV).
    lead = 0.0 if (local or bound_late) else prefill_ready_s
    held = wait + stall - lead if wait + stall > lead else 0.0
    ttft = prefill_ready_s + held + prof.kv_transfer.time(n) + tau
    hidden = wait if wait < lead else lead
    act = wait - hidden + o * (tau + over) + harm
    est = DecodeEstimate(
        act, ttft, tau + penalty / o, harm, slo_harm, tau, wait + stall, b_ahead, p_over, hidden
    )
    return local_estimate(req, inst, prof, est, prefill_ready_s) if local else est


def local_estimate(
    req: RequestFeatures,
    inst: InstanceSnapshot,
    prof: CalibrationProfile,
    remote: DecodeEstimate,
    elapsed_s: float = 0.0,
) -> DecodeEstimate:
    """The same placement on the local path: `inst` prefills `req`'s prompt itself in the step it
    joins (no prefill queue, no KV transfer), stalling every sequence there for that long.

    Derived from the two-leg estimate of the same instance (`remote`), so pricing both paths
    costs one full estimate per instance (COSTMODEL.md, "The local path")."""
    own = prof.prefill.prompt_time(req.prompt_tokens)
    tau = remote.tau_s
    ahead = remote.ahead
    slo_harm = remote.slo_harm
    if inst.tpot_budgets.seconds and ahead:
        # A stall of `own` seconds breaks a request whose remaining tokens cannot absorb it: its
        # slack in seconds is (budget - tau) * remaining tokens. Only budgets in [tau, tau + own)
        # can break (a request has at least one token left).
        b = inst.tpot_budgets
        i = bisect.bisect_left(b.seconds, tau)
        end = len(b.seconds)
        while i < end and b.seconds[i] < tau + own:
            if (b.seconds[i] - tau) * b.tokens[i] < own:
                slo_harm += b.counts[i]
            i += 1
    # Requests routed there and not decoding yet get their first token after the stall: those
    # still on time whose first token is due within `own` are pushed over (COSTMODEL.md).
    slack = inst.ttft_slack_s
    if slack:
        lo = bisect.bisect_left(slack, 0.0)
        slo_harm += bisect.bisect_left(slack, own, lo) - lo
    stall_harm = ahead * own
    return DecodeEstimate(
        remote.act_s + remote.hidden_s + stall_harm,  # here r is admitted now: nothing hidden
        elapsed_s + remote.wait_s + own + tau,
        remote.tpot_s,
        remote.harm_s + stall_harm,
        slo_harm,
        tau,
        remote.wait_s,
        ahead,
        remote.preempt_p,
    )
