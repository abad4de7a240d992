"""The router's ledger: what it sent where and has not seen finish, and the snapshot built from it.

A router knows two things about an instance: what the instance last said about itself (scraped
`Gauges`, up to one scrape interval old, counting every client's work) and its own exact account
of the requests it routed there (`Account`). `view` combines the two into the `InstanceSnapshot`
the policies read, by one rule for every router:

* prefill instance: `inflight` = `queued` = requests routed there whose prefill has not answered,
  `queued_tokens` / `queued_sq_tokens` their prompt tokens (and squares) less what the router
  expected cached there (`Entry.cached_tokens`: h of n tokens count n - h and n**2 - h**2, the
  partial prefill of the cost model), `yielded_tokens` / `yielded_sq_tokens` the part of them
  routed with a priority above 0 (`Entry.priority`); `waiting` is the scraped count raised to
  our own `queued` when that is higher;
* decode instance: `inflight` = routed there and not finished; `queued` = not yet decoding (no
  output token seen), `queued_tokens` their prompt tokens; `remaining_output_tokens` = predicted
  output of the in-flight requests minus what they produced so far (at least one token per
  decoding request); `tpot_budgets` what time per remaining token each can still afford (below);
  `running` / `waiting` are the scraped gauges raised to our own counts of requests decoding /
  queued there; `ttft_slack_s` the seconds until the first token of each queued one is due
  (routed at + its TTFT target - now), which the P/D decider needs to price a local prefill's
  stall;
* `kv_tokens_used` is the scraped value plus the prompts of the requests that started decoding
  there since that scrape; a request routed there and not decoding yet is in `queued_tokens`,
  which the cost model adds to it, so each prompt counts once (counting the routed ones here too
  priced every prompt of the last scrape interval twice, and the P/D decider found less spare
  decode KV than there was). One overlap stays: an engine holds the blocks of a request whose
  KV is arriving, so a scrape taken during that transfer counts it beside `queued_tokens` until
  its first token, one KV transfer's time;
* `foreign`: what the last scrape showed there (`running + waiting`) beyond the router's own
  requests the instance held at that moment (`Account.held_at_scrape`; a prefill instance holds
  one of ours from routing until its prefill leg answers, a decode instance from then on):
  another client's or router replica's work. The gauges minus what is ours *now* would not do:
  until the next scrape they still count our requests that have finished since, and every
  instance busy at the last scrape would look busier than it is.

TPOT budgets. A request of target T that has produced k tokens, the first one e seconds ago, and
is predicted r more, meets its target if its remaining r steps take at most
``(T * (k + r - 1) - e) / r`` seconds each: its budget, which shrinks as stalls and slow steps
eat into its slack. A request not decoding yet has its target as budget. The snapshot carries
``(budget, remaining tokens, count)``: budgets rounded to 0.5 ms, remaining tokens to the power of
two at or below them (a stall of S seconds breaks a request whose budget exceeds the step time by
less than S / remaining: near its end a request has little slack left in seconds), so the
snapshot stays small whatever the number of requests.

Budgets cost one pass over an instance's decoding requests, so an account keeps the last ones it
computed for `BUDGETS_REFRESH_S` unless a request joined, started decoding or left: at high
decision rates a pool of hundreds of streams is not walked per decision. In that time a budget
moves by at most `BUDGETS_REFRESH_S / remaining tokens` (under the 0.5 ms rounding once four
tokens are left), and the tokens produced meanwhile are not yet counted.

The router (`core.router`) books every request here and feeds it the reports it gets, through the
table of pods that holds the ledger (`core.pods`); the adapters feed that table the scraped gauges
(the sidecar's collectors; the simulator the engines' state at its scrape ticks) and the router
the reports (the sidecar's front door and gRPC clients; the simulator at the moments a real router
would get them). Several router replicas are several ledgers over the same gauges. Pure and
synchronous: no clock (times are passed in), no I/O.

Late binding: an entry may be booked with its prefill instance only (`decode=None`) and bound to
a decode instance later (`bind_decode`), when the prefill leg returns. Until then no decode
account holds it, and the ledger keeps its decode KV (prompt plus predicted output) in the
pool-wide `unbound_kv_tokens`, which the snapshot carries: the KV the decode pool owes it.

Local prefill: an entry booked without a prefill instance (`prefill=None`) is prefilled by its
decode instance, whose account then carries its prompt as `local_tokens` until it starts
decoding.

Shared books: another router replica's request, booked here from that replica's events
(`core.shared_books`), is an entry like ours with its `owner` set. It counts in every account
(`held_at_scrape` included: work a shared entry explains is not foreign) and is moved only by
its owner's events; `own_entries` counts the others.
"""

