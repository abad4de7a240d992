"""One emulated vLLM instance: engine models, KV lending, KV pulls and metrics, no HTTP.

`server` hands it validated requests (`requests.GenerationRequest`) and iterates the events of
the returned `job.Job`; the instance is the job's `JobHost`. A request is one of three legs, as
`kv_transfer_params` says:

* **prefill leg** (`do_remote_decode`): queued on the `PrefillEngine`; when its prefill ends
  `kv_lending.KVLender` lends blocks for its prompt under a lease, and it answers one token,
  finish reason ``length`` and vLLM 0.33's full `kv_transfer_params`;
* **decode leg** (`do_remote_prefill` with P's coordinates): queued on the `DecodeEngine`, which
  models the wait for a slot and the transfer (`kv_transfer.time`); when the engine starts the
  transfer, the instance reads the blocks from P over the side channel, and when the modelled
  transfer ends it notifies P, which frees them. Tokens are released only once the read has
  succeeded; a failed read ends the request with HTTP 500 (vLLM's `kv_load_failure_policy=fail`);
* **plain request**: prefilled *and* decoded on the `DecodeEngine`, the prompt being charged to
  the step in which it joins (the engine's recompute path), which is what an aggregated vLLM
  instance does: prefill shares the GPU with the running batch. As in vLLM, the prefill pass
  samples the first token, so it is out when the prefill part of that step ends (a lone
  request's TTFT is ``prefill.prompt_time(n)``) and the decode steps produce the rest (one
  ``decode.step`` each). A one-token plain request is a pure prefill and runs on the
  `PrefillEngine`.

No EOS is ever sampled: every request generates exactly its `max_tokens` (`ignore_eos` changes
nothing), from a seeded RNG over the tokenizer's vocabulary. Every way a request can end
(finish, client gone, failed pull, lease expiry, queue-full rejection) returns its KV, so nothing
leaks whatever the input.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from typing import Any

from disaggpool.core.prefix_index import prompt_blocks
from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.engine_driver import DecodeDriver, PrefillDriver
from disaggpool.emulator.errors import ApiError, value_error
from disaggpool.emulator.job import Done, Failed, Job, Tokens
from disaggpool.emulator.kv_lending import KVLender
from disaggpool.emulator.kv_publisher import KVEventPublisher, external_hash, stored_runs
from disaggpool.emulator.kv_side_channel import (
    KVReader,
    KVReadError,
    ReadResult,
    send_heartbeat,
    send_notification,
)
from disaggpool.emulator.metrics import EmulatorMetrics, GaugeSnapshot
from disaggpool.emulator.requests import GenerationRequest
from disaggpool.engine.request import EngineRequest
from disaggpool.formats.kv_events import AllBlocksCleared, BlockRemoved, Event
from disaggpool.wordtokenizer import Tokenizer

__all__ = ["EmulatorInstance"]

log = logging.getLogger(__name__)

# The most a timer fires before its model time (`EmulatorInstance.resumed`): far above the
# delivery cost of a healthy process, far below any step or prefill of a real GPU.
_MAX_LEAD = 0.002


class EmulatorInstance:
    """See the module docstring. Construct, `await start()`, `submit()`, `await close()`."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.profile = config.engine_profile()
        self.tokenizer = Tokenizer(config.vocab_size)
        self.metrics = EmulatorMetrics(
            model_name=config.served_name,
            max_model_len=config.model_len,
            cache_info=self._cache_info(),
            snapshot=self.snapshot,
        )
        self.lending = KVLender(
            config,
            self.profile.kv_transfer.bytes_per_token,
            self.metrics,
            on_lent=self._lent,
            on_returned=self._kv_returned,
        )
        self._rng = random.Random(config.seed)
        self._index = itertools.count()
        self._jobs: dict[int, Job] = {}
        self.kv_events: KVEventPublisher | None = None  # with --kv-events-config
        self._tasks: set[asyncio.Task[Any]] = set()
        self._prefill: PrefillDriver | None = None
        self._decode: DecodeDriver | None = None
        self._lead = 0.0  # the engine drivers' `lead` (`resumed`)
        self._last_resumed = -1.0

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        seeds = random.Random(self.config.seed ^ 0x5EED)
        if self.config.kv_events.publishing:
            self.kv_events = KVEventPublisher(self.config.kv_events, self.config.host)
            self.kv_events.start()
        self._prefill = PrefillDriver(
            self.profile,
            jitter=self.config.jitter,
            rng_seed=seeds.getrandbits(64),
            prefix_caching=self.config.enable_prefix_caching,
            scheduling=self.config.scheduling_policy,
            on_kv_events=self._publish_kv_events if self.kv_events is not None else None,
        )
        self._decode = DecodeDriver(
            self.profile,
            jitter=self.config.jitter,
            rng_seed=seeds.getrandbits(64),
            scheduling=self.config.scheduling_policy,
            prefix_caching=self.config.enable_prefix_caching,
            on_preempt=self._preempted,
        )
        await self.lending.start()
        self._spawn(self._heartbeats())

    async def close(self) -> None:
        for job in list(self._jobs.values()):
            job.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self.lending.close()
        for driver in (self._prefill, self._decode):
            if driver is not None:
                driver.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    def _publish_kv_events(
        self, changes: list[tuple[str, EngineRequest | None, list[int]]]
    ) -> None:
        """One prefill step's cache changes as one batch of vLLM KV events (`kv_publisher`)."""
        assert self.kv_events is not None
        events: list[Event] = []
        size = self.config.block_size
        for kind, req, ids in changes:
            if kind == "removed":
                events.append(BlockRemoved(tuple(external_hash(b) for b in ids)))
                continue
            if kind == "cleared":
                events.append(AllBlocksCleared())
                continue
            job = self._jobs.get(req.index) if req is not None else None
            if job is None or req is None:  # aborted in the same step: nothing to name
                continue
            events.extend(stored_runs(req.blocks, ids, job.spec.prompt_ids, size))
        self.kv_events.publish(events)

    @property
    def prefill(self) -> PrefillDriver:
        assert self._prefill is not None, "start() first"
        return self._prefill

    @property
    def decode(self) -> DecodeDriver:
        assert self._decode is not None, "start() first"
        return self._decode

    @property
    def side_channel_port(self) -> int:
        """The port decode peers pull this instance's KV from (`remote_port`)."""
        return self.lending.port

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _cache_info(self) -> dict[str, str]:
        """vLLM's CacheConfig as `vllm:cache_config_info` labels (every value a string).

        The label set is the one real vLLM sends (recorded from 0.32.0); the values describe
        this instance (block size and count from the profile, prefix caching as configured, no
        offload).
        """
        cfg, prof = self.config, self.profile
        capacity = cfg.num_gpu_blocks * cfg.block_size
        return {
            "_block_size_resolved": "True",
            "block_size": str(cfg.block_size),
            "cache_dtype": "auto",
            "cache_hit_alignment_tokens": "None",
            "effective_attention_block_size": str(cfg.block_size),
            "enable_mamba_shared_prefix_checkpoint": "False",
            "enable_prefix_caching": str(cfg.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": "0.92",
            "hash_block_size": "None",
            "is_attention_free": "False",
            "kv_cache_dtype_skip_layers": "[]",
            "kv_cache_layout": "None",
            "kv_cache_max_concurrency": str(capacity / cfg.model_len),
            "kv_cache_memory_bytes": str(int(capacity * prof.kv_transfer.bytes_per_token)),
            "kv_cache_size_tokens": str(capacity),
            "kv_offloading_backend": "native",
            "kv_offloading_size": "None",
            "kv_sharing_fast_prefill": "False",
            "mamba_block_size": "None",
            "mamba_cache_dtype": "auto",
            "mamba_cache_mode": "none",
            "mamba_page_size_padded": "None",
            "mamba_ssm_cache_dtype": "float32",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(cfg.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
            "prefix_cache_retention_interval": "0",
            "prefix_caching_hash_algo": "sha256",
            "prefix_match_unit": "None",
            "replayssm_buffer_len": "16",
            "skip_page_size_padded": "None",
            "sliding_window": "None",
            "swa_bounded_replay": "True",
            "use_kda_recoverssm": "False",
            "use_replayssm": "False",
            "user_specified_block_size": "False",
        }

    # ------------------------------------------------------------------ observation
    def snapshot(self) -> GaugeSnapshot:
        if self._prefill is None or self._decode is None:
            return GaugeSnapshot(0, 0, 0, 0.0)
        p, d = self.prefill.engine, self.decode.engine
        stages = {"queued": 0, "transferring": 0, "transferred": 0}
        for job in self._jobs.values():
            if job.spec.kind == "decode" and job.first_token_t < 0:
                stages[job.state] += 1
        waiting = p.num_waiting + d.num_waiting + self.lending.num_waiting
        deferred = stages["transferring"]
        used = p.kv_used + self.decode.kv_tokens_used()
        return GaugeSnapshot(
            running=p.num_running + d.num_running,
            waiting_capacity=max(0, waiting - deferred),
            waiting_deferred=deferred,
            kv_cache_usage=min(1.0, used / self.profile.kv_capacity_tokens),
            fetch_waiting_to_start=stages["queued"],
            fetch_in_progress=deferred,
            fetch_completed_waiting=stages["transferred"],
        )

    @property
    def active_requests(self) -> int:
        return len(self._jobs)

    # ------------------------------------------------------------------ admission
    def submit(self, spec: GenerationRequest, request_id: str) -> Job:
        """Queue a validated request; raises `ApiError` (503) when the queue is full."""
        limit = self.config.max_num_queued_reqs
        if limit is not None:
            snap = self.snapshot()
            if snap.waiting_capacity + snap.waiting_deferred >= limit:
                self.metrics.admission_rejections["max_num_queued_reqs"] += 1
                if spec.remote is not None:  # P still holds the blocks: tell it to free them
                    self._spawn(self._notify_rejected(spec))
                raise ApiError(
                    503,
                    f"The server is overloaded: {limit} requests are already waiting "
                    "(max_num_queued_reqs). Please try again later.",
                )
        suffix = f"{self._rng.getrandbits(32):08x}"
        internal = (
            f"cmpl-{request_id}-0-{suffix}"
            if spec.endpoint == "completions"
            else f"chatcmpl-{request_id}-{suffix}"
        )
        now = asyncio.get_running_loop().time()
        n = len(spec.prompt_ids)
        # The engine's output_tokens: a prefill leg samples one token in its prefill; a plain
        # request too, then decodes the rest; a decode leg decodes all of them (its first step
        # recomputes the last prompt token, as vLLM's decode side does).
        on_prefill = spec.kind == "prefill" or (spec.kind == "local" and spec.max_tokens == 1)
        output = spec.max_tokens - 1 if spec.kind == "local" else spec.max_tokens
        if spec.priority and self.config.scheduling_policy != "priority":
            raise value_error(
                f"Got priority {spec.priority} but Priority scheduling is not enabled."
            )
        req = EngineRequest(next(self._index), now, n, 1 if on_prefill else output, "emulated")
        req.priority = spec.priority
        if self.config.enable_prefix_caching:
            # Both engines keep a prefix cache: a decode leg pulls only the KV the decode engine
            # does not hold, a plain request computes only its uncached part.
            bs = self.config.block_size
            req.blocks, req.block_tokens = prompt_blocks(spec.prompt_ids, bs), bs
        seed = spec.seed if spec.seed is not None else self._rng.getrandbits(64)
        job = Job(self, spec, request_id, internal, req, seed)
        self._jobs[req.index] = job
        if spec.max_tokens_param is not None:
            self.metrics.request_max_tokens.observe(spec.max_tokens_param)
        job.on_prefill_engine = on_prefill
        if on_prefill:
            # A one-token plain request is a prefill and nothing else: run it where prefills
            # run, and give its KV back as soon as it is done (nothing will read it).
            ok = self.prefill.submit(req, job)
        else:
            ok = self.decode.submit(req, job, local=spec.kind == "local")
        if not ok:  # longer than the KV cache can ever hold (config makes this unreachable)
            del self._jobs[req.index]
            raise ApiError(400, f"The prompt ({n} tokens) does not fit in the KV cache.", "prompt")
        return job

    async def _notify_rejected(self, spec: GenerationRequest) -> None:
        assert spec.remote is not None
        if spec.remote.port < 0:
            return
        ok = await send_notification(
            spec.remote.host, spec.remote.port, spec.remote.request_id, self.config.pull_timeout
        )
        if not ok:
            self.metrics.nixl_failed_notifications += 1

    # ------------------------------------------------------------------ JobHost (job.Job calls)
    def resumed(self, t: float) -> None:
        """A request's handler has just taken up its event of model time `t`.

        Between an engine wake-up and that moment this process spends a few hundred
        microseconds (a timer's lateness, the drivers' replay, the listeners, the switch to the
        handler), more after a long idle on a virtual machine, which a client would read as a
        larger fixed cost than the profile's. The first handler to resume after each wake-up
        measures it, and the drivers fire their timers that much early: an integral controller
        (gain 1/4) that settles where handlers resume on time. Building and writing the response
        is not compensated: every server does that, for an error too.
        """
        if t == self._last_resumed:
            return
        self._last_resumed = t
        late = asyncio.get_running_loop().time() - t
        self._lead = min(_MAX_LEAD, max(0.0, self._lead + 0.25 * late))
        self.prefill.lead = self.decode.lead = self._lead

    def emit_tokens(self, job: Job, n: int, t: float) -> None:
        """Sample `n` tokens for `job`, record them in the metrics, and push them to it."""
        if job.done:
            return
        m = self.metrics
        ids = [self.tokenizer.sample(job.rng) for _ in range(n)]
        for _ in range(n):
            if job.first_token_t < 0:
                job.first_token_t = t
                m.ttft.observe(t - job.req.arrival)
                n_prompt = job.prompt_tokens
                m.prompt_tokens += n_prompt
                hit = (
                    job.req.cached_tokens if job.on_prefill_engine else job.req.decode_cached_tokens
                )
                if job.spec.kind == "decode":
                    # D loads what its own cache lacks but the last prompt token, and recomputes
                    # that one for logits (the hit is at most prompt - 1 tokens).
                    m.prompt_tokens_by_source["external_kv_transfer"] += n_prompt - 1 - hit
                    m.prompt_tokens_by_source["local_compute"] += 1
                else:
                    m.prompt_tokens_by_source["local_compute"] += n_prompt - hit
                m.prompt_tokens_by_source["local_cache_hit"] += hit
                m.prompt_tokens_cached_by_source["device"] += hit
                if job.req.blocks:  # looked up (prefix caching on)
                    m.prefix_cache_queries += n_prompt
                    m.prefix_cache_hits += hit
            else:
                m.itl.observe(t - job.last_token_t)
            job.last_token_t = t
        m.generation_tokens += n
        job.generated += n
        job.push(Tokens(ids, t))

    def finish(
        self, job: Job, t: float, reason: str, kv_transfer_params: dict[str, Any] | None
    ) -> None:
        """End `job` successfully: record it in the metrics and push `Done`."""
        if job.done:
            return
        job.done = True
        self._jobs.pop(job.req.index, None)
        m = self.metrics
        m.request_success[reason] += 1
        m.e2e.observe(t - job.req.arrival)
        m.request_prompt_tokens.observe(job.prompt_tokens)
        m.request_generation_tokens.observe(job.generated)
        m.request_max_generation_tokens.observe(job.output_tokens)
        m.request_params_n.observe(1)
        m.request_num_preemptions.observe(job.req.preemptions)
        if job.generated > 1:
            m.tpot.observe((t - job.first_token_t) / (job.generated - 1))
        job.push(Done(reason, t, kv_transfer_params))

    def _fail(self, job: Job, status: int, message: str) -> None:
        if job.done:
            return
        job.done = True
        self._jobs.pop(job.req.index, None)
        self.metrics.request_success["error"] += 1
        if job.spec.kind == "decode":
            self.decode.abort(job.req)
        job.push(Failed(status, message))

    def cancel(self, job: Job) -> None:
        """The client is gone: stop the request wherever it is and give back its KV."""
        if job.done:
            return
        job.done = True
        self._jobs.pop(job.req.index, None)
        self.metrics.request_success["abort"] += 1
        if job.on_prefill_engine:
            if not self.prefill.abort(job.req):
                job.prefill_cancelled = True  # it is being prefilled: freed when that ends
            if self.lending.withdraw(job):
                self.prefill.release(job.req)
            return
        self.decode.abort(job.req)
        if job.spec.kind == "decode" and not job.notified:
            if job.pull is not None:
                job.pull.cancel()
            job.notified = True
            self._spawn(self._notify_rejected(job.spec))

    def _preempted(self, n: int) -> None:
        self.metrics.preemptions += n

    # ------------------------------------------------------------------ prefill legs (P side)
    def prefilled(self, job: Job, t: float) -> None:
        """The prompt of `job` was prefilled at `t`: answer it, lending its KV for a P leg."""
        if job.prefill_cancelled:
            self.prefill.release(job.req)
            return
        if job.spec.kind == "local":  # a one-token plain request: done, nothing to lend
            self.prefill.release(job.req)
            self.emit_tokens(job, 1, t)
            self.finish(job, t, "length", None)
            return
        self.lending.lend(job, t)

    def _lent(self, job: Job, kv_transfer_params: dict[str, Any], t: float) -> None:
        self.emit_tokens(job, 1, t)
        self.finish(job, t, "length", kv_transfer_params)

    def _kv_returned(self, req: EngineRequest) -> None:
        self.prefill.release(req)

    # ------------------------------------------------------------------ decode legs (D side)
    def transfer_started(self, job: Job, t: float) -> None:
        """The modelled KV transfer of decode leg `job` started: read P's blocks now."""
        if job.spec.kind != "decode" or job.done:
            return
        job.state = "transferring"
        job.transfer_started = t
        job.pull = self._spawn(self._pull(job))

    async def _pull(self, job: Job) -> None:
        """Read the blocks now; notify P when the engine says the modelled transfer is over."""
        remote = job.spec.remote
        assert remote is not None
        loop = asyncio.get_running_loop()
        reader = KVReader(remote.host, remote.port, remote.request_id, self.config.pull_timeout)
        try:
            t0 = loop.time()
            try:
                if remote.port < 0:
                    raise KVReadError(f"invalid remote_port {remote.raw.get('remote_port')!r}")
                # The blocks D's own cache holds are not read (the hit is whole blocks).
                held = job.req.decode_cached_tokens // self.config.block_size
                result: ReadResult = await reader.read(remote.engine_id, remote.block_ids, held)
            except KVReadError as exc:
                self.metrics.nixl_failed_transfers += 1
                job.notified = True  # P lent nothing to this request, or refused: nothing to free
                log.warning("KV read for %s failed: %s", job.internal_id, exc)
                self._fail(job, 500, f"KV transfer from the prefill instance failed: {exc}")
                return
            post = loop.time() - t0
            job.open_gate()
            await job.transferred.wait()
            m = self.metrics
            pulled = job.prompt_tokens - job.req.decode_cached_tokens
            m.nixl_xfer_time.observe(self.profile.kv_transfer.time(pulled))
            m.nixl_post_time.observe(post)
            m.nixl_bytes.observe(result.num_bytes)
            m.nixl_descriptors.observe(result.num_blocks)
            job.notified = True
            if not await reader.notify():
                m.nixl_failed_notifications += 1
        except Exception:  # a bug here must fail the request, not leave it hanging
            log.exception("KV pull for %s failed", job.internal_id)
            self._fail(job, 500, "KV transfer from the prefill instance failed: internal error")
        finally:
            reader.close()

    async def _heartbeats(self) -> None:
        """While decode legs queue, keep their prefill leases alive (vLLM: every lease / 6)."""
        period = self.config.kv_lease_duration / 6.0
        while True:
            await asyncio.sleep(period)
            groups: dict[tuple[str, int], list[str]] = {}
            for job in list(self._jobs.values()):
                remote = job.spec.remote
                if remote is not None and job.state == "queued" and remote.port >= 0:
                    groups.setdefault((remote.host, remote.port), []).append(remote.request_id)
            for (host, port), ids in groups.items():
                self._spawn(send_heartbeat(host, port, ids, self.config.pull_timeout))
