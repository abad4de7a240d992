"""The router: what happens to one request at the router, written once for the simulator and the
sidecar.

For every request `Router.route`:

1. predicts its output length (`core.predictor`; capped by the client's `max_tokens`);
2. looks its prompt up in the prefix index (`PrefixSource`): what each prefill pod holds of it;
3. builds its `RequestFeatures`;
4. asks the policy (`core.policies`) for a (prefill, decode) pair on the `PoolSnapshot` of `now`;
5. sheds it when the policy says so (a sheddable class that would miss its SLO): nothing booked;
6. books it in the ledger (`core.pods.Pods`, `core.ledger`), without its decode pod when that is
   chosen late (below);
7. remembers that the chosen prefill pod now holds the prompt's blocks.

Late binding: a request routed with `bind_late` (the caller will report its prefill leg), on a
router with `late_binding`, gets its decode pod only when its prefill leg answers
(`bind_decode`), on the pool as it is then; `retry_decode` books another decode pod for a
request whose decode leg failed before its first token. Then the reports: `prefilled`,
`progress` (output tokens streamed so far), `finished` (which teaches the output-length predictor)
and `forget` (failed, refused, expired, or about to be routed again) keep the books.

The router is pure: no I/O and no clock. `now` comes with every call; scraped gauges, health and
profiles are what the adapter wrote into `pods`; the RNG and the predictor are given to it (the
simulator's router replicas share one of each). Its two adapters are thin: `sim.cluster` calls
it from the event loop (with `sim.router` feeding it what a sidecar would observe of the engines)
and `sidecar.service` wraps it in admission, metrics and logs. What either adds is what the other
has no use for; the decisions are this module's.
"""

from __future__ import annotations

import dataclasses
import random
import types
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any, Protocol

from disaggpool.core.contracts import PoolSnapshot, RequestFeatures, RouteDecision, SLOClass
from disaggpool.core.ledger import Entry
from disaggpool.core.pods import Pods
from disaggpool.core.policies.base import DecodeChoice, Policy
from disaggpool.core.predictor import OutputPredictor
from disaggpool.core.prefix_index import PrefixIndex

__all__ = ["ApproximatePrefix", "Placement", "PrefixSource", "Request", "Router"]

_NO_HITS: Mapping[str, int] = types.MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One request as it reaches the router.

    `blocks` / `block_tokens`: its prompt's block ids (`core.prefix_index.prompt_blocks`) and
    their size, for the prefix index (empty: no lookup); `token_ids` the prompt itself when known
    (a `PrefixSource` that reads an index at another block size recomputes the ids from it).
    `true_output_tokens`: the simulator's ground truth, read only by the oracle predictors.
    """

    request_id: str
    prompt_tokens: int
    slo: SLOClass
    max_tokens: int | None = None
    blocks: tuple[int, ...] = ()
    block_tokens: int = 0
    token_ids: Sequence[int] | None = None
    true_output_tokens: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Placement:
    """What `Router.route` decided and booked. `late`: booked without its decode pod, which
    `bind_decode` chooses (the decision's `decode` is the policy's choice of that moment, not
    booked). A shed decision (`decision.shed`) booked nothing."""

    features: RequestFeatures
    decision: RouteDecision
    late: bool = False


class PrefixSource(Protocol):
    """Where the router reads what each prefill pod holds of a prompt, and books what it sent."""

    def hits(self, request: Request, now: float) -> Mapping[str, int]:
        """Prefill pod -> prompt tokens of `request` it holds (pods with none left out)."""
        ...

    def remember(self, pod: str, request: Request, hit: int, capacity: int, now: float) -> None:
        """`pod` was sent `request`'s prompt at `now`, of which it held `hit` tokens; it can
        hold `capacity` KV tokens (0: not known)."""
        ...


class ApproximatePrefix:
    """The index of what the router sent where (`core.prefix_index.PrefixIndex`): each prefill
    pod is believed to hold the prompts it was sent, as many as its KV holds (its capacity, else
    the prompt alone). The sidecar extends it with the pods' own KV events."""

    def __init__(self, index: PrefixIndex, pods: Pods[Any]) -> None:
        self.index = index
        self.pods = pods

    def hits(self, request: Request, now: float) -> Mapping[str, int]:
        if not request.blocks:
            return _NO_HITS
        return self.index.hits(
            self.pods.names("prefill"), request.blocks, request.prompt_tokens, request.block_tokens
        )

    def remember(self, pod: str, request: Request, hit: int, capacity: int, now: float) -> None:
        n = request.prompt_tokens
        self.index.record(pod, request.blocks, n, request.block_tokens, capacity or n)


