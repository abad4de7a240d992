"""The sidecar's pool state over the shared ledger: every lifecycle returns the counters to zero,
cached views are never stale, members leave only when their requests are done."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from disaggpool.core.contracts import SLOClass
from disaggpool.core.ledger import Entry, Gauges, view
from disaggpool.sidecar.config import Member
from disaggpool.sidecar.state import Instance, PoolState

SLO = SLOClass("c", 1.0, 0.1)
MEMBERS = [
    Member("p0", "prefill", "http://p0"),
    Member("d0", "decode", "http://d0"),
    Member("d1", "decode", "http://d1"),
]


def record(rid: str, p: str = "p0", d: str = "d0", n: int = 100, out: float = 50.0) -> Entry:
    return Entry(rid, p, d, n, out, SLO, routed_at=0.0)


def zeroed(state: PoolState) -> bool:
    return all(
        (a.inflight, a.queued, a.queued_tokens, a.queued_sq_tokens, a.decoding, a.targets)
        == (0, 0, 0, 0.0, 0, {})
        and abs(a.predicted_left) < 1e-6
        for a in state.ledger.accounts.values()
    )


def fresh_view(state: PoolState, inst: Instance) -> object:
    return view(
        inst.name,
        inst.role,
        state.ledger.accounts.get(inst.name),
        inst.gauges,
        healthy=inst.healthy,
        profile=inst.profile,
    )


def test_lifecycle_and_snapshot() -> None:
    s = PoolState()
    assert s.set_members(MEMBERS) == (["p0", "d0", "d1"], [])
    s.scraped("d0", Gauges(running=3, waiting=0, kv_usage=0.5, kv_capacity_tokens=1000), 0.0)
    s.routed(record("a"))
    snap = s.snapshot(1.0)
    p0, d0 = snap.prefill[0], snap.decode[0]
    assert (p0.queued, p0.queued_tokens, p0.queued_sq_tokens) == (1, 100, 10000.0)
    assert (d0.inflight, d0.queued, d0.queued_tokens) == (1, 1, 100)
    assert d0.kv_tokens_used == 500  # the routed prompt counts as queued there, not as its KV
    assert d0.running == 3 and d0.remaining_output_tokens == 50.0
    assert d0.tpot_budgets.groups() == [(0.1, 32, 1)]  # 50 predicted tokens: 32, a power of two
    s.prefilled("a")
    s.progress("a", 10, 2.0)
    d0 = s.snapshot(2.0).decode[0]
    assert (d0.queued, d0.queued_tokens, d0.remaining_output_tokens) == (0, 0, 40.0)
    assert d0.kv_tokens_used == 500 + 100  # scraped + the prompt decoding since the scrape
    assert s.snapshot(2.0).prefill[0].queued == 0
    s.progress("a", 70, 2.0)  # past the prediction: nothing negative
    assert s.snapshot(2.0).decode[0].remaining_output_tokens == 1.0  # one sequence decoding
    assert s.finished("a") is not None
    assert zeroed(s) and s.finished("a") is None


def test_removed_member_stays_until_its_requests_finish() -> None:
    s = PoolState()
    s.set_members(MEMBERS)
    s.routed(record("a", d="d1"))
    assert s.set_members(MEMBERS[:2]) == ([], ["d1"])
    assert [i.name for i in s.snapshot(0).decode] == ["d0"]  # no new work goes there
    assert "d1" in s.instances
    s.finished("a")
    assert "d1" not in s.instances


def test_new_url_behind_a_name_forgets_the_old_pod() -> None:
    s = PoolState()
    s.set_members(MEMBERS)
    s.unreachable("d0")
    assert not s.instances["d0"].healthy
    s.set_members([MEMBERS[0], dataclasses.replace(MEMBERS[1], url="http://new"), MEMBERS[2]])
    assert s.instances["d0"].healthy and s.instances["d0"].member.url == "http://new"


def test_expiry_forgets_unreported_requests() -> None:
    s = PoolState()
    s.set_members(MEMBERS)
    s.routed(record("old"))
    s.routed(dataclasses.replace(record("new"), routed_at=100.0))
    assert [r.request_id for r in s.expired(now=150.0, ttl=60.0)] == ["old"]
    assert list(s.ledger.entries) == ["new"]


ops = st.lists(
    st.tuples(
        st.sampled_from(["route", "prefilled", "progress", "finish"]),
        st.integers(0, 7),
        st.integers(1, 400),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_any_interleaving_returns_to_zero(seq: list[tuple[str, int, int]]) -> None:
    s = PoolState()
    s.set_members(MEMBERS)
    for op, i, n in seq:
        rid = f"r{i}"
        if op == "route" and not s.is_inflight(rid):
            s.routed(record(rid, d="d0" if i % 2 else "d1", n=n, out=n / 3))
        elif op == "prefilled":
            s.prefilled(rid)
        elif op == "progress":
            s.progress(rid, n, 0.0)
        elif op == "finish":
            s.finished(rid)
        for inst in s.snapshot(0).decode + list(s.snapshot(0).prefill):
            assert inst.inflight >= 0 and inst.queued >= 0 and inst.queued_tokens >= 0
            assert inst.remaining_output_tokens >= -1e-6
        for live in s.instances.values():  # a cached view is never stale
            assert live.view is None or live.view == fresh_view(s, live)
    for rid in list(s.ledger.entries):
        s.finished(rid)
    assert zeroed(s)
