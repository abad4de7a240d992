"""The emulator against a recording of REAL vLLM on the wire (`tests/realvllm/fixtures`).

Every recorded request is replayed against emulators set up like the recorded engines (served
name ``tiny``, max_model_len 2048) and the answers are compared field by field: the same keys in
the same order, the same types, the same statuses, error types, params and messages, the same
metric families, types, labels and buckets. Values that are random on real vLLM (ids, times,
text) are placeholders in the recording and match anything.

Known and intended differences, each asserted rather than skipped:
* the emulator is vLLM 0.33.0: `/version` says so, `system_fingerprint` starts ``vllm-0.33.0-``
  and the prefill `kv_transfer_params` carry `remote_registration_generation` (NIXL connector
  version 15; the recording is 0.32.0);
* `/tokenize` of chat messages counts the emulator's own template (shape compared, not count).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from emulator_testkit import H100, Http

from disaggpool.emulator.config import EmulatorConfig
from disaggpool.emulator.harness import EmulatorThread

FIXTURE = Path(__file__).resolve().parents[1] / "realvllm" / "fixtures" / "vllm_0.32.0_wire.json"
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="no recording of real vLLM")

PLACEHOLDER = re.compile(r"<[A-Z0-9_]+>")
V33_EXTRA_KV_KEYS = {"remote_registration_generation"}


def _wire() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text())
    return data


def _expand(request: Any) -> Any:
    """Turn the recording's prompt placeholders back into text."""
    if isinstance(request, dict):
        out = {k: _expand(v) for k, v in request.items()}
        if out.get("messages") == "<1 msg>":
            out["messages"] = [{"role": "user", "content": "gek " * 7}]
        return out
    if isinstance(request, list):
        return [_expand(v) for v in request]
    if isinstance(request, str):
        m = re.fullmatch(r"<(\d+) words>", request)
        if m:
            return " ".join(["gek"] * int(m.group(1)))
        m = re.fullmatch(r"<'(\w+) ' \* (\d+)>", request)
        if m:
            return (m.group(1) + " ") * int(m.group(2))
    return request


def _diff(want: Any, got: Any, path: str = "$") -> list[str]:
    """Where `got` differs from the recorded `want` in keys, key order and types."""
    if isinstance(want, str) and PLACEHOLDER.search(want):
        return []  # a value random on real vLLM: any value will do
    if isinstance(want, dict):
        if not isinstance(got, dict):
            return [f"{path}: {type(got).__name__}, recorded a dict"]
        keys_got = [
            k for k in got if not (path.endswith("kv_transfer_params") and k in V33_EXTRA_KV_KEYS)
        ]
        if keys_got != list(want):
            return [f"{path}: keys {keys_got} != recorded {list(want)}"]
        return [d for k in want for d in _diff(want[k], got[k], f"{path}.{k}")]
    if isinstance(want, list):
        if not isinstance(got, list) or (not want) != (not got):
            return [f"{path}: {got!r} vs recorded {want!r}"]
        return _diff(want[0], got[0], f"{path}[0]") if want else []
    if type(want) is not type(got):
        return [f"{path}: {type(got).__name__} {got!r}, recorded {type(want).__name__} {want!r}"]
    return []


@pytest.fixture(scope="module")
def engines() -> Any:
    def start() -> EmulatorThread:
        return EmulatorThread(
            EmulatorConfig(
                H100.scaled(20.0),
                served_model_names=("tiny",),
                max_model_len=2048,
                port=0,
                side_channel_port=0,
                jitter=0.0,
            )
        ).start()

    single, prefill, decode = start(), start(), start()
    yield single, prefill, decode
    for emu in (single, prefill, decode):
        emu.stop()


def _stream_events(http: Http, url: str, body: Any, headers: dict[str, str]) -> list[Any]:
    s = http.sse(url, body, headers)
    assert s.status == 200
    assert s.headers["content-type"] == "text/event-stream; charset=utf-8"
    return [e if e == "[DONE]" else json.loads(e) for _, e in s.events]


def _compare_stream(want: list[Any], got: list[Any], chat: bool) -> None:
    """Compare role, token, finishing and usage chunks, then the terminator."""
    assert got[-1] == "[DONE]" == want[-1]
    first = 1 if chat else 0
    if chat:
        assert _diff(want[0], got[0]) == [], "role chunk"
    assert _diff(want[-3], got[-3]) == [], "finishing chunk"
    assert _diff(want[-2], got[-2]) == [], "usage chunk"
    for chunk in got[first:-3]:
        assert _diff(want[first], chunk) == [], "token chunk"


def test_single_engine_responses(engines: Any, http: Http) -> None:
    single, _, _ = engines
    wire = _wire()["single"]
    for case in ("completion", "chat_completion"):
        rec = wire[case]
        path = "/v1/completions" if case == "completion" else "/v1/chat/completions"
        reply = http.post(single.url + path, _expand(rec["request"]), {"X-Request-Id": "r1"})
        assert reply.status == rec["status"]
        assert reply.headers["content-type"] == rec["content_type"]
        assert ("x-request-id" in reply.headers) == rec["x_request_id_echoed"]
        assert _diff(rec["body"], reply.json()) == [], case
        if case == "completion":  # BOS + words, as the recorded tokenizer counts
            assert reply.json()["usage"]["prompt_tokens"] == rec["body"]["usage"]["prompt_tokens"]
    for case, chat in (("completion_stream", False), ("chat_stream", True)):
        rec = wire[case]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        events = _stream_events(http, single.url + path, _expand(rec["request"]), {})
        _compare_stream(rec["events"], events, chat)
    models = http.get(single.url + "/v1/models")
    assert _diff(wire["models"]["body"], models.json()) == []
    health = http.get(single.url + "/health")
    assert (health.status, health.body.decode()) == (200, wire["health"]["body"])
    assert http.get(single.url + "/version").json() == {"version": "0.33.0"}  # recorded 0.32.0
    for case in ("tokenize_prompt", "tokenize_messages"):
        rec = wire[case]
        reply = http.post(single.url + "/tokenize", _expand(rec["request"])).json()
        assert _diff(rec["body"], reply) == []
    prompt = http.post(single.url + "/tokenize", _expand(wire["tokenize_prompt"]["request"]))
    assert prompt.json()["count"] == wire["tokenize_prompt"]["body"]["count"]  # BOS + 7 words