class Router:
    """The per-request sequence and the books (module docstring).

    `policy` decides; `predictor` predicts output lengths and learns from finished requests;
    `rng` is the one source of randomness of both; `pods` is the pool as the adapter observed it
    and the ledger; `prefix` (None: no prefix index) the prefix lookups; `late_binding`: choose
    the decode pod of a request routed with `bind_late` when its prefill leg answers.
    """

    def __init__(
        self,
        policy: Policy,
        predictor: OutputPredictor,
        rng: random.Random,
        pods: Pods[Any],
        *,
        prefix: PrefixSource | None = None,
        late_binding: bool = True,
    ) -> None:
        self.policy = policy
        self.predictor = predictor
        self.rng = rng
        self.pods = pods
        self.ledger = pods.ledger
        self.prefix = prefix
        self.late_binding = late_binding

    # ------------------------------------------------------------------ deciding
    def route(
        self,
        request: Request,
        now: float,
        *,
        bind_late: bool = True,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> Placement:
        """Route and book `request` (module docstring, steps 1-7). `bind_late`: the caller will
        call `bind_decode` when the prefill leg answers; `exclude_prefill`: pods a retry must
        avoid; `exclude_decode`: decode pods the caller may not use (a gateway's subset hint).
        Raises `NoCapacityError` when no pod of a role is healthy."""
        slo = request.slo
        pred = self.predictor.predict(
            slo.name, request.prompt_tokens, self.rng, request.true_output_tokens
        )
        predicted = pred.mean
        if request.max_tokens and request.max_tokens < predicted:
            predicted = float(request.max_tokens)
        hits = self.prefix.hits(request, now) if self.prefix is not None else _NO_HITS
        features = RequestFeatures(
            request_id=request.request_id,
            prompt_tokens=request.prompt_tokens,
            predicted_output_tokens=predicted,
            output_uncertainty=pred.std,
            slo=slo,
            prefix_hits=hits,
        )
        pool = self.snapshot(now, exclude_prefill, exclude_decode)
        decision = self.policy.route(features, pool, self.rng)
        if decision.shed:
            return Placement(features, decision)
        prefill = decision.prefill
        late = bind_late and self.late_binding and prefill is not None
        cached = hits.get(prefill, 0) if prefill is not None else 0
        self.pods.routed(
            Entry(
                request.request_id,
                prefill,
                None if late else decision.decode,
                request.prompt_tokens,
                predicted,
                slo,
                now,
                cached_tokens=cached,
                priority=decision.priority,
                features=features,
            )
        )
        if prefill is not None and request.blocks and self.prefix is not None:
            self.prefix.remember(prefill, request, cached, self.pods.kv_capacity(prefill), now)
        return Placement(features, decision, late)

    def bind_decode(self, request_id: str, now: float) -> RouteDecision | None:
        """Late binding: the prefill leg of `request_id` answered; choose and book its decode
        pod on the pool of `now`. None when it is not a request awaiting its decode pod (one
        `route` booked without it)."""
        entry = self.ledger.entries.get(request_id)
        if entry is None or entry.decode is not None or entry.prefill is None:
            return None
        if entry.features is None:
            return None
        self.pods.prefilled(request_id)
        choice = DecodeChoice(
            entry.features, self.snapshot(now), entry.prefill, now - entry.routed_at
        )
        decision = self.policy.route_decode(choice, self.rng)
        self.pods.bind_decode(request_id, decision.decode)
        return decision

    def retry_decode(
        self, request_id: str, failed: str, now: float, *, local: bool
    ) -> RouteDecision | None:
        """The decode leg of `request_id` failed on `failed` before its first token: book it on
        another decode pod. `local` (or a request on the local path already): that pod prefills
        the prompt itself, chosen as the policy routes a new request (the decision's `prefill`
        is None); else it pulls the same KV (the failed pod never asked for it), chosen as late
        binding chooses. None when the request is not in flight; raises `NoCapacityError`
        (the request is then forgotten) when no other decode pod is healthy."""
        entry = self.pods.finished(request_id)
        if entry is None or entry.features is None:
            return None
        prefill = entry.prefill
        local = local or prefill is None
        pool = self.snapshot(now, exclude_decode=(failed,))
        if local or prefill is None:
            decision = self.policy.route(entry.features, pool, self.rng)
        else:
            choice = DecodeChoice(entry.features, pool, prefill, now - entry.routed_at)
            decision = self.policy.route_decode(choice, self.rng)
        decode = decision.decode
        if local:
            self.pods.routed(
                dataclasses.replace(entry, prefill=None, decode=decode, cached_tokens=0)
            )
            return dataclasses.replace(decision, prefill=None)
        self.pods.routed(dataclasses.replace(entry, decode=None, prefilled=False))
        self.pods.prefilled(request_id)
        self.pods.bind_decode(request_id, decode)
        return decision

    def snapshot(
        self,
        now: float,
        exclude_prefill: Collection[str] = (),
        exclude_decode: Collection[str] = (),
    ) -> PoolSnapshot:
        """The pool as the policy sees it at `now`, the pods a retry must avoid marked
        unhealthy."""
        pool = self.pods.snapshot(now)
        if not exclude_prefill and not exclude_decode:
            return pool
        prefill = [
            dataclasses.replace(i, healthy=False) if i.name in exclude_prefill else i
            for i in pool.prefill
        ]
        decode = [
            dataclasses.replace(i, healthy=False) if i.name in exclude_decode else i
            for i in pool.decode
        ]
        return dataclasses.replace(pool, prefill=prefill, decode=decode)

    # ------------------------------------------------------------------ reports
    def prefilled(self, request_id: str) -> bool:
        """The prefill leg answered; False for an unknown request."""
        return self.pods.prefilled(request_id)

    def progress(
        self, request_id: str, generated: int, now: float, first_token_at: float | None = None
    ) -> bool:
        """`generated` output tokens streamed by `now`, the first at `first_token_at` (default
        `now`); False for an unknown request."""
        return self.pods.progress(request_id, generated, now, first_token_at)

    def streamed(self, counts: Iterable[tuple[str, int, float | None]], now: float) -> None:
        """`progress` of many requests at once, each (request id, output tokens so far, when
        the first was seen): what a front door's stream counters show at `now`. Counts that did
        not grow are ignored."""
        self.pods.streamed(counts, now)

    def finished(self, request_id: str, output_tokens: int) -> Entry | None:
        """It completed with `output_tokens`: forget it, and teach the predictor. Returns its
        entry (None: unknown)."""
        entry = self.pods.finished(request_id)
        if entry is not None and output_tokens > 0:
            self.predictor.observe(entry.slo.name, entry.prompt_tokens, output_tokens)
        return entry

    def forget(self, request_id: str) -> Entry | None:
        """It ended without an output to learn from (failed, refused by an engine, abandoned) or
        is about to be routed again: forget it. Returns its entry (None: unknown)."""
        return self.pods.finished(request_id)

    def expired(self, now: float, ttl: float) -> list[Entry]:
        """Forget the requests routed more than `ttl` seconds before `now`."""
        return self.pods.expired(now, ttl)
