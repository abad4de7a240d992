"""The front door's pooled connections to the pods outlive neither the pods' keep-alive nor
`upstream_keepalive_s`.

vLLM's HTTP server closes a connection left idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s). A
router that pools connections for longer can send a leg down a connection at the moment the pod
closes it: the request never reaches the pod and the client gets a 502 from a healthy pair (seen
in CI against real vLLM on CPU). The moment is a race, so this test plays the pod's side at its
worst: a relay in front of each emulator closes a connection as soon as a request arrives on it
after a silence longer than the pod's keep-alive.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from sidecar_testkit import A40, post


class ClosingRelay:
    """Relays TCP to one pod; a request on a connection idle for more than `idle_s` is dropped
    with the connection, as a server whose keep-alive timer fires just then drops it."""

    def __init__(self, target_url: str, idle_s: float) -> None:
        host, port = target_url.removeprefix("http://").split(":")
        self.target = (host, int(port))
        self.idle_s = idle_s
        self.dropped = 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.target)
        last = [time.monotonic()]  # the last byte either way

        def pump_back() -> None:
            while data := _recv(upstream):
                last[0] = time.monotonic()
                client.sendall(data)
            client.close()

        threading.Thread(target=pump_back, daemon=True).start()
        with client, upstream:
            while data := _recv(client):
                if time.monotonic() - last[0] > self.idle_s:
                    self.dropped += 1
                    return  # closes both: the request never reaches the pod
                last[0] = time.monotonic()
                upstream.sendall(data)


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except OSError:
        return b""


def _pool_through(relays: dict[str, ClosingRelay], roles: dict[str, str]) -> dict[str, Any]:
    return {
        "static": {
            role: [{"name": n, "url": r.url} for n, r in relays.items() if roles[n] == role]
            for role in ("prefill", "decode")
        }
    }


def test_no_leg_is_sent_on_a_connection_idle_past_the_keepalive(start_pool, start_sidecar) -> None:
    pool = start_pool([A40], [A40])
    roles = {name: role for name, (role, _) in pool.pods.items()}
    relays = {name: ClosingRelay(emu.url, idle_s=0.6) for name, (_, emu) in pool.pods.items()}
    try:
        # No scrapes between requests: only the legs use the pooled connections.
        common = {"scrape_interval_s": 60.0, "pool": _pool_through(relays, roles)}
        kept = start_sidecar(pool, upstream_keepalive_s=0.3, **common)
        for i in range(3):
            time.sleep(0.9)  # idle past the pods' keep-alive, not only ours
            status, body = post(f"{kept.url}/v1/completions", {"prompt": f"q {i}", "max_tokens": 2})
            assert status == 200, body
        assert sum(r.dropped for r in relays.values()) == 0

        # The relay does bite: a sidecar pooling connections longer than the pods do loses a
        # request to the close (as a fixed 60 s would).
        stale = start_sidecar(pool, upstream_keepalive_s=30.0, **common)
        post(f"{stale.url}/v1/completions", {"prompt": "warm", "max_tokens": 2})
        time.sleep(0.9)
        status, body = post(f"{stale.url}/v1/completions", {"prompt": "late", "max_tokens": 2})
        assert status != 200, body
        assert sum(r.dropped for r in relays.values()) >= 1
    finally:
        for relay in relays.values():
            relay.close()
