"""The cost model against cases computed by hand from COSTMODEL.md."""

from __future__ import annotations

import dataclasses
import math

import pytest

from disaggpool.core import costmodel
from disaggpool.core.contracts import InstanceSnapshot, RequestFeatures, SLOClass, TpotBudgets
from disaggpool.core.profile import CalibrationProfile, DecodeModel, KVTransferModel, PrefillModel

# Round numbers so that every expectation below can be checked with pencil and paper.
PROFILE = CalibrationProfile(
    name="toy",
    prefill=PrefillModel(p0=0.01, p1=0.001, p2=0.0),
    decode=DecodeModel(d0=0.02, d1=0.001, d2=1e-6),
    kv_transfer=KVTransferModel(k0=0.002, bytes_per_token=1000.0, bandwidth_bytes_per_s=1e6),
    kv_capacity_tokens=100_000,
    max_num_seqs=8,
    max_num_batched_tokens=1000,
    block_size=16,
)
SLO = SLOClass("chat", ttft_s=2.0, tpot_s=0.05)


def request(n: int = 500, o: float = 100.0, sigma: float = 0.0) -> RequestFeatures:
    return RequestFeatures("r", n, o, sigma, SLO)


def test_prefill_ready_time_counts_queue_and_own_prompt() -> None:
    inst = InstanceSnapshot("p", "prefill", queued=2, queued_tokens=1500, queued_sq_tokens=0.0)
    # 2000 tokens -> 2 iterations of the 1000-token budget: 2 * p0 + p1 * 2000
    assert costmodel.prefill_ready_time(request(), inst, PROFILE) == pytest.approx(2 * 0.01 + 2.0)


def test_prefill_prices_foreign_waiting_requests_at_this_length() -> None:
    inst = InstanceSnapshot("p", "prefill", waiting=3, queued=1, queued_tokens=100, foreign=2)
    # two requests the router did not send: 2 * 500 tokens added to the 100 queued + 500 own
    expected = math.ceil(1600 / 1000) * 0.01 + 0.001 * 1600
    assert costmodel.prefill_ready_time(request(), inst, PROFILE) == pytest.approx(expected)


def test_prefill_counts_its_own_running_prompt_once() -> None:
    # The router's one request there is being prefilled: `running` is that same request, whose
    # tokens `queued_tokens` already holds, so nothing is added for it.
    inst = InstanceSnapshot(
        "p", "prefill", running=1, waiting=1, queued=1, queued_tokens=1500, queued_sq_tokens=0.0
    )
    assert costmodel.prefill_ready_time(request(), inst, PROFILE) == pytest.approx(2 * 0.01 + 2.0)


def test_prefill_prices_foreign_running_requests_at_this_length() -> None:
    # Two prompts being prefilled that the router did not send (it has nothing there).
    inst = InstanceSnapshot("p", "prefill", running=2, foreign=2)
    expected = math.ceil(1500 / 1000) * 0.01 + 0.001 * 1500
    assert costmodel.prefill_ready_time(request(), inst, PROFILE) == pytest.approx(expected)


def test_idle_decode_instance() -> None:
    est = costmodel.decode_estimate(request(), InstanceSnapshot("d", "decode"), PROFILE, 0.5)
    # batch of one; mean context 500 + 100/2 = 550
    tau = 0.02 + 0.001 * 1 + 1e-6 * 550
    assert est.tpot_s == pytest.approx(tau)
    assert est.ttft_s == pytest.approx(0.5 + 0.002 + 500 * 1000 / 1e6 + tau)
    assert est.harm_s == 0.0 and est.slo_harm == 0
    assert est.act_s == pytest.approx(100 * tau)


def test_busy_instance_adds_slowdown_imposed_on_others() -> None:
    inst = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=4000, remaining_output_tokens=400.0
    )
    est = costmodel.decode_estimate(request(), inst, PROFILE, 0.0)
    # r_bar = 100, growth = 50, batch 5: context 4000 + 500 + 5 * 50
    tau = 0.02 + 0.001 * 5 + 1e-6 * 4750
    assert est.tpot_s == pytest.approx(tau)
    # each of the 4 others is slowed by d1 + d2 * (n + o/2) for the 100 steps they overlap
    assert est.harm_s == pytest.approx(4 * (0.001 + 1e-6 * 550) * 100)
    assert est.act_s == pytest.approx(100 * tau + est.harm_s)


def test_full_batch_waits_for_completions() -> None:
    inst = InstanceSnapshot(
        "d", "decode", running=8, inflight=8, kv_tokens_used=8000, remaining_output_tokens=800.0
    )
    est = costmodel.decode_estimate(request(), inst, PROFILE, 0.0)
    tau = 0.02 + 0.001 * 8 + 1e-6 * (8000 + 500 + 8 * 50)
    # one sequence must finish: r_bar (100) steps of tau each, shared among the 8 running
    wait = 1 * 100 * tau / 8
    assert est.tpot_s == pytest.approx(tau)
    assert est.ttft_s == pytest.approx(0.002 + 0.5 + wait + tau)
    assert est.act_s > 100 * tau + wait - 1e-12


