"""The prefill side's KV lending: blocks lent to decode peers, their leases, the side channel.

When a prefill leg's prompt is prefilled, `KVLender.lend` takes ``ceil(prompt / block_size)``
blocks from the pool, holds them under a lease named by the request's internal id, and hands
the owner vLLM 0.33's full `kv_transfer_params` to answer with. If the pool is short (only
reachable through per-request rounding to whole blocks: the engine admitted the prompt by
tokens), the request waits, FCFS, for lent blocks to come back.

The lender serves the decode peers' side channel (`kv_side_channel.SideChannelHandler`): reads
are checked against the lease, a notification returns the blocks, heartbeats extend leases, and
a lease that runs out returns them too (`vllm:nixl_num_kv_expired_reqs`). Whenever blocks come
back, the owner is told (`on_returned`) so that the prefill engine frees the prompt's KV.

Used by `instance.EmulatorInstance`, which owns one lender; `kv_blocks` keeps the pure records.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from disaggpool.emulator.config import EmulatorConfig, cannot_listen
from disaggpool.emulator.job import Job
from disaggpool.emulator.kv_blocks import BlockPool, Lease, LeaseTable
from disaggpool.emulator.kv_side_channel import SideChannelServer
from disaggpool.emulator.metrics import EmulatorMetrics
from disaggpool.engine.request import EngineRequest

__all__ = ["KVLender"]

log = logging.getLogger(__name__)


class KVLender:
    """Lends one instance's KV blocks to decode peers (see the module docstring).

    `on_lent(job, kv_transfer_params, t)` answers a prefill leg whose blocks are lent;
    `on_returned(req)` frees the prefill engine's KV of a request whose blocks came back.
    """

    def __init__(
        self,
        config: EmulatorConfig,
        bytes_per_token: float,
        metrics: EmulatorMetrics,
        *,
        on_lent: Callable[[Job, dict[str, Any], float], None],
        on_returned: Callable[[EngineRequest], None],
    ) -> None:
        self.config = config
        self._bytes_per_token = bytes_per_token
        self._metrics = metrics
        self._on_lent = on_lent
        self._on_returned = on_returned
        self.pool = BlockPool(config.num_gpu_blocks)
        self.leases = LeaseTable(config.kv_lease_duration)
        self.side_channel = SideChannelServer(self)
        self.port = config.side_channel_port  # the advertised `remote_port` once started
        self._waiters: deque[Job] = deque()
        self._expiry: asyncio.TimerHandle | None = None

    async def start(self) -> int:
        """Listen for decode peers; returns the side channel's port."""
        host, port = self.config.side_channel_host, self.config.side_channel_port
        try:
            self.port = await self.side_channel.start(host, port)
        except OSError as exc:
            change = (
                "each emulator on one machine needs its own: --side-channel-port N "
                "(or VLLM_NIXL_SIDE_CHANNEL_PORT=N; 0 picks a free port)"
            )
            raise cannot_listen(exc.errno, "NIXL side channel", f"{host}:{port}", change) from exc
        return self.port

    async def close(self) -> None:
        await self.side_channel.close()
        if self._expiry is not None:
            self._expiry.cancel()

    @property
    def num_waiting(self) -> int:
        """Prefilled requests waiting for blocks to come back."""
        return len(self._waiters)

    def lend(self, job: Job, t: float) -> None:
        """Lend blocks for `job`'s prompt, prefilled at `t`, or queue it until some come back."""
        blocks = self.pool.allocate(self._blocks_for(job.prompt_tokens))
        if blocks is None:
            self._waiters.append(job)
            return
        self._lend(job, blocks, t)

    def withdraw(self, job: Job) -> bool:
        """Forget a job still waiting for blocks; False if it was not waiting."""
        try:
            self._waiters.remove(job)
        except ValueError:
            return False
        return True

    def _blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.config.block_size)

    def _lend(self, job: Job, blocks: list[int], t: float) -> None:
        lease = Lease(
            request_id=job.internal_id,
            blocks=blocks,
            prompt_tokens=job.prompt_tokens,
            expires=t + self.leases.duration,
            token=job.req,
        )
        self.leases.hold(lease)
        self._arm_expiry()
        params = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(blocks)],
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": job.internal_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": job.prompt_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
            "remote_prefill_cached_tokens": job.req.cached_tokens,
        }
        self._on_lent(job, params, t)

    def _return_lease(self, lease: Lease) -> None:
        self.pool.free(lease.blocks)
        if isinstance(lease.token, EngineRequest):
            self._on_returned(lease.token)
        now = asyncio.get_running_loop().time()
        while self._waiters:
            job = self._waiters[0]
            blocks = self.pool.allocate(self._blocks_for(job.prompt_tokens))
            if blocks is None:
                break
            self._waiters.popleft()
            self._lend(job, blocks, now)

    def _arm_expiry(self) -> None:
        t = self.leases.next_expiry()
        if self._expiry is not None:
            if t is not None and self._expiry.when() == t:
                return
            self._expiry.cancel()
            self._expiry = None
        if t is not None:
            self._expiry = asyncio.get_running_loop().call_at(t, self._expire)

    def _expire(self) -> None:
        self._expiry = None
        for lease in self.leases.expire(asyncio.get_running_loop().time()):
            log.info(
                "KV lease of %s expired; freeing %d blocks", lease.request_id, len(lease.blocks)
            )
            self._metrics.nixl_kv_expired_reqs += 1
            self._return_lease(lease)
        self._arm_expiry()

    # ------------------------------------------------------------------ SideChannelHandler
    def kv_read(self, request_id: str, engine_id: str, block_ids: Any, skip: int) -> dict[str, Any]:
        lease = self.leases.get(request_id)
        if lease is None:
            if self.leases.was_expired(request_id):
                return {"ok": False, "error": f"KV blocks of {request_id} expired"}
            return {"ok": False, "error": f"unknown request id {request_id}"}
        if engine_id != self.config.engine_id:
            return {"ok": False, "error": f"engine id mismatch: {engine_id}"}
        if block_ids != [lease.blocks]:
            return {"ok": False, "error": f"block ids do not match those of {request_id}"}
        if skip > len(lease.blocks):
            return {"ok": False, "error": f"skip {skip} exceeds the {len(lease.blocks)} blocks"}
        num_blocks = len(lease.blocks) - skip
        size = num_blocks * self.config.block_size * self._bytes_per_token
        return {
            "ok": True,
            "num_tokens": lease.prompt_tokens,
            "num_blocks": num_blocks,
            "bytes": int(size),
        }

    def kv_notify(self, request_id: str) -> dict[str, Any]:
        lease = self.leases.release(request_id)
        if lease is None:
            if self.leases.was_expired(request_id):
                self._metrics.nixl_notifications_after_expiry += 1
            return {"ok": False, "error": f"unknown request id {request_id}"}
        self._return_lease(lease)
        self._arm_expiry()
        return {"ok": True}

    def kv_heartbeat(self, request_ids: list[str]) -> dict[str, Any]:
        n = self.leases.extend(request_ids, asyncio.get_running_loop().time())
        self._arm_expiry()
        return {"ok": True, "extended": n}