from __future__ import annotations

import dataclasses

from disaggpool.core.contracts import (
    NO_BUDGETS,
    InstanceSnapshot,
    RequestFeatures,
    Role,
    SLOClass,
    TpotBudgets,
)
from disaggpool.core.profile import CalibrationProfile

__all__ = ["BUDGETS_REFRESH_S", "Account", "Entry", "Gauges", "Ledger", "budgets", "view"]

BUDGETS_REFRESH_S = 0.002  # how long an account's budgets are reused (module docstring)


@dataclasses.dataclass(frozen=True, slots=True)
class Gauges:
    """What one scrape of an instance's `/metrics` said (vLLM's gauges)."""

    running: int
    waiting: int
    kv_usage: float  # fraction of the KV cache in use
    kv_capacity_tokens: int  # num_gpu_blocks * block_size (0 if not reported)
    preemptions: float = 0.0
    # Of `waiting`, those waiting for their KV from a prefill pod, their blocks already taken
    # (vllm:num_requests_waiting_by_reason{reason="deferred"}; 0 where not reported).
    deferred: int = 0

    @property
    def kv_tokens_used(self) -> int:
        return int(self.kv_usage * self.kv_capacity_tokens)


@dataclasses.dataclass(slots=True)
class Entry:
    """One routed request the router has not seen finish."""

    request_id: str
    prefill: str | None  # None: the decode instance prefills it (local path)
    decode: str | None  # None while the decode instance is not chosen yet (late binding)
    prompt_tokens: int
    predicted_output: float
    slo: SLOClass
    routed_at: float
    prefilled: bool = False
    decoding: bool = False
    generated: int = 0
    first_token_at: float = 0.0
    cached_tokens: int = 0  # of its prompt, expected cached on its prefill instance
    priority: int = 0  # what the engines were asked for (RouteDecision.priority)
    # What it was routed on: late binding and a retry choose its decode pod again with it.
    features: RequestFeatures | None = None
    # The router replica that routed it, when not this one (`core.shared_books`): counted like
    # ours, but only its owner's word moves it.
    owner: str | None = None
    # While decoding, budget(now) = (due - now) / left: `left` the predicted remaining tokens (at
    # least 1), `due` when the last of them is due, `left_pow2` the budgets' token bucket of
    # `left` (`_pow2`). All change only with `generated`.
    due: float = 0.0
    left: float = 1.0
    left_pow2: int = 1

    def budget(self, now: float) -> float:
        """Seconds per remaining output token it can afford and meet its TPOT target."""
        if not self.decoding:
            return self.slo.tpot_s
        return (self.due - now) / self.left

    def _pace(self) -> None:
        # Target T, k produced, r = max(1, predicted - k) left: the last token is due at
        # first_token_at + T * (k + r - 1) (module docstring).
        k = self.generated
        r = self.predicted_output - k
        if r < 1.0:
            r = 1.0
        self.left = r
        self.left_pow2 = _pow2(r)
        self.due = self.first_token_at + self.slo.tpot_s * (k + r - 1.0)


@dataclasses.dataclass(slots=True)
class Account:
    """The router's counters for one instance (see the module docstring for their meaning)."""

    inflight: int = 0
    queued: int = 0
    queued_tokens: int = 0
    queued_sq_tokens: float = 0.0
    yielded_tokens: int = 0
    yielded_sq_tokens: float = 0.0
    decoding: int = 0
    predicted_left: float = 0.0
    tokens_since_scrape: int = 0
    upstream: int = 0  # decode instance: requests bound here whose prefill leg has not answered
    held_at_scrape: int = 0  # our requests the instance held at the last scrape (`foreign`)
    local_tokens: int = 0
    local_sq_tokens: float = 0.0
    targets: dict[tuple[float, int], int] = dataclasses.field(default_factory=dict)  # queued
    first_due: dict[str, float] = dataclasses.field(default_factory=dict)  # queued: TTFT due at
    streams: dict[str, Entry] = dataclasses.field(default_factory=dict)  # decoding entries
    cached_budgets: TpotBudgets | None = None  # None after a request joined or left
    budgets_at: float = 0.0