def test_a_slot_that_frees_during_the_prefill_costs_the_decode_leg_nothing() -> None:
    inst = InstanceSnapshot(
        "d", "decode", running=8, inflight=8, kv_tokens_used=8000, remaining_output_tokens=800.0
    )
    tau = 0.02 + 0.001 * 8 + 1e-6 * (8000 + 500 + 8 * 50)
    wait = 1 * 100 * tau / 8  # about 0.36 s until a slot frees (the case above)
    # Prompt ready in 0.1 s: the leg arrives with 0.1 s of that wait already past.
    soon = costmodel.decode_estimate(request(), inst, PROFILE, 0.1)
    assert soon.ttft_s == pytest.approx(0.1 + (wait - 0.1) + 0.502 + tau)
    assert soon.hidden_s == pytest.approx(0.1)
    # Ready in 1 s: the slot is free by then; only the transfer and the first step remain.
    later = costmodel.decode_estimate(request(), inst, PROFILE, 1.0)
    assert later.ttft_s == pytest.approx(1.0 + 0.502 + tau)
    assert later.hidden_s == pytest.approx(wait)
    assert later.act_s == pytest.approx(soon.act_s - (wait - 0.1))
    # Bound late, the prefill took 1 s already and the leg arrives now: it waits in full.
    late = costmodel.decode_estimate(request(), inst, PROFILE, 1.0, bound_late=True)
    assert late.ttft_s == pytest.approx(1.0 + wait + 0.502 + tau)
    assert late.hidden_s == 0.0
    # Prefilled there instead, the request is admitted now: nothing is hidden.
    local = costmodel.decode_estimate(request(), inst, PROFILE, 0.0, local=True)
    assert local.act_s > later.act_s + wait - 1e-12


def test_kv_pressure_adds_preemption_penalty() -> None:
    roomy = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=4000, remaining_output_tokens=400.0
    )
    tight = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=97_000, remaining_output_tokens=400.0
    )
    easy = costmodel.decode_estimate(request(sigma=50), roomy, PROFILE, 0.0)
    hard = costmodel.decode_estimate(request(sigma=50), tight, PROFILE, 0.0)
    assert hard.act_s > easy.act_s
    assert hard.tpot_s > easy.tpot_s


def test_kv_beyond_capacity_is_not_free() -> None:
    # Capacity 100,000 less the 2% headroom = 98,000. A step never holds more, so both full
    # instances run the same step; but the context beyond the capacity is paid in preemptions
    # and recomputation: the completion time charges d2 per token over it for each of o steps.
    full = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=98_000, remaining_output_tokens=400.0
    )
    over = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=99_000, remaining_output_tokens=400.0
    )
    a = costmodel.decode_estimate(request(), full, PROFILE, 0.0)
    b = costmodel.decode_estimate(request(), over, PROFILE, 0.0)
    assert a.tau_s == b.tau_s == pytest.approx(0.02 + 0.001 * 5 + 1e-6 * 98_000)
    assert b.act_s - a.act_s >= 100 * 1e-6 * 1000 - 1e-9


def test_preemption_probability_from_the_kv_peak() -> None:
    # Contexts of 1,000 tokens with 100 left to generate: finishing sequences free more than the
    # batch grows, so the peak is now, k_ahead + n = 4,500, far under 98,000: no risk.
    roomy = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=4000, remaining_output_tokens=400.0
    )
    assert costmodel.decode_estimate(request(sigma=50), roomy, PROFILE, 0.0).preempt_p == 0.0
    # the same with the peak exactly at the capacity: z = 0, an even chance
    at_cap = InstanceSnapshot(
        "d",
        "decode",
        running=4,
        inflight=4,
        kv_tokens_used=98_000 - 500,
        remaining_output_tokens=400.0,
    )
    est = costmodel.decode_estimate(request(sigma=50), at_cap, PROFILE, 0.0)
    assert est.preempt_p == pytest.approx(0.5)
    # Short contexts and long outputs: the batch grows first. R = min(o + sigma, r_bar) = 150,
    # avg_ctx = 100: peak = k + n + b (2R - avg_ctx)^2 / 4R = 400 + 500 + 5 * 200^2 / 600.
    growing = InstanceSnapshot(
        "d", "decode", running=4, inflight=4, kv_tokens_used=400, remaining_output_tokens=4000.0
    )
    peak = 400 + 500 + 5 * 200**2 / 600
    shrunk = dataclasses.replace(PROFILE, kv_capacity_tokens=round(peak / 0.98))
    est = costmodel.decode_estimate(request(sigma=50), growing, shrunk, 0.0)
    assert est.preempt_p == pytest.approx(0.5, abs=0.01)