def test_errors_match(engines: Any, http: Http) -> None:
    single, _, _ = engines
    for case, rec in _wire()["errors"].items():
        req = rec["request"]
        body = req["body"]
        raw = body.encode() if isinstance(body, str) else json.dumps(_expand(body)).encode()
        headers = req["headers"] or {"Content-Type": "application/json"}
        reply = http.request("POST", single.url + req["path"], raw, headers, json_type=False)
        assert reply.status == rec["status"], (case, reply.body)
        assert reply.headers["content-type"] == rec["content_type"], case
        assert reply.json() == rec["body"], case


def test_prefill_decode_handoff_matches(engines: Any, http: Http) -> None:
    _, p, d = engines
    wire = _wire()["pd"]
    hdr = {"X-Request-Id": "pd1"}
    leg = http.post(p.url + "/v1/completions", _expand(wire["prefill_request"]), hdr)
    assert leg.status == wire["prefill_response"]["status"]
    body = leg.json()
    assert _diff(wire["prefill_response"]["body"], body) == []
    kv = body["kv_transfer_params"]
    assert [k for k in kv if k not in V33_EXTRA_KV_KEYS] == wire["kv_transfer_params_fields"]
    assert list(kv)[-4:] == [
        "remote_blocks_expiry_time",
        "remote_registration_generation",
        "transfer_mode",
        "remote_prefill_cached_tokens",
    ]  # docs/vllm-protocol.md §2.2 (0.33) order
    assert kv["remote_num_tokens"] == wire["prefill_response"]["body"]["usage"]["prompt_tokens"]
    decode_req = {**_expand(wire["decode_request"]), "kv_transfer_params": kv}
    reply = http.post(d.url + "/v1/completions", decode_req, hdr)
    assert reply.status == wire["decode_response"]["status"]
    assert _diff(wire["decode_response"]["body"], reply.json()) == []
    # the streamed decode leg
    original = _expand(wire["decode_stream"]["request"])
    p_leg = {**original, "max_tokens": 1, "stream": False}
    p_leg.pop("stream_options")
    p_leg.pop("min_tokens")
    p_leg["kv_transfer_params"] = _expand(wire["prefill_request"])["kv_transfer_params"]
    kv = http.post(p.url + "/v1/completions", p_leg, hdr).json()["kv_transfer_params"]
    events = _stream_events(
        http, d.url + "/v1/completions", {**original, "kv_transfer_params": kv}, hdr
    )
    _compare_stream(wire["decode_stream"]["events"], events, chat=False)


def test_chat_handoff_matches(engines: Any, http: Http) -> None:
    _, p, d = engines
    wire = _wire()["pd"]
    msgs = [{"role": "user", "content": "gek " * 140}]
    base = {"model": "tiny", "messages": msgs, "temperature": 0, "ignore_eos": True}
    p_leg = {**base, "max_tokens": 1, "stream": False}
    p_leg["kv_transfer_params"] = _expand(wire["prefill_request"])["kv_transfer_params"]
    hdr = {"X-Request-Id": "pd2"}
    prefill = http.post(p.url + "/v1/chat/completions", p_leg, hdr).json()
    assert _diff(wire["chat_prefill_response"]["body"], prefill) == []
    decode = http.post(
        d.url + "/v1/chat/completions",
        {**base, "max_tokens": 5, "kv_transfer_params": prefill["kv_transfer_params"]},
        hdr,
    ).json()
    assert _diff(wire["chat_decode_response"]["body"], decode) == []


_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+\S+$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _families(text: str) -> dict[str, dict[str, Any]]:
    """Family name (as on the TYPE line) -> type, label names, histogram buckets."""
    fams: dict[str, dict[str, Any]] = {}
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        m = _TYPE.match(line)
        if m:
            current = fams[m.group(1)] = {"type": m.group(2), "labels": set(), "buckets": []}
            continue
        m = _SAMPLE.match(line)
        if m and current is not None:
            labels = dict(_LABEL.findall(m.group(2) or ""))
            current["labels"].update(k for k in labels if k != "le")
            le = labels.get("le")
            if m.group(1).endswith("_bucket") and le is not None and le not in current["buckets"]:
                current["buckets"].append(le)
    return fams


def test_metric_families_match(engines: Any, http: Http) -> None:
    single, _, _ = engines
    ours = _families(http.get(single.url + "/metrics").body.decode())
    recorded = _wire()["metrics"]["single"]
    compared = 0
    for name, fam in ours.items():
        if not name.startswith("vllm:") or name.startswith("vllm:nixl_"):
            continue  # the recording is of an engine without a KV connector
        if name == "vllm:num_requests_kv_fetch_by_stage":
            continue  # recorded on a kv_consumer only; the emulator is both roles at once
        want = recorded.get(name)
        assert want is not None, f"{name} is not a vLLM metric"
        assert fam["type"] == want["type"], name
        assert sorted(fam["labels"]) == want["labels"], name
        if want.get("buckets"):
            assert fam["buckets"] == want["buckets"], name
        compared += 1
    assert compared >= 40
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds",
        "vllm:e2e_request_latency_seconds",
        "vllm:request_success_total",
    ):
        assert name in ours
