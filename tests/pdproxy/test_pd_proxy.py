"""The decode-side P/D proxy end to end: real emulated vLLM pods (one prefill, one decode) on
loopback, the proxy in front of the decode pod, real HTTP. What a real handoff shows is read from
the pods' own metrics: the prefill pod finished a one-token request, the decode pod pulled the KV
over the side channel (`vllm:nixl_xfer_time_seconds`) and counted the prompt as transferred."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from pdproxy_testkit import HEADER, MODEL, dead_port, get, host_port, metric, post, sse_events

from disaggpool.wordtokenizer import Tokenizer

PROMPT = "a prompt for the prefill leg to chew on"
N_PROMPT = len(Tokenizer().encode(PROMPT)) + 1  # and BOS


def transfers(url: str) -> float:
    """KV transfers the decode pod made (each a read from a prefill pod's side channel)."""
    return metric(url, "vllm:nixl_xfer_time_seconds_count")


def finished(url: str) -> float:
    return metric(url, "vllm:request_success_total")


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def pair(start_emulator: Any) -> tuple[Any, Any]:
    return start_emulator(), start_emulator()


def test_completion_through_a_prefill_pod(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "min_tokens": 2}
    status, _, raw = post(
        f"{proxy.url}/v1/completions", body, {HEADER: host_port(p.url), "X-Request-Id": "r1"}
    )
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["id"] == "cmpl-r1"  # the decode pod saw the client's request id
    usage = answer["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (N_PROMPT, 6)
    # The prefill pod ran one request of one token; the decode pod pulled its KV once and
    # computed no prompt token but the last, as vLLM's decode does after a remote prefill.
    assert finished(p.url) == 1
    assert metric(p.url, "vllm:generation_tokens_total") == 1
    assert transfers(d.url) == 1
    assert metric(d.url, "vllm:nixl_num_failed_transfers_total") == 0
    assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 1
    # The decode pod's notification freed the prefill pod's lent blocks.
    wait_until(lambda: metric(p.url, "vllm:kv_cache_usage_perc") == 0, "P's blocks freed")
    assert metric(proxy.url, "disaggpool_pd_proxy_requests_total", prefill="remote",
                  code="200") == 1  # fmt: skip
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_legs_total", outcome="ok") == 1
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_leg_seconds_count") == 1


def test_streaming_chat_through_a_prefill_pod(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    status, headers, raw = post(
        f"{proxy.url}/v1/chat/completions", body, {HEADER: host_port(p.url)}
    )
    assert status == 200, raw
    assert headers["Content-Type"].startswith("text/event-stream")
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-")  # one generated request id
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert len(text.split()) == 5
    assert chunks[-1]["usage"]["completion_tokens"] == 5  # the client's limits were restored
    assert finished(p.url) == 1 and transfers(d.url) == 1
    assert (
        metric(proxy.url, "disaggpool_pd_proxy_decode_legs_total", kv="remote", outcome="ok") == 1
    )


def test_no_header_prefills_locally(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    status, _, raw = post(
        f"{proxy.url}/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 3}
    )
    assert status == 200, raw
    assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert finished(p.url) == 0 and transfers(d.url) == 0
    assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == N_PROMPT
    assert metric(proxy.url, "disaggpool_pd_proxy_requests_total", prefill="local") == 1
    # An empty header is no prefill host either.
    status, _, raw = post(
        f"{proxy.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2}, {HEADER: " "}
    )
    assert status == 200 and transfers(d.url) == 0


def test_dead_first_host_falls_back_to_the_second(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    hosts = f"127.0.0.1:{dead_port()}, {host_port(p.url)}"
    status, _, raw = post(
        f"{proxy.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, {HEADER: hosts}
    )
    assert status == 200, raw
    assert finished(p.url) == 1 and transfers(d.url) == 1
    fallbacks = "disaggpool_pd_proxy_prefill_fallbacks_total"
    assert metric(proxy.url, fallbacks, reason="connection", to="next_host") == 1
    assert metric(proxy.url, fallbacks, to="local") == 0


@pytest.fixture
def silent_host() -> Iterator[str]:
    """A host that accepts connections and never answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_a_silent_host_times_out_then_the_next(
    pair: Any, start_proxy: Any, silent_host: str
) -> None:
    p, d = pair
    proxy = start_proxy(d.url, prefill_timeout_s=0.5)
    started = time.monotonic()
    status, _, raw = post(
        f"{proxy.url}/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2},
        {HEADER: f"{silent_host},{host_port(p.url)}"},
    )
    assert status == 200, raw
    assert 0.5 <= time.monotonic() - started < 10
    assert transfers(d.url) == 1
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_fallbacks_total", reason="timeout",
                  to="next_host") == 1  # fmt: skip


def test_all_prefill_hosts_dead_prefills_locally(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    hosts = f"127.0.0.1:{dead_port()},127.0.0.1:{dead_port()}"
    body = {"prompt": PROMPT, "max_tokens": 3, "stream": True}
    status, _, raw = post(f"{proxy.url}/v1/completions", body, {HEADER: hosts})
    assert status == 200, raw
    assert sse_events(raw)[-1] == "[DONE]"
    assert finished(p.url) == 0 and transfers(d.url) == 0
    assert metric(d.url, "vllm:prompt_tokens_by_source_total", source="local_compute") == N_PROMPT
    fallbacks = "disaggpool_pd_proxy_prefill_fallbacks_total"
    assert metric(proxy.url, fallbacks, reason="connection", to="next_host") == 1
    assert metric(proxy.url, fallbacks, reason="connection", to="local") == 1
    assert metric(proxy.url, "disaggpool_pd_proxy_requests_total", prefill="fallback",
                  code="200") == 1  # fmt: skip


def test_a_4xx_from_prefill_is_returned_as_is(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    # No prompt: the prefill pod refuses it, and the decode pod never sees it.
    status, _, raw = post(
        f"{proxy.url}/v1/completions", {"max_tokens": 3}, {HEADER: host_port(p.url)}
    )
    direct, _, expected = post(f"{p.url}/v1/completions", {"max_tokens": 1, "stream": False})
    assert status == direct == 400
    assert json.loads(raw)["error"] == json.loads(expected)["error"]
    status, _, raw = post(
        f"{proxy.url}/v1/completions",
        {"model": "another/model", "prompt": "x"},
        {HEADER: host_port(p.url)},
    )
    assert status == 404, raw
    assert metric(d.url, "vllm:request_success_total") == 0
    assert metric(d.url, "vllm:prompt_tokens_total") == 0
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_legs_total", outcome="client_error") == 2
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_fallbacks_total") == 0


@pytest.mark.parametrize(
    "value",
    ["no-port", "a.example:0", "a.example:1,,b.example:2", "[zz]:80", "a b:1", "h:99999",
     ",".join(["h:1"] * 9)],
)  # fmt: skip
def test_a_malformed_header_is_a_400_naming_it(pair: Any, start_proxy: Any, value: str) -> None:
    _, d = pair
    proxy = start_proxy(d.url)
    status, _, raw = post(f"{proxy.url}/v1/completions", {"prompt": "x"}, {HEADER: value})
    assert status == 400, raw
    error = json.loads(raw)["error"]
    assert error["param"] == HEADER and error["message"].startswith(f"{HEADER}: ")
    assert metric(d.url, "vllm:prompt_tokens_total") == 0
    assert metric(proxy.url, "disaggpool_pd_proxy_rejected_total", reason="bad_header") == 1


def test_bounded_and_validated_bodies(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url, max_body_bytes=2000)
    url, hosts = f"{proxy.url}/v1/completions", {HEADER: host_port(p.url)}
    status, _, raw = post(url, {"prompt": "word " * 1000}, hosts)
    assert status == 413 and json.loads(raw)["error"]["param"] == "body"
    status, _, raw = post(url, b"{not json", hosts)
    assert status == 400 and json.loads(raw)["error"]["param"] == "body"
    status, _, raw = post(url, {"prompt": "x", "kv_transfer_params": {"remote_host": "x"}}, hosts)
    assert status == 400 and json.loads(raw)["error"]["param"] == "kv_transfer_params"
    status, _, raw = post(url, {"prompt": "x", "stream": "yes"})
    assert status == 400 and json.loads(raw)["error"]["param"] == "stream"
    status, _, raw = post(f"{proxy.url}/tokenize", {"prompt": "word " * 1000})
    assert status == 413
    assert finished(p.url) == 0 and metric(d.url, "vllm:prompt_tokens_total") == 0
    assert metric(proxy.url, "disaggpool_pd_proxy_rejected_total", reason="too_large") == 1


def test_api_keys_on_the_proxy_and_the_pods(
    start_emulator: Any, start_proxy: Any, tmp_path: Path
) -> None:
    p, d = start_emulator(api_keys=("pod-key",)), start_emulator(api_keys=("pod-key",))
    (tmp_path / "clients").write_text("client-key\n")
    (tmp_path / "pods").write_text("pod-key\n")
    proxy = start_proxy(d.url, api_keys_file=str(tmp_path / "clients"),
                        upstream_api_key_file=str(tmp_path / "pods"))  # fmt: skip
    url, body = f"{proxy.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 2}
    hosts = {HEADER: host_port(p.url)}
    for auth in ({}, {"Authorization": "Bearer pod-key"}, {"Authorization": "client-key"}):
        status, headers, raw = post(url, body, {**hosts, **auth})
        assert status == 401, raw
        assert json.loads(raw)["error"]["param"] == "authorization"
        assert headers["WWW-Authenticate"] == "Bearer"
    assert get(f"{proxy.url}/v1/models")[0] == 401
    assert finished(p.url) == 0
    status, _, raw = post(url, body, {**hosts, "Authorization": "Bearer client-key"})
    assert status == 200, raw  # both legs carried the pods' key, not the client's
    assert transfers(d.url) == 1
    assert get(f"{proxy.url}/v1/models", {"Authorization": "Bearer client-key"})[0] == 200
    assert get(f"{proxy.url}/health")[0] == 200  # probes and scrapes stay open
    assert metric(proxy.url, "disaggpool_pd_proxy_auth_failures_total") == 4
    # Without the pods' key the prefill pod says 401, and that 4xx reaches the client as is.
    bare = start_proxy(d.url, api_keys_file=str(tmp_path / "clients"))
    status, _, raw = post(
        f"{bare.url}/v1/completions", body, {**hosts, "Authorization": "Bearer client-key"}
    )
    assert status == 401 and transfers(d.url) == 1


def test_health_and_other_paths_go_to_the_local_vllm(pair: Any, start_proxy: Any) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    assert get(f"{proxy.url}/health")[0] == 200
    status, raw = get(f"{proxy.url}/v1/models", {HEADER: host_port(p.url)})
    assert status == 200 and json.loads(raw)["data"][0]["id"] == MODEL
    status, _, raw = post(f"{proxy.url}/tokenize", {"prompt": PROMPT})
    assert status == 200 and json.loads(raw)["count"] == N_PROMPT
    assert finished(p.url) == 0  # the header named a prefill pod, but only generation uses it
    d.stop()
    status, raw = get(f"{proxy.url}/health")
    assert status == 503
    status, _, raw = post(f"{proxy.url}/v1/completions", {"prompt": PROMPT})
    assert status == 502 and json.loads(raw)["error"]["code"] == 502


class _Recorder(BaseHTTPRequestHandler):
    """A stand-in pod that records what it is sent and answers `answer` (a misbehaving prefill
    pod, or a model server whose received headers a test reads)."""

    answer: ClassVar[dict[str, Any]] = {}
    status: ClassVar[int] = 200
    seen: ClassVar[list[tuple[str, dict[str, str], bytes]]] = []

    def _reply(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.seen.append((self.path, dict(self.headers), self.rfile.read(length)))
        body = json.dumps(self.answer).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _reply

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, type[_Recorder]]]:
    """(its host:port, the handler class holding what it saw)."""
    _Recorder.seen, _Recorder.status, _Recorder.answer = [], 200, {}
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"127.0.0.1:{server.server_address[1]}", _Recorder
    server.shutdown()
    server.server_close()


def test_kv_that_cannot_be_loaded_is_prefilled_locally(
    pair: Any, start_proxy: Any, recorder: tuple[str, type[_Recorder]]
) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    # One real handoff, whose params the decode pod has used: P no longer holds those blocks.
    leg = {"prompt": PROMPT, "max_tokens": 1, "stream": False,
           "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    _, _, raw = post(f"{p.url}/v1/completions", leg)
    params = json.loads(raw)["kv_transfer_params"]
    status, _, _ = post(f"{d.url}/v1/completions", {"prompt": PROMPT, "kv_transfer_params": params})
    assert status == 200 and transfers(d.url) == 1
    stale, handler = recorder
    handler.answer = {"kv_transfer_params": params}
    status, _, raw = post(
        f"{proxy.url}/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "min_tokens": 2},
        {HEADER: stale, "X-Request-Id": "kv1"},
    )
    assert status == 200, raw
    answer = json.loads(raw)
    assert answer["usage"]["completion_tokens"] == 3 and answer["id"] == "cmpl-kv1"
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_fallbacks_total", reason="kv_load",
                  to="local") == 1  # fmt: skip
    assert metric(proxy.url, "disaggpool_pd_proxy_requests_total", prefill="fallback") == 1
    # What the prefill pod was sent: vLLM's prefill leg, with the client's request id.
    ((path, headers, body),) = handler.seen
    assert path == "/v1/completions" and headers["X-Request-Id"] == "kv1"
    assert HEADER not in {h.lower() for h in headers}
    assert json.loads(body) == {
        "prompt": PROMPT,
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                               "remote_engine_id": None, "remote_block_ids": None,
                               "remote_host": None, "remote_port": None},
    }  # fmt: skip


def test_the_header_never_reaches_the_model_server(
    pair: Any, start_proxy: Any, recorder: tuple[str, type[_Recorder]]
) -> None:
    p, _ = pair
    local, handler = recorder
    handler.answer = {"ok": True}
    proxy = start_proxy(f"http://{local}")
    hosts = {HEADER: host_port(p.url), "X-Request-Id": "h1"}
    status, _, raw = post(f"{proxy.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 4}, hosts)
    assert status == 200, raw
    assert get(f"{proxy.url}/v1/models?x=1", hosts)[0] == 200
    (gen_path, gen_headers, gen_body), (other_path, other_headers, _) = handler.seen
    assert (gen_path, other_path) == ("/v1/completions", "/v1/models?x=1")
    for headers in (gen_headers, other_headers):
        assert HEADER not in {h.lower() for h in headers}
    assert gen_headers["X-Request-Id"] == "h1"
    # The decode leg: the client's limits, and P's params exactly as P returned them.
    decode = json.loads(gen_body)
    assert decode["max_tokens"] == 4 and decode["prompt"] == PROMPT
    assert decode["kv_transfer_params"]["remote_engine_id"] == p.config.engine_id
    assert decode["kv_transfer_params"]["do_remote_prefill"] is True


@pytest.mark.parametrize(
    ("status", "answer", "reason"),
    [(503, {"error": {"message": "busy"}}, "server_error"), (200, {"id": "x"}, "bad_answer")],
)
def test_a_failing_prefill_answer_moves_on(
    pair: Any,
    start_proxy: Any,
    recorder: tuple[str, type[_Recorder]],
    status: int,
    answer: dict[str, Any],
    reason: str,
) -> None:
    p, d = pair
    proxy = start_proxy(d.url)
    broken, handler = recorder
    handler.status, handler.answer = status, answer
    got, _, raw = post(
        f"{proxy.url}/v1/completions",
        {"prompt": PROMPT, "max_tokens": 2},
        {HEADER: f"{broken},{host_port(p.url)}"},
    )
    assert got == 200, raw
    assert len(handler.seen) == 1 and transfers(d.url) == 1
    assert metric(proxy.url, "disaggpool_pd_proxy_prefill_fallbacks_total", reason=reason,
                  to="next_host") == 1  # fmt: skip


class _CutStream(BaseHTTPRequestHandler):
    """A model server whose stream dies after one event (a vLLM killed mid-answer)."""

    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        event = b'data: {"id": "cmpl-1", "choices": [{"text": "one"}]}\n\n'
        self.wfile.write(b"%x\r\n%s\r\n" % (len(event), event))
        self.wfile.flush()
        self.close_connection = True  # no last chunk: the stream is cut

    def log_message(self, *args: Any) -> None:
        pass


def test_a_stream_cut_midway_ends_with_an_error_event(start_proxy: Any) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _CutStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        proxy = start_proxy(f"http://127.0.0.1:{server.server_address[1]}")
        status, _, raw = post(
            f"{proxy.url}/v1/completions", {"prompt": PROMPT, "max_tokens": 5, "stream": True}
        )
    finally:
        server.shutdown()
        server.server_close()
    assert status == 200
    events = sse_events(raw)
    assert json.loads(events[0])["choices"][0]["text"] == "one"  # what came, passed on
    assert json.loads(events[1])["error"]["code"] == 502
    assert events[2] == "[DONE]" and len(events) == 3
    assert metric(proxy.url, "disaggpool_pd_proxy_decode_legs_total", kv="local",
                  outcome="stream_failed") == 1  # fmt: skip
