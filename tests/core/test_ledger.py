"""The router's ledger on its own: late binding and the local path keep the books, any sequence of
reports returns them to zero, and `view` combines gauges and books by its written rule."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from disaggpool.core.contracts import SLOClass, TpotBudgets
from disaggpool.core.ledger import BUDGETS_REFRESH_S, Entry, Gauges, Ledger, budgets, view

SLO = SLOClass("c", 1.0, 0.1)


def entry(rid: str, p: str | None = "p0", d: str | None = "d0", n: int = 100) -> Entry:
    return Entry(rid, p, d, n, 50.0, SLO, routed_at=0.0)


def zero(ledger: Ledger) -> bool:
    return all(
        (a.inflight, a.queued, a.queued_tokens, a.decoding, a.local_tokens, a.targets, a.first_due)
        == (0, 0, 0, 0, 0, {}, {})
        and a.yielded_tokens == 0
        and a.upstream == 0
        and abs(a.predicted_left) < 1e-6
        and abs(a.queued_sq_tokens) < 1e-6
        and abs(a.yielded_sq_tokens) < 1e-6
        and abs(a.local_sq_tokens) < 1e-6
        for a in ledger.accounts.values()
    )


def test_late_binding_books_decode_only_when_bound() -> None:
    led = Ledger()
    led.routed(entry("a", d=None))
    assert led.accounts["p0"].queued_tokens == 100 and "d0" not in led.accounts
    led.prefilled("a")
    assert led.bind_decode("a", "d1") is not None
    d1 = led.accounts["d1"]
    assert (d1.inflight, d1.queued, d1.queued_tokens, d1.predicted_left) == (1, 1, 100, 50.0)
    led.progress("a", 5, 1.0)
    assert (d1.queued, d1.decoding, d1.predicted_left) == (0, 1, 45.0)
    led.finished("a")
    assert zero(led) and led.bind_decode("a", "d1") is None


def test_the_decode_kv_of_requests_not_bound_yet_is_kept_for_the_pool() -> None:
    """Prompt plus predicted output (100 + 50) of each request in the prefill pool without a
    decode instance, until it is bound or leaves."""
    led = Ledger()
    led.routed(entry("a", d=None))
    led.routed(entry("b", d=None, n=300))
    led.routed(entry("c"))  # bound at arrival: its decode account holds it
    assert led.unbound_kv_tokens == 150.0 + 350.0
    led.prefilled("a")
    assert led.unbound_kv_tokens == 500.0  # answered, but not bound yet
    led.bind_decode("a", "d1")
    assert led.unbound_kv_tokens == 350.0
    led.finished("b")  # failed before its decode pod was chosen
    assert led.unbound_kv_tokens == 0.0


def test_local_path_books_the_prompt_on_the_decode_instance() -> None:
    led = Ledger()
    led.routed(entry("a", p=None, n=300))
    assert led.entries["a"].prefilled  # no prefill leg to wait for
    d0 = led.accounts["d0"]
    assert (d0.local_tokens, d0.local_sq_tokens, d0.queued_tokens) == (300, 90_000.0, 300)
    snap = view("d0", "decode", d0, None)
    assert (snap.local_prefill_tokens, snap.local_prefill_sq_tokens) == (300, 90_000.0)
    led.progress("a", 1, 1.0)  # its first token: the prompt is computed
    assert (d0.local_tokens, d0.decoding) == (0, 1)
    led.finished("a")
    assert zero(led)


def test_view_raises_gauges_to_the_books_and_counts_each_prompt_once() -> None:
    led = Ledger()
    for i in range(3):
        led.routed(entry(f"r{i}"))
    led.progress("r0", 2, 1.0)
    gauges = Gauges(running=0, waiting=1, kv_usage=0.25, kv_capacity_tokens=4000)
    d0 = view("d0", "decode", led.accounts["d0"], gauges)
    assert (d0.running, d0.waiting) == (1, 2)  # our own counts beat a stale scrape
    # r0 decodes since the scrape: its prompt is on top of the scraped KV; r1 and r2 wait, and
    # are counted as queued tokens only (the cost model adds the two).
    assert (d0.kv_tokens_used, d0.queued_tokens) == (1000 + 100, 200)
    led.scraped("d0")
    assert view("d0", "decode", led.accounts["d0"], gauges).kv_tokens_used == 1000
    p0 = view("p0", "prefill", led.accounts["p0"], None)
    assert (p0.queued, p0.queued_tokens) == (2, 200)  # r0's prefill was done by its first token
    led.progress("r1", 1, 2.0)
    assert view("d0", "decode", led.accounts["d0"], gauges).kv_tokens_used == 1000 + 100
    led.finished("r2")  # never decoded: its KV was never taken
    assert view("d0", "decode", led.accounts["d0"], gauges).kv_tokens_used == 1000 + 100


def test_foreign_is_what_the_scrape_showed_beyond_ours_then() -> None:
    led = Ledger()
    for i in range(3):
        led.routed(entry(f"r{i}"))
    busy = Gauges(running=1, waiting=4, kv_usage=0.0, kv_capacity_tokens=0)
    led.scraped("p0")
    assert view("p0", "prefill", led.accounts["p0"], busy).foreign == 2  # 5 there, 3 ours
    # Two of ours answer: the stale gauges still show them, but they are not another's work.
    led.prefilled("r0")
    led.prefilled("r1")
    p0 = view("p0", "prefill", led.accounts["p0"], busy)
    assert (p0.queued, p0.foreign) == (1, 2)
    led.scraped("p0")  # ... until the next scrape, which counts only what is there now
    assert view("p0", "prefill", led.accounts["p0"], busy).foreign == 4


def test_a_decode_instance_holds_our_requests_only_once_their_prefill_answered() -> None:
    led = Ledger()
    led.routed(entry("a"))  # bound to d0 at arrival, its prefill leg still running
    led.routed(entry("b"))
    led.prefilled("a")
    assert led.accounts["d0"].upstream == 1
    led.scraped("d0")  # the engine holds `a` (pulling its KV) but not yet `b`
    one = Gauges(running=1, waiting=0, kv_usage=0.0, kv_capacity_tokens=0)
    assert view("d0", "decode", led.accounts["d0"], one).foreign == 0
    two = Gauges(running=1, waiting=1, kv_usage=0.0, kv_capacity_tokens=0)
    assert view("d0", "decode", led.accounts["d0"], two).foreign == 1  # someone else's
    led.finished("a")
    assert view("d0", "decode", led.accounts["d0"], two).foreign == 1  # a's exit is ours


ops = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive_late", "arrive_local", "bind", "prefilled", "token",
                         "finish"]),
        st.integers(0, 5),
        st.integers(1, 300),
    ),
    max_size=60,
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(ops)
def test_any_sequence_of_reports_returns_the_books_to_zero(seq: list[tuple[str, int, int]]) -> None:
    led = Ledger()
    for op, i, n in seq:
        rid = f"r{i}"
        if op.startswith("arrive") and rid not in led.entries:
            p = None if op == "arrive_local" else "p0"
            d = None if op == "arrive_late" else f"d{i % 2}"
            led.routed(Entry(rid, p, d, n, n / 3, SLO, 0.0, priority=i % 2))
        elif op == "bind" and rid in led.entries and led.entries[rid].decode is None:
            led.bind_decode(rid, "d1")
        elif op == "prefilled":
            led.prefilled(rid)
        elif op == "token":
            led.progress(rid, n, 1.0)
        elif op == "finish":
            led.finished(rid)
        for acc in led.accounts.values():
            assert acc.inflight >= 0 and acc.queued >= 0 and acc.queued_tokens >= 0
            assert 0 <= acc.yielded_tokens <= acc.queued_tokens
            assert acc.local_tokens >= 0 and acc.decoding >= 0
            assert 0 <= acc.upstream <= acc.inflight
            assert acc.predicted_left >= -1e-6
        unbound = [e for e in led.entries.values() if e.decode is None]
        assert led.unbound_kv_tokens == pytest.approx(
            sum(e.prompt_tokens + e.predicted_output for e in unbound)
        )
    for rid in list(led.entries):
        led.finished(rid)
    assert zero(led) and led.unbound_kv_tokens == 0.0


def test_budgets_shrink_as_a_request_falls_behind() -> None:
    """Target 0.1 s per token, 50 predicted: after 10 tokens in 1.0 s (first at 0.0) its 40
    remaining tokens may take (0.1 * 49 - 1.0) / 40 = 97.5 ms each; a queued one affords 0.1 s."""
    led = Ledger()
    led.routed(Entry("a", "p0", "d0", 100, 50.0, SLO, 0.0))
    led.routed(Entry("b", "p0", "d0", 100, 50.0, SLO, 0.0))
    led.progress("a", 10, now=1.0, first_token_at=0.0)
    assert view("d0", "decode", led.accounts["d0"], None, now=1.0).tpot_budgets.groups() == [
        (0.0975, 32, 1),  # 40 tokens left: 32, a power of two
        (0.1, 32, 1),
    ]
    # two seconds on, still at 10 tokens: a stall has eaten half of its slack
    later = view("d0", "decode", led.accounts["d0"], None, now=3.0).tpot_budgets
    assert later.groups()[0] == (0.0475, 32, 1)
    assert (later.between(0.0, 0.05), later.between(0.05, 1.0), later.between(0.1, 0.1)) == (
        1,
        1,
        0,
    )


def test_budgets_are_reused_briefly_and_rebuilt_when_a_request_joins_or_ages() -> None:
    """Within BUDGETS_REFRESH_S of the last pass an account's budgets are reused (token progress
    alone does not rebuild them); a request joining, or time past the window, rebuilds them."""
    led = Ledger()
    led.routed(Entry("a", "p0", "d0", 100, 50.0, SLO, 0.0))
    led.progress("a", 10, now=1.0, first_token_at=0.0)
    acc = led.accounts["d0"]
    first = budgets(acc, 1.0)
    assert first.groups() == [(0.0975, 32, 1)]
    led.progress("a", 11, now=1.0 + BUDGETS_REFRESH_S / 2, first_token_at=0.0)
    assert budgets(acc, 1.0 + BUDGETS_REFRESH_S / 2) is first
    # past the window: a rebuild, with the 11th token counted ((0.1 * 49 - 1.002) / 39 s)
    aged = budgets(acc, 1.0 + 2 * BUDGETS_REFRESH_S)
    assert aged is not first and aged.groups() == [(0.1, 32, 1)]
    led.routed(Entry("b", "p0", "d0", 100, 50.0, SLO, 0.0))
    joined = budgets(acc, 1.0 + 2 * BUDGETS_REFRESH_S)
    assert joined is not aged and joined.groups() == [(0.1, 32, 2)]
    # time running backwards (another replica's clock) never reuses
    assert budgets(acc, 0.5) is not joined


def test_ttft_slack_of_the_requests_not_decoding_yet() -> None:
    led = Ledger()
    led.routed(Entry("a", "p0", "d0", 100, 50.0, SLO, routed_at=0.0))  # first token due at 1.0
    led.routed(Entry("b", "p0", "d0", 100, 50.0, SLO, routed_at=0.5))  # due at 1.5
    led.routed(Entry("c", "p0", "d0", 100, 50.0, SLO, routed_at=0.2))  # due at 1.2
    assert view("d0", "decode", led.accounts["d0"], None, now=0.9).ttft_slack_s == (
        pytest.approx(0.1),
        pytest.approx(0.3),
        pytest.approx(0.6),
    )
    led.progress("c", 1, now=1.0)  # decoding: its first token is no longer due
    led.finished("a")
    assert view("d0", "decode", led.accounts["d0"], None, now=1.6).ttft_slack_s == (
        pytest.approx(-0.1),
    )


def test_work_routed_with_a_priority_is_booked_as_yielded_until_prefilled() -> None:
    led = Ledger()
    led.routed(entry("on-time", n=100))
    led.routed(Entry("late", "p0", "d0", 300, 50.0, SLO, routed_at=0.0, priority=1))
    p0 = led.accounts["p0"]
    snap = view("p0", "prefill", p0, None)
    assert (snap.queued_tokens, snap.yielded_tokens) == (400, 300)
    assert (snap.queued_sq_tokens, snap.yielded_sq_tokens) == (100_000.0, 90_000.0)
    led.prefilled("late")
    assert (p0.queued_tokens, p0.yielded_tokens, p0.yielded_sq_tokens) == (100, 0, 0.0)
    led.finished("late")
    led.finished("on-time")
    assert zero(led)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.tuples(st.floats(-1.0, 1.0, allow_nan=False), st.sampled_from([1, 2, 4, 64])),
        st.integers(1, 9),
        max_size=40,
    )
)
def test_budgets_from_counts_are_budgets_from_their_groups(
    counts: dict[tuple[float, int], int],
) -> None:
    groups = [(b, r, n) for (b, r), n in counts.items()]
    assert TpotBudgets.of_counts(counts) == TpotBudgets.of(groups)
