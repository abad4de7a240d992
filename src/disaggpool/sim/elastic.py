"""An autoscaler acting on a simulated pool: decode pods that start, serve, drain and stop.

`ElasticController` is the simulator's `Controller`: every `period_s` it reads the window of
recent traffic (`core.demand`) and the decode pool's gauges, asks an autoscaler (`core.autoscaling`
or a baseline of `core.autoscaling_baselines`) for a replica count and carries it out as Kubernetes
would:

* a pod asked for starts after `startup_s` (image pull, engine load, the calibration probe),
  counting GPU time from the moment it is asked for; readiness is seen at the next tick;
* a pod removed first stops taking requests, finishes those it was given (a pre-stop drain), and
  stops counting once empty; a pod asked back while draining serves again at once (it is loaded);
  a pod still starting is cancelled first;
* the autoscaler acts from the first tick after its window is full; `remember` gives it the
  traffic of before the run, as a deployed one has (otherwise it waits `window_s`).

It records the GPU-seconds of every pod (prefill pods run the whole time), each change of the
replica count, and a timeline of serving / starting / draining pods for the plots.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from disaggpool.core.autoscaling import PoolState
from disaggpool.core.autoscaling_baselines import Autoscaler
from disaggpool.core.contracts import SLOClass
from disaggpool.core.demand import DemandWindow
from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.request import EngineRequest
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.cluster import Simulation

__all__ = ["ElasticController", "Timeline"]


@dataclasses.dataclass(slots=True)
class Timeline:
    """What the controller saw and did, one point per tick."""

    t: list[float] = dataclasses.field(default_factory=list)
    serving: list[int] = dataclasses.field(default_factory=list)
    starting: list[int] = dataclasses.field(default_factory=list)
    draining: list[int] = dataclasses.field(default_factory=list)
    rate_rps: list[float] = dataclasses.field(default_factory=list)


class ElasticController:
    """Runs `autoscaler` over the decode instances of one `Simulation` (module docstring)."""

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
    ) -> None:
        """`decode_names`: every decode instance the pool may run, those serving at first first
        (the order pods are started in); `window`: what the autoscaler reads (default: a 60 s
        window, bursts over 600 s)."""
        self.autoscaler = autoscaler
        self.names = list(decode_names)
        self.believed = dict(believed)
        self.slo_classes = dict(slo_classes)
        self.prefill_pods = prefill_pods
        self.startup_s = startup_s
        self.period_s = period_s
        self.window = window or DemandWindow()
        self.sim: Simulation | None = None
        self._ready_at: dict[str, float] = {}  # starting pods
        # In the order they started draining (a dict, not a set: runs must not depend on the
        # process's string hashing).
        self._draining: dict[str, None] = {}
        self._last_t = 0.0
        self.gpu_s = 0.0
        self.decode_gpu_s = 0.0
        self.scale_events = 0
        self.reasons: list[tuple[float, int, str]] = []
        self.timeline = Timeline()

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
    def _serving(self) -> list[str]:
        assert self.sim is not None
        return [d.name for d in self.sim.serving]

    def _account(self, now: float) -> None:
        decode = len(self._serving()) + len(self._ready_at) + len(self._draining)
        dt = max(0.0, now - self._last_t)
        self.decode_gpu_s += decode * dt
        self.gpu_s += (decode + self.prefill_pods) * dt
        self._last_t = now

    def tick(self, now: float) -> None:
        sim = self.sim
        assert sim is not None, "attach the controller to its simulation first"
        self._account(now)
        for name in [n for n, t in self._ready_at.items() if t <= now]:
            del self._ready_at[name]
            sim.serve(name)
        for name in [n for n in self._draining if sim.drained(n)]:
            del self._draining[name]
        demand = self.window.demand(now)
        self._record(now, demand.arrival_rps)
        if demand.window_s < self.window.window_s:  # a young window: not enough to act on
            return
        serving = sim.serving
        kv = [d.observe(now)[0] for d in serving]  # KV tokens in use, one observation each
        state = PoolState(
            ready=len(serving),
            starting=len(self._ready_at),
            waiting=sum(d.num_waiting for d in serving),
            running=sum(d.num_running for d in serving),
            kv_usage=sum(
                k / d.profile.kv_capacity_tokens for d, k in zip(serving, kv, strict=True)
            ),
            step_s=tuple(
                self.believed[d.name].decode.step(d.num_running, k)
                for d, k in zip(serving, kv, strict=True)
            ),
        )
        decision = self.autoscaler.decide(demand, state)
        if decision.replicas != state.current:
            self.scale_events += 1
            self.reasons.append((now, decision.replicas, decision.reason))
            self._scale_to(decision.replicas, now)

    def _scale_to(self, target: int, now: float) -> None:
        sim = self.sim
        assert sim is not None
        current = len(self._serving()) + len(self._ready_at)
        while current < target:
            if self._draining:  # loaded already: the last one drained serves again at once
                name = next(reversed(self._draining))
                del self._draining[name]
                sim.serve(name)
            else:
                idle = [n for n in self.names if self._off(n)]
                if not idle:
                    return
                self._ready_at[idle[0]] = now + self.startup_s
            current += 1
        while current > target:
            if self._ready_at:  # the newest pod still starting is cancelled first
                del self._ready_at[max(self._ready_at, key=lambda n: self._ready_at[n])]
            else:
                serving = self._serving()
                if len(serving) <= 1:
                    return
                # The pod with the least left to finish drains fastest.
                name = min(serving, key=lambda n: sim.bound(n))
                sim.drain(name)
                self._draining[name] = None
            current -= 1

    def _off(self, name: str) -> bool:
        busy = self._ready_at.keys() | self._draining
        return name not in busy and name not in self._serving()

    def _record(self, now: float, rate: float) -> None:
        tl = self.timeline
        tl.t.append(now)
        tl.serving.append(len(self._serving()))
        tl.starting.append(len(self._ready_at))
        tl.draining.append(len(self._draining))
        tl.rate_rps.append(rate)

    def close(self, now: float) -> None:
        """The run ended at `now`: account the last interval."""
        self._account(now)
