"""Reading and recording what real vLLM says on the wire, for tests/realvllm: the HTTP client the
tests use (`http`, `sse_events`), the normalisation of run-to-run values before a response is
stored (`normalize`, `record_json`, `record_stream`), Prometheus text parsing and the metric-shape
checks (`metrics`, `assert_family`, `check_metric_shapes`), and the fixture file itself: shapes,
their diff, and `WireRecorder` (behind conftest's session fixture `wire`), which writes
``fixtures/vllm_0.32.0_wire.json`` under ``DISAGGPOOL_RECORD_FIXTURES=1`` and otherwise compares
live shapes with it. Only the standard library talks to the engines."""

from __future__ import annotations

import json
import random
import re
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disaggpool.pdwire import prefill_leg_params

MODEL_NAME = "tiny"
MAX_MODEL_LEN = 2048
VLLM_VERSION = "0.32.0"
ERROR_KEYS = ["message", "type", "param", "code"]

# kv_transfer_params returned by a 0.32.0 prefill engine, in the order it sends them.
# docs/vllm-protocol.md §2.2 (vLLM 0.33.0) also lists remote_registration_generation
# (added with NIXL connector version 15); 0.32.0 does not send it.
KV_TRANSFER_PARAMS_FIELDS = [
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    "remote_prefill_cached_tokens",
]

# What the toy proxy (and the llm-d sidecar) puts into the prefill leg.
EXPIRY_COUNTERS = (
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:nixl_num_notifications_after_expiry_total",
)

PREFILL_KV_PARAMS = prefill_leg_params()  # what the front door and pd-proxy send, checked here


# ------------------------------------------------------------------ HTTP helpers


@dataclass
class Resp:
    status: int
    headers: dict[str, str]
    body: bytes
    elapsed_s: float

    def json(self) -> Any:
        return json.loads(self.body)


def http(
    method: str,
    url: str,
    body: Any = None,
    headers: dict[str, str] | None = None,
    timeout: float = 180.0,
) -> Resp:
    data: bytes | None = None
    hdrs: dict[str, str] = {}
    if isinstance(body, dict | list):
        data = json.dumps(body).encode()
        hdrs["Content-Type"] = "application/json"
    elif isinstance(body, bytes):
        data = body
        hdrs["Content-Type"] = "application/json"
    hdrs.update(headers or {})
    req = urllib.request.Request(url, data=data, method=method, headers=hdrs)
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            payload = r.read()
            status, raw_headers = r.status, r.headers
    except urllib.error.HTTPError as e:
        payload, status, raw_headers = e.read(), e.code, e.headers
    return Resp(
        status=status,
        headers={k.lower(): v for k, v in raw_headers.items()},
        body=payload,
        elapsed_s=time.monotonic() - t0,
    )


def sse_events(resp: Resp) -> list[Any]:
    """Split an SSE body into its ``data:`` payloads (JSON decoded, "[DONE]" kept as is)."""
    text = resp.body.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    events: list[Any] = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: "), f"not an SSE data event: {block[:200]!r}"
        assert "\n" not in block, f"multi-line SSE event: {block[:200]!r}"
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events.count("[DONE]") == 1
    return events


def new_rid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:12]}"


def make_prompt(words: list[str], n: int, seed: int) -> str:
    """n words, each a single token of the tiny model (prompt tokens = n + 1 for the BOS)."""
    return " ".join(random.Random(seed).choices(words, k=n))


# ------------------------------------------------------------------ normalisation


def _norm_id(value: str, rid: str | None) -> str:
    if rid and rid in value:
        value = value.replace(rid, "<REQUEST_ID>")
        return re.sub(r"-[0-9A-Za-z]{8}$", "-<RAND8>", value) if value.count("-") > 1 else value
    m = re.fullmatch(r"([a-z_]+)-[0-9a-f]{16,32}", value)
    return f"{m.group(1)}-<RANDOM_ID>" if m else value


