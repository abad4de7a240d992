"""Discrete-event simulator of one disaggregated pool: arrival, router, prefill, KV, decode.

The event engine knows only time and wake-ups: every engine model (`engine.prefill`,
`engine.decode`) tells when it next needs attention, and the loop calls it then. Arrivals are
merged in from the (sorted) trace rather than pushed on the heap. At equal times engine wake-ups
run before arrivals, and wake-ups in instance order, so that the router sees up-to-date state and
runs are deterministic; a stale wake-up (the engine rescheduled since) is skipped by its version.

Routing is done by the production router, `core.router.Router`, one per router replica
(`sim.router.RouterReplica`, which tells it what a sidecar would observe of the engines): the
loop hands it each arrival, each prefill leg that answers (late binding: it chooses the decode
instance then) and each end, and does what it decided. What the router knows is part of the
scenario (`RouterOptions`): how stale its scraped gauges are, how many router replicas share
the arrivals and whether they share their books (`sim.book_bus`), and whether the decode
instance is chosen at arrival or when the prefill leg returns (late binding, as the sidecar's
front door can). The output-length predictor
learns from completions as it would in production.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Mapping, Sequence
from typing import Protocol, TypeVar

from disaggpool.core.contracts import Role, SLOClass
from disaggpool.core.policies.base import Policy
from disaggpool.core.predictor import OutputPredictor
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.router import Request
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.request import EngineRequest, SchedulingPolicy
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim.book_bus import BookBus
from disaggpool.sim.router import RouterReplica

__all__ = ["Controller", "InstanceSpec", "RouterOptions", "SimOutcome", "Simulation"]

_Engine = TypeVar("_Engine", PrefillEngine, DecodeEngine)


class Controller(Protocol):
    """Something that acts on the pool while it runs (the autoscaler of `sim.elastic`): told of
    every arrival and completion, woken every `period_s` from time 0 while requests remain."""

    period_s: float

    def arrived(self, req: EngineRequest, now: float) -> None: ...

    def finished(self, req: EngineRequest, now: float) -> None: ...

    def tick(self, now: float) -> None: ...


@dataclasses.dataclass(frozen=True, slots=True)
class RouterOptions:
    """What the routers know and when they decide.

    `scrape_interval_s`: 0 reads every engine at every decision (an omniscient router); a
    positive value scrapes the engines on that period, as the sidecar does. `replicas`: router
    replicas, each with its own ledger and policy object, taking arrivals in turn (an even share);
    their scrapes are spread over the interval. `late_binding`: choose the decode instance when
    the prefill leg returns, on the state of that moment, instead of at arrival. `prefix_index`:
    each replica keeps an approximate index of the prompt blocks it sent to each prefill
    instance and tells the policies what each would find cached (`core.prefix_index`).
    `own_books`: each replica counts the requests it routed on top of the scraped gauges (its
    ledger), as the sidecar does; False shows the policies the gauges alone, as a router that
    keeps no books sees the pool between two scrapes (`sim paper`'s `herding` experiment).
    `shared_books`: the replicas tell each other every change to their books
    (`core.shared_books`), which each applies `bus_delay_s` after it was made, at its first
    decision then or after (`sim.book_bus`); each then counts every replica's requests.
    """

    scrape_interval_s: float = 0.0
    replicas: int = 1
    late_binding: bool = False
    prefix_index: bool = False
    own_books: bool = True
    shared_books: bool = False
    bus_delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.scrape_interval_s >= 0.0:
            raise ValueError(f"scrape_interval_s must be >= 0, got {self.scrape_interval_s!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas!r}")
        if not (self.bus_delay_s >= 0.0 and math.isfinite(self.bus_delay_s)):
            raise ValueError(f"bus_delay_s must be a finite number >= 0, got {self.bus_delay_s!r}")
        if self.bus_delay_s and not self.shared_books:
            raise ValueError("bus_delay_s needs shared_books")
        if self.shared_books and not self.own_books:
            raise ValueError("shared_books needs own_books (the shared entries are books)")


@dataclasses.dataclass(frozen=True, slots=True)
class InstanceSpec:
    """One instance: its role, the profile driving its timing, the one the router believes."""

    name: str
    role: str
    true_profile: CalibrationProfile
    believed_profile: CalibrationProfile | None
    standby: bool = False  # an instance an autoscaler may start; not serving at first


@dataclasses.dataclass(slots=True)
class SimOutcome:
    """Everything a run produced: per-request records and per-instance counters."""

    requests: list[EngineRequest]
    rejected: list[EngineRequest]  # refused by an engine
    shed: list[EngineRequest]  # refused by the router (sheddable classes)
    preemptions: dict[str, int]
    served: dict[str, int]
    end_time: float
    predictor_errors: dict[str, float]
    prefix_cache: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)
    """Prefill instance -> (prompt tokens looked up, tokens found cached)."""


class Simulation:
    """One run of one policy over one trace (construct anew for every run)."""

    def __init__(
        self,
        instances: Sequence[InstanceSpec],
        *,
        policies: Sequence[Policy],
        predictor: OutputPredictor,
        slo_classes: Mapping[str, SLOClass],
        default_class: str,
        seed: int,
        jitter: float = 0.03,
        router: RouterOptions = RouterOptions(),
        prefix_caching: bool = False,
        scheduling: SchedulingPolicy = "fcfs",
        controller: Controller | None = None,
    ) -> None:
        """`policies`: one policy object per router replica (`router.replicas` of them);
        `prefix_caching`: every engine caches prompt blocks (requests with `blocks`), as
        vLLM does by default on prefill and decode pods alike;
        `scheduling`: the engines' vLLM scheduling policy (``priority`` honours
        `RouteDecision.priority`); `controller`: acts on the pool as it runs (`serve`, `drain`);
        `standby` instances (prefill or decode) serve only once it starts them."""
        if len(policies) != router.replicas:
            raise ValueError(f"{router.replicas} router replicas need as many policy objects")
        self.slo_classes = dict(slo_classes)
        self.default_class = default_class
        self.policies = list(policies)
        self.options = router
        self.predictor = predictor
        self.rng = random.Random(seed)  # routing and prediction randomness
        engine_rng = random.Random(seed ^ 0x5EED)
        self.prefill: list[PrefillEngine] = []
        self.decode: list[DecodeEngine] = []
        for spec in instances:
            rng = random.Random(engine_rng.getrandbits(64))
            if spec.role == "prefill":
                self.prefill.append(
                    PrefillEngine(
                        spec.name,
                        spec.true_profile,
                        jitter=jitter,
                        rng=rng,
                        prefix_caching=prefix_caching,
                        scheduling=scheduling,
                    )
                )
            elif spec.role == "decode":
                self.decode.append(
                    DecodeEngine(
                        spec.name,
                        spec.true_profile,
                        jitter=jitter,
                        rng=rng,
                        scheduling=scheduling,
                        prefix_caching=prefix_caching,
                    )
                )
            else:
                raise ValueError(
                    f"instance {spec.name}: role must be prefill or decode, got {spec.role!r}"
                )
        standby = {s.name for s in instances if s.standby}
        # The instances the routers see, changed in place by `serve` and `drain`.
        self.serving: list[DecodeEngine] = [d for d in self.decode if d.name not in standby]
        self.serving_prefill = [p for p in self.prefill if p.name not in standby]
        if not self.serving_prefill or not self.serving:
            raise ValueError("a pool needs at least one serving prefill and decode instance each")
        self.controller = controller
        believed = {s.name: s.believed_profile for s in instances}
        n = router.replicas
        self._bus = BookBus(router.bus_delay_s) if router.shared_books else None
        self.routers = [
            RouterReplica(
                self.serving_prefill,
                self.serving,
                believed,
                policy=self.policies[r],
                predictor=predictor,
                rng=self.rng,  # one stream for every replica: the runs stay seeded as one
                scrape_interval_s=router.scrape_interval_s,
                phase_s=router.scrape_interval_s * r / n,
                prefix_index=router.prefix_index,
                own_books=router.own_books,
                late_binding=router.late_binding,
                bus=self._bus,
                name=f"router-{r}",
            )
            for r in range(n)
        ]
        self._engines: list[PrefillEngine | DecodeEngine] = [*self.prefill, *self.decode]
        self._index = {e.name: i for i, e in enumerate(self._engines)}
        self._served = [0] * len(self._engines)
        # Requests bound to each instance: a decode one's until they finish, a prefill one's
        # until their KV is pulled from it (what a drain waits for).
        self._bound = dict.fromkeys((e.name for e in self._engines), 0)
        self._version = [0] * len(self._engines)
        self._heap: list[tuple[float, int, int]] = []  # (time, engine index, version)

    # ------------------------------------------------------------------ scheduling of wake-ups
    def _reschedule(self, idx: int) -> None:
        self._version[idx] += 1
        t = self._engines[idx].next_wakeup()
        if t is not None:
            heapq.heappush(self._heap, (t, idx, self._version[idx]))

    def run(self, trace: Sequence[TraceRequest]) -> SimOutcome:
        reqs = [
            EngineRequest(
                i,
                t.arrival_s,
                t.prompt_tokens,
                t.output_tokens,
                t.slo_class or self.default_class,
                blocks=t.blocks,
                block_tokens=t.block_tokens,
            )
            for i, t in enumerate(trace)
        ]
        for r in reqs:
            if r.slo_class not in self.slo_classes:
                raise ValueError(f"request {r.index}: unknown SLO class {r.slo_class!r}")
        heap = self._heap
        n = len(reqs)
        nxt = 0
        now = 0.0
        period = self.controller.period_s if self.controller else math.inf
        tick = 0.0 if self.controller else math.inf
        bus = self._bus
        while nxt < n or heap:
            arrival = reqs[nxt].arrival if nxt < n else math.inf
            wake = heap[0][0] if heap else math.inf
            if tick <= wake and tick <= arrival and self.controller is not None:
                now = tick
                tick += period
                self.controller.tick(now)
            elif wake <= arrival:
                now, idx, version = heapq.heappop(heap)
                if version != self._version[idx]:
                    continue
                self._wake(idx, now)
            else:
                req = reqs[nxt]
                nxt += 1
                now = req.arrival
                self._arrive(req, now)
                if self.controller is not None:  # after routing: it reads the prediction
                    self.controller.arrived(req, now)
            if bus is not None:  # what the replicas published handling it is sent now
                bus.flush(now)
        rejected = [r for e in self._engines for r in e.rejected]
        done = [r for r in reqs if r.finish >= 0]
        return SimOutcome(
            requests=reqs,
            rejected=rejected,
            shed=[r for r in reqs if r.shed],
            preemptions={e.name: e.preemptions for e in self.decode},
            prefix_cache={e.name: (e.prefix_queries, e.prefix_hits) for e in self.prefill},
            served={e.name: self._served[i] for i, e in enumerate(self._engines)},
            end_time=max((r.finish for r in done), default=0.0),
            predictor_errors=_errors(self.predictor),
        )

    # ------------------------------------------------------------------ events
    def _router(self, req: EngineRequest) -> RouterReplica:
        return self.routers[req.index % len(self.routers)]

    def _arrive(self, req: EngineRequest, now: float) -> None:
        replica = self._router(req)
        self._observe(replica, now)
        placed = replica.router.route(
            Request(
                req.key,
                req.prompt_tokens,
                self.slo_classes[req.slo_class],
                blocks=req.blocks,
                block_tokens=req.block_tokens,
                true_output_tokens=req.output_tokens,
            ),
            now,
        )
        req.predicted_output = placed.features.predicted_output_tokens
        decision = placed.decision
        if decision.shed:  # refused at the door: it counts as missed, it takes no capacity
            req.shed = True
            return
        req.priority = decision.priority
        if decision.prefill is None:  # the P/D decider's local path: the decode engine prefills
            self._bind(req, decision.decode)
            d_idx = self._index[decision.decode]
            started = self.decode[d_idx - len(self.prefill)].enqueue(req, now, prefill_here=True)
            if req.rejected:
                replica.router.forget(req.key)
                self._unbind(req)
                return
            self._after_decode(d_idx, started, [], [], now)
            return
        p_idx = self._index[decision.prefill]
        req.prefill_instance = decision.prefill
        if not placed.late:
            self._bind(req, decision.decode)
        self._engines[p_idx].enqueue(req, now)
        if req.rejected:  # never admitted: it must not linger in the router's books
            replica.router.forget(req.key)
            self._unbind(req)
            return
        self._bound[decision.prefill] += 1
        self._reschedule(p_idx)

    def _observe(self, replica: RouterReplica, now: float) -> None:
        """What `replica` has heard before it decides at `now`. With shared books, the replicas
        first report the tokens their own requests streamed by one bus delay before `now`, and
        publish them then, so that they are due now: a front door counts and publishes each
        token as it passes, so a replica deciding at `now` has heard of every token streamed a
        bus delay before. (Reported only at decisions, tokens reached the others a decision
        later: with a 5 ms bus, two thirds of the others' streams were behind what a real bus
        would have delivered, `tests/sim/test_shared_books_sim.py`.) The deciding replica then
        counts its own up to `now`."""
        bus = self._bus
        if bus is None:
            replica.observe(now)
            return
        streams = replica.streams(now)
        if bus.delay_s > 0.0:
            bus.flush(now)  # what was published before this decision leaves at its time
            at = now - bus.delay_s
            heard = replica.streams(at)
            for r in self.routers:
                r.router.streamed(heard, at)
            bus.flush(at)
        else:
            for other in self.routers:
                if other is not replica:
                    other.router.streamed(streams, now)
        replica.observe(now, streams)

    def _bind_decode(self, req: EngineRequest, now: float) -> int:
        """Late binding: the prefill leg of `req` returned; the router chooses its decode
        instance now."""
        replica = self._router(req)
        self._observe(replica, now)
        decision = replica.router.bind_decode(req.key, now)
        assert decision is not None  # routed late and not finished: it awaits its decode pod
        self._bind(req, decision.decode)
        return self._index[decision.decode]

    def _wake(self, idx: int, now: float) -> None:
        engine = self._engines[idx]
        if isinstance(engine, PrefillEngine):
            for req in engine.advance(now):
                self._served[idx] += 1
                router = self._router(req).router
                router.prefilled(req.key)
                if req.decode_instance:
                    d_idx = self._index[req.decode_instance]
                else:
                    d_idx = self._bind_decode(req, now)
                started = self.decode[d_idx - len(self.prefill)].enqueue(req, now)
                if req.rejected:  # the decode side can never hold it: free its prefill KV too
                    self._release(engine, req, now)
                    router.forget(req.key)
                    self._unbind(req)
                self._after_decode(d_idx, started, [], [], now)
            self._reschedule(idx)
        else:
            finished, transferred, started = engine.advance(now)
            self._after_decode(idx, started, transferred, finished, now)

    def _after_decode(
        self,
        idx: int,
        started: list[EngineRequest],
        transferred: list[EngineRequest],
        finished: list[EngineRequest],
        now: float,
    ) -> None:
        del started  # transfers in flight need no action until they complete
        for req in transferred:
            p_idx = self._index[req.prefill_instance]
            self._release(self.prefill[p_idx], req, now)  # prefill engines come first
            self._reschedule(p_idx)
        for req in finished:
            self._served[idx] += 1
            self._router(req).router.finished(req.key, req.output_tokens)
            self._unbind(req)
            if self.controller is not None:
                self.controller.finished(req, now)
        self._reschedule(idx)

    # ------------------------------------------------------------------ the serving instances
    def _bind(self, req: EngineRequest, decode: str) -> None:
        req.decode_instance = decode
        self._bound[decode] += 1

    def _unbind(self, req: EngineRequest) -> None:
        if req.decode_instance:
            self._bound[req.decode_instance] -= 1

    def _release(self, engine: PrefillEngine, req: EngineRequest, now: float) -> None:
        """The KV of `req` left prefill instance `engine` (pulled, or dropped with `req`)."""
        engine.release(req, now)
        self._bound[engine.name] -= 1

    def serve(self, name: str) -> None:
        """Instance `name` starts taking requests (a scaled-up pod became ready)."""
        engine = self._engines[self._index[name]]
        if isinstance(engine, PrefillEngine):
            self._serve(self.serving_prefill, engine, "prefill")
        else:
            self._serve(self.serving, engine, "decode")

    def _serve(self, serving: list[_Engine], engine: _Engine, role: Role) -> None:
        if engine not in serving:
            serving.append(engine)
            for replica in self.routers:
                replica.serve(engine.name, role)

    def drain(self, name: str) -> None:
        """Instance `name` takes no new request; it finishes those it was given."""
        engine = self._engines[self._index[name]]
        if isinstance(engine, PrefillEngine):
            self._drain(self.serving_prefill, engine, "prefill")
        else:
            self._drain(self.serving, engine, "decode")

    def _drain(self, serving: list[_Engine], engine: _Engine, role: Role) -> None:
        if engine in serving:
            if len(serving) == 1:
                raise ValueError(f"the last serving {role} instance cannot be drained")
            serving.remove(engine)
            for replica in self.routers:
                replica.drain(engine.name)

    def bound(self, name: str) -> int:
        """Requests routed to instance `name` and not done with it (finished, for a decode
        instance; their KV pulled, for a prefill one)."""
        return self._bound[name]

    def drained(self, name: str) -> bool:
        """Whether instance `name` is drained: it holds no request and none is on its way."""
        engine = self._engines[self._index[name]]
        if isinstance(engine, PrefillEngine):
            # Bound until pulled: nothing bound means nothing queued, running or held.
            return engine not in self.serving_prefill and self._bound[name] == 0
        return engine not in self.serving and engine.idle and self._bound[name] == 0


def _errors(predictor: OutputPredictor) -> dict[str, float]:
    errors = getattr(predictor, "errors", None)
    return dict(errors()) if callable(errors) else {}
