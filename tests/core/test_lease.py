"""The leader-election rules (`core.lease`): who may take a Lease when, what a holder writes."""

from __future__ import annotations

import datetime as dt

from disaggpool.core.lease import (
    LeaseRecord,
    LeaseTimings,
    lease_body,
    may_take,
    parse_lease,
    released,
    renewal_overdue,
    taken,
)

T = LeaseTimings(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
WALL = dt.datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=dt.UTC)


def test_a_missing_free_or_own_lease_may_be_taken_at_once() -> None:
    assert may_take(None, "a", observed_at=100.0, now=100.0)
    assert may_take(LeaseRecord(holder="", duration_s=15), "a", 100.0, 100.0)
    assert may_take(LeaseRecord(holder="a", duration_s=15), "a", 100.0, 100.0)


def test_another_holders_lease_only_once_it_ran_out_on_our_clock() -> None:
    held = LeaseRecord(holder="b", duration_s=15, renew_time="2000-01-01T00:00:00.000000Z")
    # renewTime (the holder's clock, long ago here) is never compared: only when we saw it.
    assert not may_take(held, "a", observed_at=100.0, now=114.9)
    assert may_take(held, "a", observed_at=100.0, now=115.0)


def test_the_holder_steps_down_at_the_renew_deadline_before_the_lease_ends() -> None:
    assert not renewal_overdue(last_renewed=50.0, timings=T, now=59.9)
    assert renewal_overdue(50.0, T, 60.0)
    assert T.renew_deadline_s < T.lease_duration_s and T.problems() == []


def test_timings_that_could_let_two_lead_are_named() -> None:
    assert [f for f, _ in LeaseTimings(10, 10, 2).problems()] == ["renew_deadline_s"]
    assert [f for f, _ in LeaseTimings(15, 10, 10).problems()] == ["retry_period_s"]
    assert [f for f, _ in LeaseTimings(0.5, 0.2, 0.1).problems()] == ["lease_duration_s"]


def test_taking_renewing_and_releasing_write_the_standard_fields() -> None:
    first = taken(None, "a", T, WALL)
    assert first == LeaseRecord("a", 15, "2026-01-02T03:04:05.678901Z", first.acquire_time, 0, "")
    read = LeaseRecord("a", 15, first.acquire_time, first.renew_time, 0, "41")
    later = WALL + dt.timedelta(seconds=2)
    renewed = taken(read, "a", T, later)
    assert renewed.acquire_time == first.acquire_time and renewed.transitions == 0
    assert renewed.renew_time == "2026-01-02T03:04:07.678901Z" and renewed.resource_version == "41"
    other = taken(read, "b", T, later)
    assert (other.holder, other.acquire_time, other.transitions) == ("b", renewed.renew_time, 1)
    free = released(renewed, later)
    assert (free.holder, free.duration_s) == ("", 1)
    assert taken(free, "b", T, later).transitions == 1  # taking after a release counts too


def test_the_body_is_conditional_on_the_version_read_and_reads_back() -> None:
    record = taken(LeaseRecord("b", 15, "x", "y", 3, "77"), "a", T, WALL)
    body = lease_body(record, "serving", "llama-router")
    assert body["metadata"] == {
        "name": "llama-router",
        "namespace": "serving",
        "resourceVersion": "77",
    }
    assert body["spec"]["holderIdentity"] == "a" and body["spec"]["leaseTransitions"] == 4
    assert parse_lease(body) == record
    assert "resourceVersion" not in lease_body(taken(None, "a", T, WALL), "n", "l")["metadata"]
    assert lease_body(released(record, WALL), "n", "l")["spec"]["holderIdentity"] is None
