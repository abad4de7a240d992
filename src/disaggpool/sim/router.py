"""One router replica in the simulator: the production `core.router.Router`, told what a sidecar
would observe of the engines.

The replica is the simulator's side of the router's adapter, what the sidecar's collectors and
front door are in production: before each decision (`observe`) it scrapes the engines when a
scrape is due and reports the output tokens streamed so far, and the simulator reports the rest
(routed, prefill leg answered, finished) to the router at the moments a real router gets them.
`scrape_interval_s` says how fresh the gauges are: 0 reads the engines at every decision (a
router that knows the instantaneous state), a positive interval reads them on that period,
starting at `phase_s`, so between scrapes the router sees only its own books on top of the last
scrape. Tokens produced are reported at every decision, as a front door counting streamed tokens
knows them.

Several replicas (`sim.cluster`) are several of these over the same engines, each routing its
share of the arrivals and seeing only its own requests in its books; the gauges are the only
thing they share, which is what makes greedy placement herd. With a `bus`
(`sim.book_bus.BookBus`, `RouterOptions.shared_books`) they share their books too: each
publishes the changes to its own (`core.shared_books.Publisher`) and, when it observes, applies
the others' that are due (`core.shared_books.SharedBooks`), before it scrapes. The prefill and
decode instances a replica sees are the serving ones: an autoscaled simulation starts and drains
them under it (`serve`, `drain`). With `prefix_index`, the router keeps the approximate index of
the prompt blocks it sent to each prefill instance (`core.router.ApproximatePrefix`). Without
`own_books` the policy sees the gauges alone (`core.pods`): a router that keeps no books, which
the `herding` experiment needs. Called by `sim.cluster` only.
"""

from __future__ import annotations

import random
from collections.abc import Mapping

from disaggpool.core.contracts import Role
from disaggpool.core.ledger import Gauges
from disaggpool.core.pods import Pod, Pods
from disaggpool.core.policies.base import Policy
from disaggpool.core.predictor import OutputPredictor
from disaggpool.core.prefix_index import PrefixIndex
from disaggpool.core.profile import CalibrationProfile
from disaggpool.core.router import ApproximatePrefix, Router
from disaggpool.core.shared_books import Publisher, SharedBooks
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.sim.book_bus import BookBus

__all__ = ["RouterReplica"]


class RouterReplica:
    """A router and what it observes of the engines (see the module docstring)."""

    def __init__(
        self,
        prefill: list[PrefillEngine],
        decode: list[DecodeEngine],
        believed: Mapping[str, CalibrationProfile | None],
        *,
        policy: Policy,
        predictor: OutputPredictor,
        rng: random.Random,
        scrape_interval_s: float = 0.0,
        phase_s: float = 0.0,
        prefix_index: bool = False,
        own_books: bool = True,
        late_binding: bool = False,
        bus: BookBus | None = None,
        name: str = "router-0",
    ) -> None:
        # Not copied: the simulator changes the serving instances in place as it scales.
        self.prefill = prefill
        self.decode = decode
        self.name = name
        # Views are rebuilt at every decision (refresh_s=0): results never depend on the cache.
        self.pods: Pods[Pod] = Pods(
            own_books=own_books,
            refresh_s=0.0,
            listener=Publisher(name, bus.outbox.append) if bus is not None else None,
        )
        self._bus = bus
        self._reader = bus.subscribe() if bus is not None else 0
        self.books = SharedBooks(self.pods, name) if bus is not None else None
        self._believed = believed
        self._served: dict[str, Pod] = {}  # every instance served so far
        for p in prefill:
            self.serve(p.name, "prefill")
        for d in decode:
            self.serve(d.name, "decode")
        self.ledger = self.pods.ledger
        prefix = ApproximatePrefix(PrefixIndex(), self.pods) if prefix_index else None
        self.router = Router(
            policy, predictor, rng, self.pods, prefix=prefix, late_binding=late_binding
        )
        self.scrape_interval_s = scrape_interval_s
        self._next_scrape = phase_s

    def observe(
        self, now: float, streams: list[tuple[str, int, float | None]] | None = None
    ) -> None:
        """What the router has heard by `now`: the other replicas' book events due (shared
        books), a scrape when one is due, then the output tokens streamed so far, each the first
        time it is more than the books hold (`streams`, when the caller has them already)."""
        if self._bus is not None and self.books is not None:
            apply = self.books.apply
            for event in self._bus.deliver(self._reader, now):
                apply(event, now)
            self.books.expire(now)
        if self.scrape_interval_s <= 0.0:
            self._scrape(now)
        elif now >= self._next_scrape:
            self._scrape(now)
            missed = int((now - self._next_scrape) / self.scrape_interval_s)
            self._next_scrape += (missed + 1) * self.scrape_interval_s
        self.router.streamed(self.streams(now) if streams is None else streams, now)

    def streams(self, now: float) -> list[tuple[str, int, float | None]]:
        """Every running sequence's (request id, output tokens so far, first token seen at):
        what the front doors streaming them have counted by `now`. A `now` before an engine's
        step in progress began (a bus delay back, `sim.cluster`) counts the tokens of that
        step's start, a token early at most (for a bus delay shorter than a step), and leaves
        out the sequences whose first token came after `now`."""
        out: list[tuple[str, int, float | None]] = []
        for d in self.decode:
            past = now < d.t_step
            for req, produced in d.produced_by(now):
                if past and not 0.0 <= req.first_token <= now:
                    continue
                out.append((req.key, produced, req.first_token))
        return out

    def _scrape(self, now: float) -> None:
        """What the sidecar's collector reads of every engine's `/metrics`."""
        scraped = self.pods.scraped
        for p in self.prefill:
            cap = p.profile.kv_capacity_tokens
            scraped(p.name, Gauges(p.num_running, p.num_waiting, p.kv_used / cap, cap), now)
        for d in self.decode:
            cap = d.profile.kv_capacity_tokens
            kv_used, _ = d.observe(now)
            scraped(d.name, Gauges(d.num_running, d.num_waiting, kv_used / cap, cap), now)

    # ---------------------------------------------------------------- the serving instances
    def serve(self, name: str, role: Role) -> None:
        """Instance `name` of `role` takes requests again, after those already serving (the
        last gauges read of it are kept until the next scrape, as a sidecar keeps them)."""
        if name in self.pods.instances:
            return
        pod = self._served.get(name)
        if pod is None:
            pod = self._served[name] = Pod(name, role, profile=self._believed[name])
        self.pods.add(pod)

    def drain(self, name: str) -> None:
        """Instance `name` takes no new request."""
        self.pods.remove(name)
