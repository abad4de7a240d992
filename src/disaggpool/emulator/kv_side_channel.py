"""The loopback TCP exchange by which a decode leg pulls a prefill leg's KV blocks.

vLLM's decode worker handshakes with the prefill engine over ZMQ on `remote_host:remote_port`,
reads the blocks with NIXL, then sends a notification that lets the prefill side free them. The
emulator keeps the shape, not the bytes: a tiny JSON-lines protocol on the same advertised port.

    D -> P  {"op": "read", "request_id": R, "engine_id": E, "block_ids": [[...]], "skip": k}
    P -> D  {"ok": true, "num_tokens": n, "num_blocks": b, "bytes": B} | {"ok": false, "error": m}
    D -> P  {"op": "notif", "request_id": R}        (sent when the modelled transfer ends)
    P -> D  {"ok": true} | {"ok": false, "error": m}
    D -> P  {"op": "heartbeat", "request_ids": [...]}  (lease extension while D queues)
    P -> D  {"ok": true, "extended": k}

The read validates the request id, the engine id and the block ids against the lease, so a proxy
that mangles `kv_transfer_params` fails the way a real transfer would. `skip` (default 0): the
leading blocks D already holds in its own prefix cache, which it does not read (vLLM's connector
pulls only the blocks after D's local hit); `num_blocks` and `bytes` count the rest. No KV bytes
travel; the answer carries their size, which feeds `vllm:nixl_bytes_transferred`.

`instance` implements the server's `SideChannelHandler` and uses `KVReader` on the decode side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Protocol

__all__ = [
    "KVReadError",
    "KVReader",
    "ReadResult",
    "SideChannelHandler",
    "SideChannelServer",
    "send_heartbeat",
    "send_notification",
]

log = logging.getLogger(__name__)

_LINE_LIMIT = 1 << 20  # a read message lists block ids: 1 MiB holds ~100k of them


class SideChannelHandler(Protocol):
    """The prefill side's answers (implemented by `instance.EmulatorInstance`)."""

    def kv_read(
        self, request_id: str, engine_id: str, block_ids: Any, skip: int
    ) -> dict[str, Any]: ...

    def kv_notify(self, request_id: str) -> dict[str, Any]: ...

    def kv_heartbeat(self, request_ids: list[str]) -> dict[str, Any]: ...


class SideChannelServer:
    """Serves `SideChannelHandler` on a TCP port (the advertised `remote_port`)."""

    def __init__(self, handler: SideChannelHandler) -> None:
        self._handler = handler
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._serve, host, port, limit=_LINE_LIMIT)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._conns):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, ConnectionError):  # over the line limit, or reset
                    return
                if not line:
                    return
                reply = self._answer(line)
                writer.write(json.dumps(reply).encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._conns.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _answer(self, line: bytes) -> dict[str, Any]:
        try:
            msg = json.loads(line)
        except ValueError:
            return {"ok": False, "error": "malformed message"}
        if not isinstance(msg, dict):
            return {"ok": False, "error": "malformed message"}
        op = msg.get("op")
        rid = msg.get("request_id")
        try:
            skip = msg.get("skip", 0)
            if op == "read" and isinstance(rid, str):
                if not isinstance(skip, int) or isinstance(skip, bool) or skip < 0:
                    return {"ok": False, "error": f"skip must be a count of blocks, got {skip!r}"}
                eid = str(msg.get("engine_id"))
                return self._handler.kv_read(rid, eid, msg.get("block_ids"), skip)
            if op == "notif" and isinstance(rid, str):
                return self._handler.kv_notify(rid)
            ids = msg.get("request_ids")
            if op == "heartbeat" and isinstance(ids, list):
                return self._handler.kv_heartbeat([i for i in ids if isinstance(i, str)])
        except Exception:  # the handler must never take the channel down
            log.exception("side channel handler failed")
            return {"ok": False, "error": "internal error"}
        return {"ok": False, "error": f"unknown operation {op!r}"}


class KVReadError(Exception):
    """The prefill side could not be reached or refused the read."""


class ReadResult:
    """What the prefill side said it lent: tokens, blocks and their size in bytes."""

    __slots__ = ("num_blocks", "num_bytes", "num_tokens")

    def __init__(self, num_tokens: int, num_blocks: int, num_bytes: int) -> None:
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks
        self.num_bytes = num_bytes


async def _exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, msg: dict[str, Any]
) -> dict[str, Any]:
    writer.write(json.dumps(msg).encode() + b"\n")
    await writer.drain()
    line = await reader.readline()
    if not line:
        raise KVReadError("connection closed by the prefill side")
    try:
        reply = json.loads(line)
    except ValueError:
        raise KVReadError("malformed reply from the prefill side") from None
    if not isinstance(reply, dict):
        raise KVReadError("malformed reply from the prefill side")
    return reply


class KVReader:
    """One decode leg's pull: connect and read now, notify when the modelled transfer ends."""

    def __init__(self, host: str, port: int, request_id: str, timeout: float) -> None:
        self.host = host
        self.port = port
        self.request_id = request_id
        self.timeout = timeout
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def read(self, engine_id: str, block_ids: Any, skip: int = 0) -> ReadResult:
        """Read the lent blocks but the first `skip` (held here already)."""
        try:
            async with asyncio.timeout(self.timeout):
                self._reader, self._writer = await asyncio.open_connection(
                    self.host, self.port, limit=_LINE_LIMIT
                )
                reply = await _exchange(
                    self._reader,
                    self._writer,
                    {
                        "op": "read",
                        "request_id": self.request_id,
                        "engine_id": engine_id,
                        "block_ids": block_ids,
                        "skip": skip,
                    },
                )
        except KVReadError:
            self.close()
            raise
        except Exception as exc:  # refused, timed out, unresolvable, malformed address ...
            self.close()
            reason = str(exc) or type(exc).__name__
            raise KVReadError(
                f"cannot reach the prefill side at {self.host}:{self.port}: {reason}"
            ) from None
        if not reply.get("ok"):
            self.close()
            raise KVReadError(str(reply.get("error", "read refused")))
        try:
            return ReadResult(
                int(reply["num_tokens"]), int(reply["num_blocks"]), int(reply["bytes"])
            )
        except (KeyError, TypeError, ValueError):
            self.close()
            raise KVReadError("malformed reply from the prefill side") from None

    async def notify(self) -> bool:
        """Tell the prefill side the blocks were read (it frees them); False if that failed."""
        if self._reader is None or self._writer is None:
            return await send_notification(self.host, self.port, self.request_id, self.timeout)
        try:
            async with asyncio.timeout(self.timeout):
                reply = await _exchange(
                    self._reader, self._writer, {"op": "notif", "request_id": self.request_id}
                )
            return bool(reply.get("ok"))
        except Exception:
            return False
        finally:
            self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


async def _one_shot(host: str, port: int, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        reader, writer = await asyncio.open_connection(host, port, limit=_LINE_LIMIT)
        try:
            return await _exchange(reader, writer, msg)
        finally:
            writer.close()


async def send_notification(host: str, port: int, request_id: str, timeout: float) -> bool:
    """A notification without a read: the decode side will never read these blocks."""
    try:
        reply = await _one_shot(host, port, {"op": "notif", "request_id": request_id}, timeout)
    except Exception:  # best effort: P's lease frees the blocks anyway
        return False
    return bool(reply.get("ok"))


async def send_heartbeat(host: str, port: int, request_ids: list[str], timeout: float) -> bool:
    try:
        reply = await _one_shot(
            host, port, {"op": "heartbeat", "request_ids": request_ids}, timeout
        )
    except Exception:
        return False
    return bool(reply.get("ok"))
