"""The router on its own: the per-request sequence, late binding, retries, shedding, the prefix
index, what it learns from an end, and a view cache that never changes a snapshot."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.ledger import BUDGETS_REFRESH_S, Gauges, view
from disaggpool.core.pods import Pod, Pods
from disaggpool.core.policies.base import NoCapacityError
from disaggpool.core.policies.registry import PolicyOptions, make_policy
from disaggpool.core.predictor import OutputPredictor, Prediction, make_predictor
from disaggpool.core.prefix_index import PrefixIndex
from disaggpool.core.router import ApproximatePrefix, Request, Router

A40 = builtin_profile("a40-llama3-8b")
CHAT = SLOClass("chat", 1.0, 0.1)


class Learner:
    """A predictor that predicts 80 tokens and writes down what it is taught."""

    name = "learner"

    def __init__(self) -> None:
        self.taught: list[tuple[str, int, int]] = []

    def predict(
        self,
        slo_class: str,
        prompt_tokens: int,
        rng: random.Random,
        true_output: int | None = None,
    ) -> Prediction:
        return Prediction(80.0, 80.0, 120.0, 20.0)

    def observe(self, slo_class: str, prompt_tokens: int, output_tokens: int) -> None:
        self.taught.append((slo_class, prompt_tokens, output_tokens))


def pool(
    n_prefill: int = 2,
    n_decode: int = 3,
    *,
    own_books: bool = True,
    refresh_s: float = BUDGETS_REFRESH_S,
) -> Pods[Pod]:
    pods: Pods[Pod] = Pods(own_books=own_books, refresh_s=refresh_s)
    for i in range(n_prefill):
        pods.add(Pod(f"p{i}", "prefill", profile=A40))
    for i in range(n_decode):
        pods.add(Pod(f"d{i}", "decode", profile=A40))
    for name in pods.instances:
        pods.scraped(name, Gauges(0, 0, 0.0, A40.kv_capacity_tokens), 0.0)
    return pods


def router(
    policy: str = "calibrated",
    *,
    pods: Pods[Pod] | None = None,
    predictor: OutputPredictor | None = None,
    prefix: bool = False,
    late: bool = True,
    seed: int = 0,
) -> Router:
    pods = pods if pods is not None else pool()
    return Router(
        make_policy(policy, options=PolicyOptions()),
        predictor if predictor is not None else Learner(),
        random.Random(seed),
        pods,
        prefix=ApproximatePrefix(PrefixIndex(), pods) if prefix else None,
        late_binding=late,
    )


def test_route_predicts_looks_up_decides_and_books() -> None:
    r = router(late=False)
    placed = r.route(Request("a", 700, CHAT, max_tokens=50), 1.0)
    assert placed.features.predicted_output_tokens == 50.0  # the client's cap under 80
    assert placed.features.output_uncertainty == 20.0
    d = placed.decision
    assert d.prefill is not None and not placed.late
    entry = r.ledger.entries["a"]
    assert (entry.prefill, entry.decode, entry.predicted_output, entry.routed_at) == (
        d.prefill,
        d.decode,
        50.0,
        1.0,
    )
    snap = r.snapshot(1.0)
    by_name = {i.name: i for i in (*snap.prefill, *snap.decode)}
    assert by_name[d.prefill].queued_tokens == 700  # the cached view was rebuilt
    assert by_name[d.decode].inflight == 1


def test_late_binding_books_the_decode_pod_when_the_prefill_leg_answers() -> None:
    r = router("least_loaded")
    placed = r.route(Request("a", 700, CHAT), 0.0)
    assert placed.late and r.ledger.entries["a"].decode is None
    assert r.snapshot(0.0).unbound_kv_tokens == 780.0
    assert r.route(Request("b", 700, CHAT), 0.0, bind_late=False).late is False
    bound = r.bind_decode("a", 0.4)
    assert bound is not None and bound.prefill == placed.decision.prefill
    entry = r.ledger.entries["a"]
    assert entry.decode == bound.decode and entry.prefilled
    assert bound.decode != r.ledger.entries["b"].decode  # least loaded on the pool of 0.4
    assert r.snapshot(0.4).unbound_kv_tokens == 0.0
    assert r.bind_decode("a", 0.5) is None  # bound already
    assert r.bind_decode("b", 0.5) is None  # bound at arrival
    assert r.bind_decode("zz", 0.5) is None


def test_a_router_without_late_binding_binds_at_arrival_whatever_the_caller_can() -> None:
    r = router(late=False)
    assert not r.route(Request("a", 700, CHAT), 0.0).late
    assert r.ledger.entries["a"].decode is not None


def test_a_sheddable_request_that_would_miss_its_slo_is_not_booked() -> None:
    r = router()
    hopeless = SLOClass("batch", 0.0001, 0.0001, sheddable=True)
    placed = r.route(Request("a", 700, hopeless), 0.0)
    assert placed.decision.shed
    assert r.ledger.entries == {} and r.snapshot(0.0).prefill[0].queued == 0
    kept = SLOClass("batch", 0.0001, 0.0001)  # the same targets, not sheddable: served late
    assert not r.route(Request("b", 700, kept), 0.0).decision.shed
    assert "b" in r.ledger.entries


def test_finished_teaches_the_predictor_and_forget_does_not() -> None:
    learner = Learner()
    r = router(predictor=learner)
    for rid in ("a", "b", "c"):
        r.route(Request(rid, 300, CHAT), 0.0)
    assert r.prefilled("a") and r.progress("a", 3, 0.5) and not r.progress("zz", 3, 0.5)
    assert r.finished("a", 120) is not None
    assert r.finished("b", 0) is not None  # nothing produced: nothing to learn
    assert r.forget("c") is not None
    assert r.finished("a", 120) is None  # already gone
    assert learner.taught == [("chat", 300, 120)]
    assert r.ledger.entries == {}
    assert all(a.inflight == 0 for a in r.ledger.accounts.values())


def test_expired_forgets_what_nobody_reported() -> None:
    r = router()
    r.route(Request("old", 300, CHAT), 0.0)
    r.route(Request("new", 300, CHAT), 50.0)
    assert [e.request_id for e in r.expired(70.0, 30.0)] == ["old"]
    assert list(r.ledger.entries) == ["new"]


def test_exclusions_mark_the_pods_a_retry_avoids() -> None:
    r = router("round_robin", late=False)
    for i in range(4):
        d = r.route(Request(f"r{i}", 300, CHAT), 0.0, exclude_prefill=("p0",)).decision
        assert d.prefill == "p1"
    with pytest.raises(NoCapacityError, match="prefill"):
        r.route(Request("x", 300, CHAT), 0.0, exclude_prefill=("p0", "p1"))
    assert "x" not in r.ledger.entries
    snap = r.snapshot(0.0, exclude_decode=("d1",))
    assert [i.healthy for i in snap.decode] == [True, False, True]
    assert all(i.healthy for i in r.snapshot(0.0).decode)  # the pods themselves untouched


def test_retry_decode_pulls_the_same_kv_elsewhere_or_prefills_locally() -> None:
    r = router("least_loaded", late=False)
    first = r.route(Request("a", 700, CHAT), 0.0).decision
    r.prefilled("a")
    again = r.retry_decode("a", first.decode, 0.3, local=False)
    assert again is not None and again.prefill == first.prefill and again.decode != first.decode
    entry = r.ledger.entries["a"]
    assert (entry.prefill, entry.decode, entry.prefilled) == (first.prefill, again.decode, True)
    prefill_acc = r.ledger.accounts[first.prefill]  # the prefill leg is not booked twice
    assert (prefill_acc.inflight, prefill_acc.queued_tokens) == (0, 0)
    local = r.retry_decode("a", again.decode, 0.5, local=True)
    assert local is not None and local.prefill is None and local.decode != again.decode
    entry = r.ledger.entries["a"]
    assert (entry.prefill, entry.decode) == (None, local.decode)
    assert r.ledger.accounts[local.decode].local_tokens == 700
    assert r.retry_decode("zz", "d0", 0.5, local=False) is None


def test_retry_decode_with_no_other_decode_pod_raises_and_forgets() -> None:
    r = router(pods=pool(1, 1), late=False)
    r.route(Request("a", 700, CHAT), 0.0)
    with pytest.raises(NoCapacityError, match="decode"):
        r.retry_decode("a", "d0", 0.3, local=False)
    assert r.ledger.entries == {}


def test_the_prefix_index_is_read_before_and_written_after_each_decision() -> None:
    r = router("cache_aware", late=False, prefix=True)
    blocks = tuple(range(1, 41))  # 40 blocks of 16: 640 tokens
    first = r.route(Request("a", 700, CHAT, blocks=blocks, block_tokens=16), 0.0)
    assert first.features.prefix_hits == {}
    assert first.decision.prefill is not None
    assert r.ledger.entries["a"].cached_tokens == 0
    second = r.route(Request("b", 700, CHAT, blocks=blocks, block_tokens=16), 0.0)
    assert second.features.prefix_hits == {first.decision.prefill: 640}
    assert second.decision.prefill == first.decision.prefill  # cache_aware follows the hit
    assert r.ledger.entries["b"].cached_tokens == 640  # booked as that much less work
    unrelated = r.route(Request("c", 700, CHAT, blocks=(99,) * 40, block_tokens=16), 0.0)
    assert unrelated.features.prefix_hits == {}


def test_the_index_is_bounded_by_what_the_pod_can_hold() -> None:
    pods = pool(1, 1)
    small = dataclasses.replace(A40, kv_capacity_tokens=320)  # 20 blocks of 16
    pods.instances["p0"].profile = small
    pods.changed("p0")
    r = router("round_robin", pods=pods, late=False, prefix=True)
    old, new = tuple(range(1, 21)), tuple(range(101, 121))
    r.route(Request("a", 330, CHAT, blocks=old, block_tokens=16), 0.0)
    r.route(Request("b", 330, CHAT, blocks=new, block_tokens=16), 0.0)
    hits = r.route(Request("c", 330, CHAT, blocks=old, block_tokens=16), 0.0)
    assert hits.features.prefix_hits == {}  # evicted by the second prompt


def test_a_router_without_books_shows_the_gauges_alone() -> None:
    r = router("least_loaded", pods=pool(own_books=False))
    r.route(Request("a", 700, CHAT), 0.0)
    snap = r.snapshot(0.0)
    assert all(i.inflight == 0 and i.queued_tokens == 0 for i in snap.prefill)
    assert snap.unbound_kv_tokens == 0.0
    assert "a" in r.ledger.entries  # the books are still kept


def test_a_removed_pod_is_out_of_the_snapshot_and_comes_back_last() -> None:
    pods = pool(1, 3)
    removed = pods.remove("d0")
    assert removed is not None
    assert [i.name for i in pods.snapshot(0.0).decode] == ["d1", "d2"]
    pods.add(removed)
    assert [i.name for i in pods.snapshot(0.0).decode] == ["d1", "d2", "d0"]


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(
                ["route", "late", "bind", "prefill", "progress", "stream", "finish", "scrape"]
            ),
            st.integers(0, 7),
            st.floats(0.0, 0.05),
        ),
        max_size=60,
    ),
)
def test_cached_views_are_the_fresh_views(steps: list[tuple[str, int, float]]) -> None:
    """Whatever the sequence of reports, a snapshot with `refresh_s=0` (the simulator's) reuses
    a view only where building it afresh gives the same one."""
    pods = pool(refresh_s=0.0)
    r = router("least_loaded", pods=pods, predictor=make_predictor("online"))
    now, generated = 0.0, dict[str, int]()
    for kind, k, dt in steps:
        now += dt
        rid = f"r{k}"
        if kind in ("route", "late") and rid not in r.ledger.entries:
            r.route(Request(rid, 200 + 50 * k, CHAT), now, bind_late=kind == "late")
            generated[rid] = 0
        elif kind == "bind":
            r.bind_decode(rid, now)
        elif kind == "prefill":
            r.prefilled(rid)
        elif kind == "progress" and rid in r.ledger.entries:
            generated[rid] += 1 + k
            r.progress(rid, generated[rid], now)
        elif kind == "stream":  # every request at once, some counts unchanged
            counts = []
            for other in sorted(generated):
                if (int(other[1:]) + k) % 2:
                    generated[other] += 1
                counts.append((other, generated[other], None))
            r.streamed(counts, now)
        elif kind == "finish":
            r.finished(rid, 10)
        elif kind == "scrape":
            pods.scraped(f"d{k % 3}", Gauges(k, 1, 0.1 * k, A40.kv_capacity_tokens), now)
        snap = r.snapshot(now)
        for inst in (*snap.prefill, *snap.decode):
            pod = pods.instances[inst.name]
            fresh = view(
                inst.name,
                pod.role,
                r.ledger.accounts.get(inst.name),
                pod.gauges,
                now=now,
                profile=pod.profile,
            )
            assert inst == fresh


def test_the_same_seed_decides_the_same_and_another_seed_differently() -> None:
    def decisions(seed: int) -> list[str]:
        r = router("random", seed=seed, late=False)
        return [r.route(Request(f"r{i}", 300, CHAT), 0.0).decision.decode for i in range(40)]

    assert decisions(1) == decisions(1)
    assert decisions(1) != decisions(2)
