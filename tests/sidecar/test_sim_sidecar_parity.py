"""One scorer, everywhere: the decisions the simulator made are the decisions the sidecar makes.

A simulation records every (request, pool snapshot) it routed and what its policy chose; a
sidecar `RoutingService` configured with the same policy name and seed is then handed the very
same inputs and must choose the same pods, decision by decision (same policy objects from the same
registry, same seeded RNG stream). Then the sidecar's own snapshot builder is checked against the
simulator's meaning for the router's accounting: routed requests, queued prompt tokens (and
squares), TPOT targets.
"""

from __future__ import annotations

import random

import pytest

from disaggpool.core.contracts import PoolSnapshot, RequestFeatures, RouteDecision, SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import make_policy
from disaggpool.core.predictor import make_predictor
from disaggpool.formats.traces import TraceRequest
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.service import RoutingService
from disaggpool.sim.cluster import Simulation
from disaggpool.sim.pools import build_pool

A40 = builtin_profile("a40-llama3-8b")
SLO = SLOClass("chat", 2.0, 0.07)


class Recording:
    """Wraps a policy and keeps every call (the snapshot objects are immutable)."""

    def __init__(self, name: str) -> None:
        self.inner = make_policy(name)
        self.name = self.inner.name
        self.calls: list[tuple[RequestFeatures, PoolSnapshot, RouteDecision]] = []

    def route(self, req: RequestFeatures, pool: PoolSnapshot, rng: random.Random) -> RouteDecision:
        decision = self.inner.route(req, pool, rng)
        self.calls.append((req, pool, decision))
        return decision


def trace(n: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for _ in range(n):
        t += rng.expovariate(12.0)
        out.append(TraceRequest(t, rng.randint(20, 3000), rng.randint(5, 400), "chat"))
    return out


@pytest.mark.parametrize("policy", ["calibrated", "least_loaded", "length", "p2c", "random"])
def test_the_sidecar_decides_what_the_simulator_decided(policy: str) -> None:
    specs = build_pool(2, 6, A40, seed=4)
    recorder = Recording(policy)
    sim = Simulation(
        specs,
        policy=recorder,
        predictor=make_predictor("online"),
        slo_classes={"chat": SLO},
        default_class="chat",
        seed=11,
    )
    sim.run(trace(400, seed=5))
    assert len(recorder.calls) == 400

    static = {
        role: [{"name": s.name, "url": f"http://{s.name}"} for s in specs if s.role == role]
        for role in ("prefill", "decode")
    }
    cfg = parse_config(
        {
            "policy": policy,
            "model": "m",
            "pool": {"static": static},
            "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.07}],
        }
    )
    service = RoutingService(cfg, seed=11)
    # The simulator's RNG also fed its predictor; the online predictor draws nothing from it.
    same = [
        service.policy.route(req, pool, service.rng) == decision
        for req, pool, decision in recorder.calls
    ]
    assert all(same), f"{same.count(False)} of {len(same)} decisions differ"


def test_the_sidecar_books_requests_as_the_simulator_does() -> None:
    specs = build_pool(1, 2, A40, seed=4)
    static = {
        role: [{"name": s.name, "url": f"http://{s.name}"} for s in specs if s.role == role]
        for role in ("prefill", "decode")
    }
    cfg = parse_config(
        {
            "policy": "round_robin",
            "model": "m",
            "pool": {"static": static},
            "slo_classes": [{"name": "chat", "ttft_s": 2.0, "tpot_s": 0.07}],
        }
    )
    service = RoutingService(cfg, seed=0, clock=lambda: 0.0)
    service.state.set_members(cfg.static_members)
    prompts = [300, 1200, 50, 700]
    for i, n in enumerate(prompts):
        service.route(f"r{i}", n)
    snap = service.state.snapshot(0.0)
    (p,) = snap.prefill
    # Nothing prefilled yet: every prompt queues at the prefill pod, as RouterState.routed books it.
    assert (p.inflight, p.queued, p.queued_tokens) == (4, 4, sum(prompts))
    assert p.queued_sq_tokens == sum(n * n for n in prompts)
    by_pod = {d.name: d for d in snap.decode}
    assert sum(d.inflight for d in by_pod.values()) == 4
    assert sum(d.queued_tokens for d in by_pod.values()) == sum(prompts)
    assert all(d.tpot_targets == ((0.07, d.inflight),) for d in by_pod.values())
