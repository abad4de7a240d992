"""One router replica in the simulator: what it knows of the pool, kept as the sidecar keeps it.

It plays the sidecar's part with the sidecar's own bookkeeping: a `core.ledger.Ledger` of the
requests it routed, fed the reports a real router gets (routed, prefill leg answered, tokens
streamed, finished), plus engine gauges read as a scrape would read them. `scrape_interval_s`
says how fresh those gauges are: 0 reads the engines at every decision (a router that knows the
instantaneous state), a positive interval reads them on that period, starting at `phase_s`, so
between scrapes the replica sees only its own bookkeeping on top of the last scrape. Tokens
produced are reported at every decision, as a front door counting streamed tokens knows them.

Several replicas (`sim.cluster`) are several of these over the same engines, each routing its
share of the arrivals and seeing only its own requests in its ledger; the gauges are the only
thing they share, which is what makes greedy placement herd. The decode instances a replica sees
are the serving ones: an autoscaled simulation adds and drains them under it. With
`prefix_index`, a replica also keeps a `core.prefix_index.PrefixIndex` of the prompt blocks it
sent to each prefill instance and tells the policy what each would find cached (`prefix_hits`).
Without `own_books` the policy sees the gauges alone (the ledger is still kept, for late binding
and the reports, but not shown): a router that keeps no books, which the `herding` experiment
needs. Called by `sim.cluster` only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from disaggpool.core.contracts import PoolSnapshot, SLOClass
from disaggpool.core.ledger import Entry, Gauges, Ledger, view
from disaggpool.core.prefix_index import PrefixIndex
from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.decode import DecodeEngine
from disaggpool.engine.prefill import PrefillEngine
from disaggpool.engine.request import EngineRequest

__all__ = ["RouterReplica"]


class RouterReplica:
    """A router's ledger and last scrape of the pool (see the module docstring)."""

    def __init__(
        self,
        prefill: Sequence[PrefillEngine],
        decode: list[DecodeEngine],
        believed: Mapping[str, CalibrationProfile | None],
        *,
        scrape_interval_s: float = 0.0,
        phase_s: float = 0.0,
        prefix_index: bool = False,
        own_books: bool = True,
    ) -> None:
        self.prefill = list(prefill)
        # Not copied: the simulator changes the serving decode instances in place as it scales.
        self.decode = decode
        self.profiles = dict(believed)
        self.ledger = Ledger()
        self.scrape_interval_s = scrape_interval_s
        self._next_scrape = phase_s
        self._gauges: dict[str, Gauges] = {}
        self.index = PrefixIndex() if prefix_index else None
        self.own_books = own_books

    # ---------------------------------------------------------------- reports
    def routed(
        self,
        req: EngineRequest,
        prefill: str | None,
        decode: str | None,
        slo: SLOClass,
        now: float,
        cached_tokens: int = 0,
    ) -> None:
        """Book a routed request; `cached_tokens`: what the index told the policy the prefill
        instance holds of its prompt (`prefix_hits`), booked as work it need not do."""
        entry = Entry(
            req.key, prefill, decode, req.prompt_tokens, req.predicted_output, slo, now,
            cached_tokens=cached_tokens, priority=req.priority,
        )  # fmt: skip
        if self.index is not None and prefill is not None and req.blocks:
            n = req.prompt_tokens
            believed = self.profiles[prefill]  # the index is bounded by the KV it believes
            capacity = (believed.kv_capacity_tokens if believed is not None else 0) or n
            self.index.record(prefill, req.blocks, n, req.block_tokens, capacity)
        self.ledger.routed(entry)

    def prefix_hits(self, req: EngineRequest) -> Mapping[str, int]:
        """Prefill instance -> prompt tokens of `req` the index believes it has cached."""
        if self.index is None or not req.blocks:
            return {}
        return self.index.hits(
            (p.name for p in self.prefill), req.blocks, req.prompt_tokens, req.block_tokens
        )

    def bind_decode(self, req: EngineRequest, decode: str) -> None:
        self.ledger.bind_decode(req.key, decode)

    def prefilled(self, req: EngineRequest) -> None:
        self.ledger.prefilled(req.key)

    def finished(self, req: EngineRequest) -> None:
        """Finished, or refused by an engine: either way the router forgets it."""
        self.ledger.finished(req.key)

    def scraped(self, name: str, gauges: Gauges, now: float) -> None:
        """A scrape of engine `name` at `now` (what the sidecar's collector does)."""
        self._gauges[name] = gauges
        self.ledger.scraped(name)

    def progress(self, req: EngineRequest, produced: int, now: float) -> None:
        """`produced` output tokens of `req` reached its client by `now`, the first of them at
        its first-token time (what the front door counts as the tokens pass)."""
        self.ledger.progress(req.key, produced, now, req.first_token)

    # ---------------------------------------------------------------- the view
    def _scrape(self, now: float) -> None:
        for p in self.prefill:
            cap = p.profile.kv_capacity_tokens
            self.scraped(p.name, Gauges(p.num_running, p.num_waiting, p.kv_used / cap, cap), now)
        for d in self.decode:
            cap = d.profile.kv_capacity_tokens
            kv_used, _ = d.observe(now)
            self.scraped(d.name, Gauges(d.num_running, d.num_waiting, kv_used / cap, cap), now)

    def snapshot(self, now: float) -> PoolSnapshot:
        """Bring the ledger up to `now` (a scrape when one is due, the tokens streamed so far),
        then the pool as the policy sees it."""
        if self.scrape_interval_s <= 0.0:
            self._scrape(now)
        elif now >= self._next_scrape:
            self._scrape(now)
            missed = int((now - self._next_scrape) / self.scrape_interval_s)
            self._next_scrape += (missed + 1) * self.scrape_interval_s
        entries = self.ledger.entries
        for d in self.decode:
            for req, produced in d.produced_by(now):
                entry = entries.get(req.key)
                if entry is not None and produced > entry.generated:
                    self.progress(req, produced, now)
        accounts = self.ledger.accounts if self.own_books else {}
        gauges = self._gauges
        profiles = self.profiles
        return PoolSnapshot(
            now=now,
            prefill=[
                view(
                    e.name,
                    "prefill",
                    accounts.get(e.name),
                    gauges.get(e.name),
                    now=now,
                    profile=profiles[e.name],
                )
                for e in self.prefill
            ],
            decode=[
                view(
                    e.name,
                    "decode",
                    accounts.get(e.name),
                    gauges.get(e.name),
                    now=now,
                    profile=profiles[e.name],
                )
                for e in self.decode
            ],
            unbound_kv_tokens=self.ledger.unbound_kv_tokens if self.own_books else 0.0,
        )