def _norm_kv_params(params: dict[str, Any], rid: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k == "remote_engine_id" and isinstance(v, str):
            out[k] = "<ENGINE_ID>"
        elif k == "remote_request_id" and isinstance(v, str):
            out[k] = _norm_id(v, rid)
        elif k == "remote_port" and isinstance(v, int):
            out[k] = "<SIDE_CHANNEL_PORT>"
        elif k == "remote_block_ids" and isinstance(v, list):
            counter = iter(range(1, 1 << 30))
            out[k] = [[next(counter) for _ in g] if isinstance(g, list) else g for g in v]
        else:
            out[k] = v
    return out


def normalize(obj: Any, rid: str | None = None) -> Any:
    """Replace run-dependent values by placeholders (see the fixture's _meta.normalisation)."""
    if isinstance(obj, list):
        return [normalize(v, rid) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out: dict[str, Any] = {}
    for k, v in obj.items():
        if k == "id" and isinstance(v, str):
            out[k] = _norm_id(v, rid)
        elif k == "created" and isinstance(v, int):
            out[k] = "<CREATED>"
        elif k == "system_fingerprint" and isinstance(v, str):
            out[k] = re.sub(r"^(vllm-[0-9.]+-).+$", r"\1<FINGERPRINT>", v)
        elif k in ("text", "content") and isinstance(v, str) and v:
            out[k] = "<TEXT>"
        elif k == "root" and isinstance(v, str):
            out[k] = "<MODEL_DIR>"
        elif k == "kv_transfer_params" and isinstance(v, dict):
            out[k] = _norm_kv_params(v, rid)
        else:
            out[k] = normalize(v, rid)
    return out


def record_json(resp: Resp, rid: str | None = None, request: Any = None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "status": resp.status,
        "content_type": resp.headers.get("content-type"),
        "x_request_id_echoed": "x-request-id" in resp.headers,
    }
    if request is not None:
        rec["request"] = request
    rec["body"] = normalize(resp.json(), rid) if resp.body else ""
    return rec


def record_stream(resp: Resp, events: list[Any], rid: str | None, request: Any) -> dict[str, Any]:
    return {
        "status": resp.status,
        "content_type": resp.headers.get("content-type"),
        "framing": "each event is 'data: <json>\\n\\n'; the stream ends with 'data: [DONE]\\n\\n'",
        "request": request,
        "events": normalize(events, rid),
    }


# ------------------------------------------------------------------ Prometheus text parsing


@dataclass
class Family:
    name: str
    type: str
    samples: list[tuple[str, dict[str, str], float]]

    def label_names(self) -> list[str]:
        names: set[str] = set()
        for _, labels, _ in self.samples:
            names.update(k for k in labels if k not in ("le", "quantile"))
        return sorted(names)

    def value(self, sample: str, **labels: str) -> float:
        total = 0.0
        for name, lab, val in self.samples:
            if name == sample and all(lab.get(k) == v for k, v in labels.items()):
                total += val
        return total


RECORDED_LABEL_VALUES = ("engine", "model_name", "finished_reason", "reason", "source", "stage")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, Family]:
    families: dict[str, Family] = {}
    current: Family | None = None
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, typ = line.split(" ", 3)
            current = families[name] = Family(name, typ, [])
            continue
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparsable metrics line: {line!r}"
        name = m.group(1)
        assert current is not None and name.startswith(current.name), line
        labels = dict(_LABEL.findall(m.group(2) or ""))
        current.samples.append((name, labels, float(m.group(3))))
    return families


def metrics(url: str) -> dict[str, Family]:
    r = http("GET", url + "/metrics")
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.body.decode())


def summarize_families(families: dict[str, Family]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in sorted(families):
        fam = families[name]
        info: dict[str, Any] = {
            "type": fam.type,
            "labels": fam.label_names(),
            "samples": sorted({s[len(name) :] or "<name>" for s, _, _ in fam.samples}),
        }
        if fam.type == "histogram":
            first = next((lab for s, lab, _ in fam.samples if s.endswith("_bucket")), None)
            if first is not None:
                rest = {k: v for k, v in first.items() if k != "le"}
                info["buckets"] = [
                    lab["le"]
                    for s, lab, _ in fam.samples
                    if s.endswith("_bucket") and {k: v for k, v in lab.items() if k != "le"} == rest
                ]
        label_values: dict[str, list[str]] = {}
        for lname in info["labels"]:
            if lname in RECORDED_LABEL_VALUES or name == "vllm:cache_config_info":
                values = {lab[lname] for _, lab, _ in fam.samples if lname in lab}
                label_values[lname] = sorted(values)
        if label_values:
            info["label_values"] = label_values
        out[name] = info
    return out


def check_metric_shapes(wire: Any, key: str, live: dict[str, Any]) -> None:
    wire.capture("metrics", key, live, check_shape=False)
    exp = wire.expected("metrics", key)
    if exp is None or wire.recording:
        return
    problems = []
    for name, want in exp.items():
        if not name.startswith("vllm:"):
            continue
        got = live.get(name)
        if got is None:
            problems.append(f"{name} missing")
        elif (got["type"], got["labels"]) != (want["type"], want["labels"]):
            problems.append(f"{name}: {got['type']} {got['labels']} != fixture {want}")
    assert not problems, "metrics differ from the fixture:\n" + "\n".join(problems)


def assert_family(
    fams: dict[str, Family], name: str, typ: str, labels: list[str] | None = None
) -> Family:
    assert name in fams, f"{name} not in /metrics (have {sorted(f for f in fams if 'vllm' in f)})"
    fam = fams[name]
    assert fam.type == typ, f"{name} is a {fam.type}, expected {typ}"
    if labels is not None:
        assert fam.label_names() == sorted(labels), f"{name} labels {fam.label_names()}"
    for _, lab, _ in fam.samples:
        if "model_name" in lab:
            assert lab["model_name"] == MODEL_NAME
        if "engine" in lab:
            assert lab["engine"] == "0"
    return fam


def wait_for(predicate: Any, timeout: float = 10.0) -> Any:
    """Metrics are pushed from the engine asynchronously: poll for a little while."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.2)


# ================================================================== single engine


def block_size(url: str) -> int:
    ((_, labels, _),) = metrics(url)["vllm:cache_config_info"].samples
    return int(labels["block_size"])


# ------------------------------------------------------------------ wire fixture file


def shape(value: Any) -> Any:
    """The JSON shape of a value: key sets and value types, not the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(v) for v in value]
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return type(value).__name__