class Ledger:
    """Entries by request id and accounts by instance name.

    Every method returning an `Entry` returns the one it changed (None for an unknown id), so a
    caller that caches views knows which instances to refresh.
    """

    def __init__(self) -> None:
        self.entries: dict[str, Entry] = {}
        self.accounts: dict[str, Account] = {}
        self.unbound_kv_tokens = 0.0  # routed to a prefill instance, decode not chosen yet
        self.shared_entries = 0  # entries another replica owns (`Entry.owner`)

    @property
    def own_entries(self) -> int:
        """Entries this router routed (not booked from another replica's events)."""
        return len(self.entries) - self.shared_entries

    def account(self, name: str) -> Account:
        acc = self.accounts.get(name)
        if acc is None:
            acc = self.accounts[name] = Account()
        return acc

    def busy(self, name: str) -> bool:
        """Whether requests routed to `name` are still in flight."""
        acc = self.accounts.get(name)
        return acc is not None and acc.inflight > 0

    def forget(self, name: str) -> None:
        """Drop the account of an instance that left the pool with nothing in flight."""
        acc = self.accounts.get(name)
        if acc is not None and acc.inflight == 0:
            del self.accounts[name]

    # ---------------------------------------------------------------- a request's life
    def routed(self, entry: Entry) -> None:
        """Book a routed request on its prefill instance (and decode instance, when bound)."""
        if entry.request_id in self.entries:
            raise KeyError(f"request id {entry.request_id!r} is already in flight")
        self.entries[entry.request_id] = entry
        if entry.owner is not None:
            self.shared_entries += 1
        if entry.prefill is None:
            if entry.decode is None:
                raise ValueError(f"request {entry.request_id!r}: local prefill needs a decode")
            entry.prefilled = True  # no prefill leg to wait for
        else:
            p = self.account(entry.prefill)
            n, h = entry.prompt_tokens, entry.cached_tokens
            p.inflight += 1
            p.queued += 1
            p.queued_tokens += n - h
            p.queued_sq_tokens += float(n) * n - float(h) * h
            if entry.priority > 0:
                p.yielded_tokens += n - h
                p.yielded_sq_tokens += float(n) * n - float(h) * h
        if entry.decode is not None:
            self._book_decode(entry, entry.decode)
        else:
            self.unbound_kv_tokens += _decode_kv(entry)

    def bind_decode(self, request_id: str, decode: str) -> Entry | None:
        """Choose the decode instance of a request booked without one (late binding)."""
        entry = self.entries.get(request_id)
        if entry is None:
            return None
        if entry.decode is not None:
            raise ValueError(f"request {request_id!r} is already bound to {entry.decode!r}")
        self._unbind_kv(entry)
        self._book_decode(entry, decode)
        return entry

    def _unbind_kv(self, entry: Entry) -> None:
        self.unbound_kv_tokens -= _decode_kv(entry)
        if self.unbound_kv_tokens < 0.5:
            self.unbound_kv_tokens = 0.0  # no float residue once every one is bound

    def _book_decode(self, entry: Entry, decode: str) -> None:
        entry.decode = decode
        d = self.account(decode)
        d.inflight += 1
        if not entry.prefilled:
            d.upstream += 1
        d.queued += 1
        d.queued_tokens += entry.prompt_tokens
        d.predicted_left += entry.predicted_output
        if entry.prefill is None:
            d.local_tokens += entry.prompt_tokens
            d.local_sq_tokens += float(entry.prompt_tokens) ** 2
        key = (entry.slo.tpot_s, _pow2(entry.predicted_output))
        d.targets[key] = d.targets.get(key, 0) + 1
        d.first_due[entry.request_id] = entry.routed_at + entry.slo.ttft_s
        d.cached_budgets = None

    def prefilled(self, request_id: str) -> Entry | None:
        """The prefill leg answered: the prefill instance's share is released."""
        entry = self.entries.get(request_id)
        if entry is not None and not entry.prefilled:
            self._release_prefill(entry)
        return entry

    def progress(
        self,
        request_id: str,
        generated: int,
        now: float,
        first_token_at: float | None = None,
    ) -> Entry | None:
        """`generated` output tokens so far, reported at `now`. The first report above 0 marks
        it decoding; its first token was seen at `first_token_at` (default `now`: a front door
        reports every token as it passes)."""
        entry = self.entries.get(request_id)
        if entry is not None:
            self.advance(entry, generated, now, first_token_at)
        return entry

    def advance(
        self, entry: Entry, generated: int, now: float, first_token_at: float | None = None
    ) -> None:
        """`progress` of an entry already in hand (one of `entries`)."""
        if not entry.prefilled:
            self._release_prefill(entry)
        if entry.decode is None:  # a client reporting tokens of a request it never bound
            return
        d = self.accounts[entry.decode]
        if not entry.decoding and generated > 0:
            entry.decoding = True
            entry.first_token_at = first_token_at if first_token_at is not None else now
            self._start_decoding(entry, d)
            d.tokens_since_scrape += entry.prompt_tokens  # its KV, in no scrape yet
        k = entry.generated
        if generated > k:
            predicted = entry.predicted_output
            left = predicted - k
            if left > 0.0:
                step = generated - k
                d.predicted_left -= step if step < left else left
            entry.generated = generated
            # Entry._pace, inlined: this runs for every stream at every simulated decision.
            r = predicted - generated
            if r < 1.0:
                r = 1.0
            entry.left = r
            n = int(r)
            entry.left_pow2 = 1 << (n.bit_length() - 1) if n > 1 else 1  # _pow2
            entry.due = entry.first_token_at + entry.slo.tpot_s * (generated + r - 1.0)

    def finished(self, request_id: str) -> Entry | None:
        """Forget a request (finished, failed or expired); returns its entry, if known."""
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return None
        if entry.owner is not None:
            self.shared_entries -= 1
        if not entry.prefilled:
            self._release_prefill(entry)
        if entry.decode is None:
            self._unbind_kv(entry)
            return entry
        d = self.accounts[entry.decode]
        d.inflight -= 1
        if not entry.decoding:
            self._start_decoding(entry, d)
        d.decoding -= 1
        del d.streams[entry.request_id]
        d.cached_budgets = None
        d.predicted_left -= max(0.0, entry.predicted_output - entry.generated)
        if d.inflight == 0:
            d.predicted_left = 0.0  # no float residue once idle
        return entry

    def expired(self, now: float, ttl: float) -> list[Entry]:
        """Forget requests routed more than `ttl` seconds ago (a caller that never reported)."""
        old = [e.request_id for e in self.entries.values() if now - e.routed_at > ttl]
        return [entry for rid in old if (entry := self.finished(rid)) is not None]

    def scraped(self, name: str) -> None:
        """A fresh scrape of `name` now counts the prompts that started decoding there before
        it, and what it shows beyond the requests of ours the instance holds now is foreign."""
        acc = self.accounts.get(name)
        if acc is not None:
            acc.tokens_since_scrape = 0
            acc.held_at_scrape = acc.inflight - acc.upstream

    @staticmethod
    def _start_decoding(entry: Entry, d: Account) -> None:
        d.queued -= 1
        d.queued_tokens -= entry.prompt_tokens
        d.decoding += 1
        _uncount(d.targets, (entry.slo.tpot_s, _pow2(entry.predicted_output)))
        del d.first_due[entry.request_id]
        d.streams[entry.request_id] = entry
        d.cached_budgets = None
        entry._pace()
        if entry.prefill is None:
            d.local_tokens -= entry.prompt_tokens
            d.local_sq_tokens -= float(entry.prompt_tokens) ** 2
            if d.local_tokens == 0:
                d.local_sq_tokens = 0.0  # no float residue

    def _release_prefill(self, entry: Entry) -> None:
        """The prefill leg of `entry` answered (or it left before it did)."""
        entry.prefilled = True
        if entry.decode is not None:
            self.accounts[entry.decode].upstream -= 1
        if entry.prefill is None:
            return
        p = self.accounts[entry.prefill]
        n, h = entry.prompt_tokens, entry.cached_tokens
        p.inflight -= 1
        p.queued -= 1
        p.queued_tokens -= n - h
        p.queued_sq_tokens -= float(n) * n - float(h) * h
        if entry.priority > 0:
            p.yielded_tokens -= n - h
            p.yielded_sq_tokens -= float(n) * n - float(h) * h
        if p.inflight == 0:
            p.queued_sq_tokens = p.yielded_sq_tokens = 0.0  # no float residue