def test_slo_harm_counts_only_requests_pushed_over_their_target() -> None:
    tau_before = 0.02 + 0.001 * 4 + 1e-6 * (4000 + 4 * 50)
    tau_after = 0.02 + 0.001 * 5 + 1e-6 * (4500 + 5 * 50)
    between = (tau_before + tau_after) / 2
    inst = InstanceSnapshot(
        "d",
        "decode",
        running=4,
        inflight=4,
        kv_tokens_used=4000,
        remaining_output_tokens=400.0,
        tpot_budgets=TpotBudgets.of([(tau_before / 2, 64, 1), (between, 64, 2), (1.0, 64, 1)]),
    )
    est = costmodel.decode_estimate(request(), inst, PROFILE, 0.0)
    # the first is late anyway, the last has room: only the two between are pushed over
    assert est.slo_harm == 2


def test_local_prefill_prices_the_stall_and_skips_the_transfer() -> None:
    """The P/D decider's local path on a decode instance running 4 sequences: no KV transfer,
    the prompt computed in the step it joins (p0 + p1 * n = 0.51 s here), every running
    sequence stalled that long, and those TPOT targets it pushes over counted."""
    inst = InstanceSnapshot(
        "d",
        "decode",
        running=4,
        inflight=4,
        kv_tokens_used=4000,
        remaining_output_tokens=400.0,
        tpot_budgets=TpotBudgets.of([(0.03, 64, 2), (0.035, 8, 1), (0.5, 8, 1)]),
    )
    remote = costmodel.decode_estimate(request(), inst, PROFILE, 0.3)
    local = costmodel.decode_estimate(request(), inst, PROFILE, 0.0, local=True)
    tau = 0.02 + 0.001 * 5 + 1e-6 * 4750  # as in the busy-instance case above
    own = 0.01 + 0.001 * 500
    assert remote.ttft_s == pytest.approx(0.3 + 0.002 + 0.5 + tau)
    assert local.ttft_s == pytest.approx(own + tau)
    assert local.harm_s == pytest.approx(remote.harm_s + 4 * own)
    # r's extra step alone keeps every sequence on course (tau = 0.02975). The 0.51 s stall
    # breaks those whose slack in seconds, (budget - tau) * remaining tokens, is smaller: the two
    # at 0.03 s with 64 tokens left (0.016 s), and the one at 0.035 s with 8 left (0.042 s); the
    # one affording 0.5 s per token for its last 8 (3.8 s) absorbs it.
    assert remote.slo_harm == 0
    assert local.slo_harm == 3


def test_local_prefill_breaks_first_tokens_due_during_its_stall() -> None:
    """Requests routed to that decode instance and not decoding yet get their first token after
    the 0.51 s stall: the two due within it are pushed over; one already late and one due in 2 s
    are not counted."""
    inst = InstanceSnapshot("d", "decode", queued=4, ttft_slack_s=(-0.2, 0.1, 0.5, 2.0))
    local = costmodel.decode_estimate(request(), inst, PROFILE, 0.0, local=True)
    remote = costmodel.decode_estimate(request(), inst, PROFILE, 0.0)
    assert remote.slo_harm == 0
    assert local.slo_harm == 2


def test_queued_local_prefills_stall_a_remote_request_too() -> None:
    busy = InstanceSnapshot("d", "decode", local_prefill_tokens=1500, local_prefill_sq_tokens=0.0)
    idle = InstanceSnapshot("d", "decode")
    stall = 2 * 0.01 + 0.001 * 1500  # 1500 tokens in two 1000-token iterations
    a = costmodel.decode_estimate(request(), busy, PROFILE, 0.0)
    b = costmodel.decode_estimate(request(), idle, PROFILE, 0.0)
    assert a.ttft_s - b.ttft_s == pytest.approx(stall)


def test_decode_kv_spare_leaves_out_what_routed_requests_will_claim() -> None:
    """Capacity 100,000 less the 2% headroom is 98,000 per instance. One instance holds 30,000,
    has 5,000 queued prompt tokens and 3,000 predicted output tokens to go: 60,000 spare. The
    other is over-committed (it counts 0, not a negative). 20,000 tokens are owed to requests
    still in the prefill pool: 40,000 left."""
    roomy = InstanceSnapshot(
        "d0",
        "decode",
        kv_tokens_used=30_000,
        queued_tokens=5_000,
        remaining_output_tokens=3_000.0,
    )
    full = InstanceSnapshot("d1", "decode", kv_tokens_used=97_000, queued_tokens=4_000)
    spare = costmodel.decode_kv_spare([roomy, full], [PROFILE, PROFILE], 20_000.0)
    assert spare == pytest.approx(40_000.0)
    assert costmodel.decode_kv_spare([roomy, full], [PROFILE, PROFILE], 70_000.0) < 0.0