def shape_diff(live: Any, expected: Any, path: str = "$") -> list[str]:
    """Differences between two shapes (dict key order is ignored)."""
    if isinstance(expected, dict) and isinstance(live, dict):
        out = [f"{path}: key {k!r} missing" for k in expected if k not in live]
        out += [f"{path}: unexpected key {k!r}" for k in live if k not in expected]
        for k in expected:
            if k in live:
                out += shape_diff(live[k], expected[k], f"{path}.{k}")
        return out
    if isinstance(expected, list) and isinstance(live, list):
        if len(expected) != len(live):
            return [f"{path}: {len(live)} items, fixture has {len(expected)}"]
        out = []
        for i, (a, b) in enumerate(zip(live, expected, strict=True)):
            out += shape_diff(a, b, f"{path}[{i}]")
        return out
    return [] if live == expected else [f"{path}: {live!r} != fixture {expected!r}"]


def dumps_readable(obj: Any, indent: int = 0, width: int = 100, lead: int = 0) -> str:
    """JSON with two-space indentation where containers that fit on one line stay on one line
    (keeps the fixture short and diff-friendly; deterministic). ``lead``: characters already
    on the line (a dict key)."""
    flat = json.dumps(obj, ensure_ascii=False)
    if not isinstance(obj, dict | list) or not obj or indent + lead + len(flat) <= width:
        return flat
    pad = " " * (indent + 2)
    if isinstance(obj, dict):
        items = []
        for k, v in obj.items():
            key = json.dumps(k, ensure_ascii=False) + ": "
            items.append(pad + key + dumps_readable(v, indent + 2, width, len(key)))
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + dumps_readable(v, indent + 2, width) for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


class WireRecorder:
    """Collects normalised real responses; writes them (record mode) or checks shapes."""

    def __init__(self, path: Path, recording: bool) -> None:
        self.path = path
        self.recording = recording
        self.existing: dict[str, Any] | None = None
        if path.exists():
            self.existing = json.loads(path.read_text())
        self.captured: dict[str, dict[str, Any]] = {}
        self.meta: dict[str, Any] = {}

    def expected(self, section: str, key: str) -> Any | None:
        if self.existing is None:
            return None
        return self.existing.get(section, {}).get(key)

    def capture(self, section: str, key: str, value: Any, check_shape: bool = True) -> None:
        """Store a normalised value; outside record mode assert it has the recorded shape."""
        self.captured.setdefault(section, {})[key] = value
        if self.recording or not check_shape:
            return
        exp = self.expected(section, key)
        if exp is None:
            return
        diff = shape_diff(shape(value), shape(exp))
        assert not diff, f"{section}/{key} differs in shape from {self.path.name}:\n" + "\n".join(
            diff[:30]
        )

    def capture_stream(self, section: str, key: str, live: dict[str, Any]) -> None:
        """Under load vLLM coalesces several tokens into one chunk (even all of them, with the
        finish_reason), so the number of chunks varies: compare the last two events (usage
        chunk, [DONE]) and require every live chunk shape to occur in the fixture."""
        self.captured.setdefault(section, {})[key] = live
        exp = self.expected(section, key)
        if exp is None or self.recording:
            return
        live_shapes = [json.dumps(shape(e), sort_keys=True) for e in live["events"]]
        exp_shapes = [json.dumps(shape(e), sort_keys=True) for e in exp["events"]]
        where = f"{section}/{key} vs {self.path.name}"
        assert live_shapes[-2:] == exp_shapes[-2:], f"{where}: final chunks differ in shape"
        extra = set(live_shapes) - set(exp_shapes)
        assert not extra, f"{where}: chunk shapes the fixture lacks: {sorted(extra)[:3]}"
        assert live["content_type"] == exp["content_type"], where

    def write(self, meta: dict[str, Any]) -> None:
        merged: dict[str, Any] = dict(self.existing or {})
        for section, values in self.captured.items():
            base = dict(merged.get(section, {}))
            base.update(values)
            merged[section] = {k: base[k] for k in sorted(base)}
        merged["_meta"] = meta
        ordered = {k: merged[k] for k in sorted(merged)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(dumps_readable(ordered) + "\n")