def _decode_kv(entry: Entry) -> float:
    """The KV tokens a request holds on its decode instance by its end (as predicted)."""
    return entry.prompt_tokens + entry.predicted_output


def _pow2(tokens: float) -> int:
    """The power of two at or below `tokens` (at least 1)."""
    n = int(tokens)
    return 1 << (n.bit_length() - 1) if n > 1 else 1


def _uncount(counts: dict[tuple[float, int], int], key: tuple[float, int]) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]


def budgets(acc: Account, now: float) -> TpotBudgets:
    """The TPOT budgets of an account's in-flight requests at `now` (module docstring)."""
    if not acc.targets and not acc.streams:
        return NO_BUDGETS
    cached = acc.cached_budgets
    if cached is not None and 0.0 <= now - acc.budgets_at < BUDGETS_REFRESH_S:
        return cached
    counts = dict(acc.targets)
    get = counts.get
    for entry in acc.streams.values():
        key = (round((entry.due - now) / entry.left * 2000.0) / 2000.0, entry.left_pow2)  # 0.5 ms
        counts[key] = get(key, 0) + 1
    acc.cached_budgets = result = TpotBudgets.of_counts(counts)
    acc.budgets_at = now
    return result


_IDLE = Account()


def view(
    name: str,
    role: Role,
    account: Account | None,
    gauges: Gauges | None,
    *,
    now: float = 0.0,
    healthy: bool = True,
    profile: CalibrationProfile | None = None,
) -> InstanceSnapshot:
    """The instance as the policies see it at `now`: scraped gauges combined with the router's
    account."""
    acc = account if account is not None else _IDLE
    running = waiting = kv_used = foreign = 0
    if gauges is not None:
        running, waiting, kv_used = gauges.running, gauges.waiting, gauges.kv_tokens_used
        foreign = running + waiting - acc.held_at_scrape
        if foreign < 0:
            foreign = 0
    kv_used += acc.tokens_since_scrape
    if role == "prefill":
        return InstanceSnapshot(
            name=name,
            role="prefill",
            running=running,
            waiting=waiting if waiting > acc.queued else acc.queued,
            kv_tokens_used=kv_used,
            inflight=acc.inflight,
            queued=acc.queued,
            queued_tokens=acc.queued_tokens,
            queued_sq_tokens=acc.queued_sq_tokens,
            yielded_tokens=acc.yielded_tokens,
            yielded_sq_tokens=acc.yielded_sq_tokens,
            foreign=foreign,
            healthy=healthy,
            profile=profile,
        )
    return InstanceSnapshot(
        name=name,
        role="decode",
        running=running if running > acc.decoding else acc.decoding,
        waiting=waiting if waiting > acc.queued else acc.queued,
        kv_tokens_used=kv_used,
        inflight=acc.inflight,
        queued=acc.queued,
        queued_tokens=acc.queued_tokens,
        remaining_output_tokens=max(float(acc.decoding), acc.predicted_left),
        tpot_budgets=budgets(acc, now),
        local_prefill_tokens=acc.local_tokens,
        local_prefill_sq_tokens=acc.local_sq_tokens,
        ttft_slack_s=tuple(sorted(due - now for due in acc.first_due.values()))
        if acc.first_due
        else (),
        foreign=foreign,
        healthy=healthy,
        profile=profile,
    )
