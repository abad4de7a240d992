"""vLLM's own KV events, read by the sidecar's subscriber code, against vLLM's own prefix cache.

The single engine publishes its KV events (conftest: on an IPC socket file). Each message goes
through `KVEventSubscribers._apply`, what the sidecar does with every message, into the pod's
event index; the index's prediction of the cache hit of a prompt
sharing a prefix must be exactly what vLLM then counts in `vllm:prefix_cache_hits`.
"""

from __future__ import annotations

import random
import time
from typing import Any

import zmq
from vllm_engines_kit import post_json, prometheus_value

from disaggpool.core.prefix_index import prompt_blocks
from disaggpool.sidecar.config import parse_config
from disaggpool.sidecar.kv_events import KVEventSubscribers
from disaggpool.sidecar.service import RoutingService
from disaggpool.sidecar.supervise import Supervisor

SLO = [{"name": "chat", "ttft_s": 30.0, "tpot_s": 1.0}]


def test_real_vllm_events_predict_its_prefix_cache_hits(single_engine: Any) -> None:
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(single_engine.kv_events_endpoint)
    pods = {
        "prefill": [{"name": "p0", "url": single_engine.url, "kv_events": "tcp://127.0.0.1:1"}],
        "decode": [{"name": "d0", "url": single_engine.url}],
    }
    config = parse_config(
        {
            "policy": "calibrated",
            "model": "tiny",
            "slo_classes": SLO,
            "pool": {"static": pods},
            "prefix_index": True,
            "kv_events": {},
        },
        "<test>",
    )
    service = RoutingService(config)
    service.state.set_members(config.static_members)
    subs = KVEventSubscribers(
        service, config.kv_events, _supervisor(service)
    )  # its sockets unused: we feed it
    last: list[int | None] = [None]

    def listen(seconds: float) -> int:
        got = 0
        end = time.monotonic() + seconds
        while sub.poll(max(1, int(1000 * (end - time.monotonic())))):
            last[0] = subs._apply("p0", sub.recv_multipart(), last[0])
            got += 1
        return got

    try:
        time.sleep(1.0)  # the subscription reaches the PUB (ZMQ's slow joiner)
        rng = random.Random(7)
        first = [rng.randrange(3, 500) for _ in range(300)]
        second = first + [rng.randrange(3, 500) for _ in range(100)]
        url = single_engine.url
        post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": first, "max_tokens": 1}, {})
        assert listen(3.0) >= 1, "no KV event batch from vLLM"
        index = service.state.instances["p0"].events
        assert index is not None and index.block_tokens == 128  # the CPU backend's blocks
        predicted = index.hit_tokens(prompt_blocks(second, 128), len(second))
        before = prometheus_value(url, "vllm:prefix_cache_hits_total")
        post_json(f"{url}/v1/completions", {"model": "tiny", "prompt": second, "max_tokens": 1}, {})
        hits = prometheus_value(url, "vllm:prefix_cache_hits_total") - before
        assert predicted == hits == 256  # the two full blocks of the first prompt
        listen(2.0)
        assert index.hit_tokens(prompt_blocks(second, 128), len(second) + 1) == 384  # 3 now
        assert (
            'disaggpool_kv_events_malformed_total{pod="p0"}'
            not in service.metrics.render().decode()
        )
    finally:
        sub.close(linger=0)
        ctx.term()


def _supervisor(service: RoutingService) -> Supervisor:
    return Supervisor(service.metrics.loop_errors, service.metrics.loop_restarts)
