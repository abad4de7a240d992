"""Autoscalers acting on a simulated pool: pods that start, serve, drain and stop.

`ElasticController` is the simulator's `Controller`: every `period_s` it reads the window of
recent traffic (`core.demand`) and each scaled role's gauges, asks that role's autoscaler
(`core.autoscaling` or a baseline of `core.autoscaling_baselines`) for a replica count and carries
it out as Kubernetes would. Decode is always scaled; prefill when a prefill autoscaler is given
(else its pods run the whole time). Both roles' pods follow the same rules (`RolePods`):

* a pod asked for starts after `startup_s` (image pull, engine load, the calibration probe),
  counting GPU time from the moment it is asked for; readiness is seen at the next tick;
* a pod removed first stops taking requests, finishes those it was given (a pre-stop drain; a
  prefill pod until decode has pulled their KV), and stops counting once empty; a pod asked back
  while draining serves again at once (it is loaded); a pod still starting is cancelled first;
* the autoscalers act from the first tick after the window is full; `remember` gives them the
  traffic of before the run, as a deployed one has (otherwise they wait `window_s`). Both read
  the same demand window.

It records the GPU-seconds of every pod, each change of a replica count, and a timeline of
serving / starting / draining pods of each role for the plots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from disaggpool.core.autoscaling import PoolState
from disaggpool.core.autoscaling_baselines import Autoscaler
from disaggpool.core.contracts import Role, SLOClass
from disaggpool.core.demand import Demand, DemandWindow
from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.request import EngineRequest
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.cluster import Simulation

__all__ = ["ElasticController", "RolePods", "Timeline"]


@dataclasses.dataclass(slots=True)
class Timeline:
    """What the controller saw and did, one point per tick (`serving`, `starting`, `draining`:
    decode pods)."""

    t: list[float] = dataclasses.field(default_factory=list)
    serving: list[int] = dataclasses.field(default_factory=list)
    starting: list[int] = dataclasses.field(default_factory=list)
    draining: list[int] = dataclasses.field(default_factory=list)
    rate_rps: list[float] = dataclasses.field(default_factory=list)
    prefill_serving: list[int] = dataclasses.field(default_factory=list)
    prefill_starting: list[int] = dataclasses.field(default_factory=list)
    prefill_draining: list[int] = dataclasses.field(default_factory=list)


class RolePods:
    """The pods of one role under an autoscaler: which start when, which drain, which serve
    (module docstring). Serving is what the simulation routes to; the rest is kept here."""

    def __init__(self, role: Role, names: Sequence[str], startup_s: float) -> None:
        """`names`: every pod of the role the pool may run, those serving at first first (the
        order pods are started in)."""
        self.role = role
        self.names = list(names)
        self.startup_s = startup_s
        self.ready_at: dict[str, float] = {}  # starting pods
        # In the order they started draining (a dict, not a set: runs must not depend on the
        # process's string hashing).
        self.draining: dict[str, None] = {}
        self.gpu_s = 0.0
        self.scale_events = 0

    def serving(self, sim: Simulation) -> list[str]:
        engines = sim.serving_prefill if self.role == "prefill" else sim.serving
        return [e.name for e in engines]

    def running(self, sim: Simulation) -> int:
        """Pods that cost GPU time now: serving, starting or draining."""
        return len(self.serving(sim)) + len(self.ready_at) + len(self.draining)

    def settle(self, sim: Simulation, now: float) -> None:
        """Pods whose cold start is over serve; drained pods stop."""
        for name in [n for n, t in self.ready_at.items() if t <= now]:
            del self.ready_at[name]
            sim.serve(name)
        for name in [n for n in self.draining if sim.drained(n)]:
            del self.draining[name]

    def scale_to(self, sim: Simulation, target: int, now: float) -> None:
        current = len(self.serving(sim)) + len(self.ready_at)
        while current < target:
            if self.draining:  # loaded already: the last one drained serves again at once
                name = next(reversed(self.draining))
                del self.draining[name]
                sim.serve(name)
            else:
                idle = [n for n in self.names if self._off(sim, n)]
                if not idle:
                    return
                self.ready_at[idle[0]] = now + self.startup_s
            current += 1
        while current > target:
            if self.ready_at:  # the newest pod still starting is cancelled first
                del self.ready_at[max(self.ready_at, key=lambda n: self.ready_at[n])]
            else:
                serving = self.serving(sim)
                if len(serving) <= 1:
                    return
                # The pod with the least left to finish drains fastest.
                name = min(serving, key=lambda n: sim.bound(n))
                sim.drain(name)
                self.draining[name] = None
            current -= 1

    def _off(self, sim: Simulation, name: str) -> bool:
        busy = self.ready_at.keys() | self.draining
        return name not in busy and name not in self.serving(sim)


class ElasticController:
    """Runs `autoscaler` over the decode instances of one `Simulation`, and `prefill_autoscaler`
    (when given) over its prefill instances (module docstring)."""

    def __init__(
        self,
        autoscaler: Autoscaler,
        decode_names: Sequence[str],
        believed: Mapping[str, CalibrationProfile],
        slo_classes: Mapping[str, SLOClass],
        *,
        prefill_pods: int,
        startup_s: float,
        period_s: float = 5.0,
        window: DemandWindow | None = None,
        prefill_autoscaler: Autoscaler | None = None,
        prefill_names: Sequence[str] = (),
    ) -> None:
        """`decode_names`: every decode instance the pool may run, those serving at first first
        (the order pods are started in); `window`: what the autoscalers read (default: a 60 s
        window, bursts over 600 s). `prefill_pods`: the prefill pods that run throughout when
        prefill is not scaled; `prefill_autoscaler` scales `prefill_names` (as `decode_names`)
        instead."""
        if prefill_autoscaler is not None and not prefill_names:
            raise ValueError("a prefill autoscaler needs the prefill pods it may run")
        self.autoscaler = autoscaler
        self.decode = RolePods("decode", decode_names, startup_s)
        self.prefill_autoscaler = prefill_autoscaler
        self.prefill = RolePods("prefill", prefill_names, startup_s) if prefill_autoscaler else None
        self.believed = dict(believed)
        self.slo_classes = dict(slo_classes)
        self.prefill_pods = prefill_pods
        self.startup_s = startup_s
        self.period_s = period_s
        self.window = window or DemandWindow()
        self.sim: Simulation | None = None
        self._last_t = 0.0
        self.gpu_s = 0.0
        self.decode_gpu_s = 0.0
        self.prefill_gpu_s = 0.0
        # (time, replicas, reason), the reason led by the role ("decode: ...", "prefill: ...").
        self.reasons: list[tuple[float, int, str]] = []
        self.timeline = Timeline()

    @property
    def scale_events(self) -> int:
        """Changes of a replica count, both roles."""
        return self.decode.scale_events + (self.prefill.scale_events if self.prefill else 0)

    def attach(self, sim: Simulation) -> None:
        self.sim = sim

    def remember(self, history: Sequence[TraceRequest]) -> None:
        """Traffic from before the run (negative arrivals): into the window, as a router that
        has been running has it; not simulated. Its completions give the mix, at no latency."""
        for r in history:
            self.window.arrived(r.arrival_s)
            self.window.finished(r.arrival_s, r.prompt_tokens, r.output_tokens, 0.0, 0.0)

    # ------------------------------------------------------------------ what the router sees
    def arrived(self, req: EngineRequest, now: float) -> None:
        """`req` arrived and was routed (its prediction and, if it was not shed, its pods set)."""
        self.window.arrived(now)
        if not req.shed:
            local = not req.prefill_instance
            self.window.admitted(now, req.prompt_tokens, req.predicted_output, local=local)

    def finished(self, req: EngineRequest, now: float) -> None:
        slo = self.slo_classes[req.slo_class]
        self.window.finished(
            now, req.prompt_tokens, req.output_tokens, req.ttft / slo.ttft_s, req.tpot / slo.tpot_s
        )

    # ------------------------------------------------------------------ acting
    def _account(self, now: float) -> None:
        sim = self.sim
        assert sim is not None
        decode = self.decode.running(sim)
        prefill = self.prefill.running(sim) if self.prefill else self.prefill_pods
        dt = max(0.0, now - self._last_t)
        self.decode_gpu_s += decode * dt
        self.prefill_gpu_s += prefill * dt
        self.gpu_s += (decode + prefill) * dt
        self._last_t = now

    def tick(self, now: float) -> None:
        sim = self.sim
        assert sim is not None, "attach the controller to its simulation first"
        self._account(now)
        self.decode.settle(sim, now)
        if self.prefill:
            self.prefill.settle(sim, now)
        demand = self.window.demand(now)
        self._record(sim, now, demand.arrival_rps)
        if demand.window_s < self.window.window_s:  # a young window: not enough to act on
            return
        self._decide(self.autoscaler, self.decode, demand, self._decode_state(sim, now), now)
        if self.prefill_autoscaler and self.prefill:
            state = self._prefill_state(sim)
            self._decide(self.prefill_autoscaler, self.prefill, demand, state, now)

    def _decide(
        self, scaler: Autoscaler, pods: RolePods, demand: Demand, state: PoolState, now: float
    ) -> None:
        sim = self.sim
        assert sim is not None
        decision = scaler.decide(demand, state)
        if decision.replicas != state.current:
            pods.scale_events += 1
            self.reasons.append((now, decision.replicas, f"{pods.role}: {decision.reason}"))
            pods.scale_to(sim, decision.replicas, now)

    def _decode_state(self, sim: Simulation, now: float) -> PoolState:
        serving = sim.serving
        kv = [d.observe(now)[0] for d in serving]  # KV tokens in use, one observation each
        return PoolState(
            ready=len(serving),
            starting=len(self.decode.ready_at),
            waiting=sum(d.num_waiting for d in serving),
            deferred=sum(d.num_deferred for d in serving),
            running=sum(d.num_running for d in serving),
            kv_usage=sum(
                k / d.profile.kv_capacity_tokens for d, k in zip(serving, kv, strict=True)
            ),
            step_s=tuple(
                self.believed[d.name].decode.step(d.num_running, k)
                for d, k in zip(serving, kv, strict=True)
            ),
        )

    def _prefill_state(self, sim: Simulation) -> PoolState:
        assert self.prefill is not None
        serving = sim.serving_prefill
        return PoolState(
            ready=len(serving),
            starting=len(self.prefill.ready_at),
            waiting=sum(p.num_waiting for p in serving),
            running=sum(p.num_running for p in serving),
            kv_usage=sum(p.kv_used / p.capacity for p in serving),
            # What the router's books hold for the prefill pods: prompts routed, not answered.
            queued_tokens=sum(r.prompt_tokens for p in serving for r in p.queue),
        )

    def _record(self, sim: Simulation, now: float, rate: float) -> None:
        tl = self.timeline
        tl.t.append(now)
        tl.serving.append(len(sim.serving))
        tl.starting.append(len(self.decode.ready_at))
        tl.draining.append(len(self.decode.draining))
        tl.rate_rps.append(rate)
        if self.prefill:
            tl.prefill_serving.append(len(sim.serving_prefill))
            tl.prefill_starting.append(len(self.prefill.ready_at))
            tl.prefill_draining.append(len(self.prefill.draining))
        else:
            tl.prefill_serving.append(self.prefill_pods)
            tl.prefill_starting.append(0)
            tl.prefill_draining.append(0)

    def close(self, now: float) -> None:
        """The run ended at `now`: account the last interval."""
        self._account(now)
