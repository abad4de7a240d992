"""`disaggpool loadgen`: replay a trace against any OpenAI-compatible endpoint and score it.

Like vLLM's benchmark client (`vllm bench serve`): each trace request is sent at its arrival time
(divided by `--rate-scale`, so 2 means twice the rate) as a streaming ``/v1/completions`` request
whose prompt is a list of exactly `prompt_tokens` token ids and whose output is pinned to
`output_tokens` with ``max_tokens`` + ``ignore_eos``, so lengths are those of the trace whatever
the model. TTFT is the time to the first streamed token; TPOT is (latency - TTFT) / (n - 1) with n
from the final ``usage`` block; a request meets its SLO when both are within its class targets
(the class is sent as header ``X-SLO-Class``, which the disaggpool front door reads). A request
that errors or is refused counts against goodput, and every one is accounted for in the report.
The per-request rows of ``--json`` carry that verdict (`met`) and the pods that served the request
when the server names them in the ``X-Disaggpool-Prefill-Pod`` / ``X-Disaggpool-Decode-Pod``
response headers (empty otherwise, e.g. a plain vLLM), so a user can bootstrap an interval or
split the results by pod without scoring the SLO again.

Several targets (`--target` given more than once, e.g. router replicas behind no load balancer):
request i goes to target i mod N, a fixed round-robin over the trace order, so a replay is
repeatable and each replica sees every N-th request; each row names its `target`. The model name
is asked of the first target.

Traces with prefix blocks (`TraceRequest.blocks`, e.g. the Mooncake trace): every block id becomes
one fixed run of `block_tokens` token ids, drawn from a generator seeded by the id alone, and a
prompt is its blocks' runs cut to `prompt_tokens`. Requests sharing leading ids therefore send
identical leading tokens, so a real vLLM's prefix cache hits on them as it would on the traffic
the trace recorded; without blocks every prompt is fresh random ids.

`replay` is the library entry point (the demo calls it); `register` adds the subcommand.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp

from disaggpool import progress
from disaggpool.core.contracts import SLOClass
from disaggpool.core.stats import percentile
from disaggpool.errors import InputError
from disaggpool.formats.traces import TraceRequest, read_trace
from disaggpool.pdwire import DECODE_POD_HEADER, PREFILL_POD_HEADER

__all__ = ["LoadReport", "RequestResult", "register", "replay"]


@dataclasses.dataclass(frozen=True, slots=True)
class RequestResult:
    index: int
    slo_class: str
    ok: bool
    status: int  # HTTP status (0: no response at all)
    ttft_s: float
    tpot_s: float
    latency_s: float
    output_tokens: int
    error: str = ""
    prefill_pod: str = ""  # from PREFILL_POD_HEADER; "" when the server does not say
    decode_pod: str = ""  # from DECODE_POD_HEADER; "" when the server does not say
    target: str = ""  # the base URL it was sent to


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    results: list[RequestResult]
    duration_s: float
    slo_classes: dict[str, SLOClass]

    def met(self, r: RequestResult) -> bool:
        slo = self.slo_classes[r.slo_class]
        return r.ok and slo.met(r.ttft_s, r.tpot_s)

    def rows(self) -> list[dict[str, Any]]:
        """One dict per request, in trace order, with `met`: whether it met its class's SLO
        (what `summary`'s goodput averages)."""
        return [{**dataclasses.asdict(r), "met": self.met(r)} for r in self.results]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        ttft = sorted(r.ttft_s for r in ok)
        tpot = sorted(r.tpot_s for r in ok if r.output_tokens > 1)
        by_class = {
            name: [r for r in self.results if r.slo_class == name] for name in self.slo_classes
        }
        errors: dict[str, int] = {}
        for r in self.results:
            if not r.ok:
                key = str(r.status) if r.status else "no response"
                errors[key] = errors.get(key, 0) + 1
        n = len(self.results)
        return {
            "requests": n,
            "completed": len(ok),
            "errors": n - len(ok),
            "errors_by_status": errors,
            "goodput": sum(self.met(r) for r in self.results) / n if n else 0.0,
            "goodput_by_class": {
                c: (sum(self.met(r) for r in rs) / len(rs) if rs else None)
                for c, rs in by_class.items()
            },
            "duration_s": round(self.duration_s, 3),
            "throughput_rps": len(ok) / self.duration_s if self.duration_s > 0 else 0.0,
            "output_tokens_per_s": (
                sum(r.output_tokens for r in ok) / self.duration_s if self.duration_s > 0 else 0.0
            ),
            **{f"ttft_{q}_s": percentile(ttft, p) for q, p in _QS},
            **{f"tpot_{q}_s": percentile(tpot, p) for q, p in _QS},
        }


_QS = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


def _prompt(n: int, rng: random.Random, vocab: int) -> list[int]:
    # Ids from 3 up: 0-2 are special tokens on Llama-style vocabularies (and the emulator's).
    return [rng.randrange(3, vocab) for _ in range(n)]


def block_prompt(req: TraceRequest, vocab: int, runs: dict[int, list[int]]) -> list[int]:
    """The prompt of a request with prefix blocks: each block id's fixed run of token ids (cached
    in `runs`), cut to `req.prompt_tokens` (module docstring)."""
    out: list[int] = []
    for block in req.blocks:
        run = runs.get(block)
        if run is None:
            run = runs[block] = _prompt(req.block_tokens, random.Random(block), vocab)
        out.extend(run)
    return out[: req.prompt_tokens]


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    index: int,
    req: TraceRequest,
    slo_class: str,
    header_class: str,
    prompt: list[int],
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.output_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"X-SLO-Class": header_class} if header_class else {}
    t0 = time.monotonic()
    first = 0.0
    usage = 0
    chunks = 0
    pods = ("", "")
    try:
        async with session.post(f"{url}/v1/completions", json=body, headers=headers) as resp:
            pods = (
                resp.headers.get(PREFILL_POD_HEADER, ""),
                resp.headers.get(DECODE_POD_HEADER, ""),
            )
            if resp.status != 200:
                text = await resp.text()
                return RequestResult(
                    index, slo_class, False, resp.status, 0, 0, time.monotonic() - t0, 0,
                    text[:300], *pods,
                )  # fmt: skip
            done = False
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    raise RuntimeError(event["error"].get("message", "error event"))
                if any(c.get("text") for c in event.get("choices") or ()):
                    chunks += 1
                    if not first:
                        first = time.monotonic()
                if event.get("usage"):
                    usage = int(event["usage"].get("completion_tokens") or 0)
            if not done:
                raise RuntimeError("stream ended without [DONE]")
    except (aiohttp.ClientError, TimeoutError, OSError, RuntimeError, ValueError) as exc:
        return RequestResult(
            index, slo_class, False, 0, 0, 0, time.monotonic() - t0, 0,
            str(exc) or type(exc).__name__, *pods,
        )  # fmt: skip
    end = time.monotonic()
    out = usage or chunks
    ttft = (first or end) - t0
    tpot = (end - first) / (out - 1) if out > 1 and first else 0.0
    return RequestResult(index, slo_class, True, 200, ttft, tpot, end - t0, out, "", *pods)


async def replay(
    target: str | Sequence[str],
    trace: Sequence[TraceRequest],
    slo_classes: Sequence[SLOClass],
    *,
    model: str = "",
    rate_scale: float = 1.0,
    vocab_size: int = 500,
    seed: int = 0,
    on_done: Callable[[RequestResult], None] | None = None,
    send_default_class: bool = True,
) -> LoadReport:
    """Send every request of `trace` at its (scaled) arrival time; wait for all of them.
    With several targets, request i goes to ``target[i % len(target)]`` (module docstring).
        Without `send_default_class`, requests of the default class go without ``X-SLO-Class``
        (the server picks its own default; they are still scored against `slo_classes[0]`)."""
    if rate_scale <= 0:
        raise InputError("--rate-scale", "<arg>", "must be positive")
    classes = {c.name: c for c in slo_classes}
    default = slo_classes[0].name
    urls = [t.rstrip("/") for t in ([target] if isinstance(target, str) else target)]
    if not urls:
        raise InputError("--target", "<arg>", "at least one base URL")
    rng = random.Random(seed)
    runs: dict[int, list[int]] = {}
    prompts = [
        block_prompt(r, vocab_size, runs) if r.blocks else _prompt(r.prompt_tokens, rng, vocab_size)
        for r in trace
    ]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        if not model:
            model = await _served_model(session, urls[0])
        t0 = time.monotonic()

        async def fire(i: int, req: TraceRequest) -> RequestResult:
            delay = t0 + req.arrival_s / rate_scale - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            name = req.slo_class or default
            if name not in classes:
                raise InputError("trace", f"request {i}.slo_class", f"unknown class {name!r}")
            sent = name if send_default_class or name != default else ""
            url = urls[i % len(urls)]
            result = await _one(session, url, model, i, req, name, sent, prompts[i])
            result = dataclasses.replace(result, target=url)
            if on_done is not None:
                on_done(result)
            return result

        results = await asyncio.gather(*(fire(i, r) for i, r in enumerate(trace)))
        duration = time.monotonic() - t0
    return LoadReport(list(results), duration, classes)


async def _served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as resp:
        data = await resp.json(content_type=None)
    try:
        return str(data["data"][0]["id"])
    except (KeyError, IndexError, TypeError):
        raise InputError("--target", "/v1/models", "lists no model; pass --model") from None


def _slo_arg(text: str) -> SLOClass:
    name, _, rest = text.partition(":")
    ttft, _, tpot = rest.partition(":")
    try:
        slo = SLOClass(name, float(ttft), float(tpot))
    except ValueError:
        raise InputError("--slo", text, "expected NAME:TTFT_S:TPOT_S") from None
    if not name or slo.ttft_s <= 0 or slo.tpot_s <= 0:
        raise InputError("--slo", text, "expected NAME:TTFT_S:TPOT_S with positive targets")
    return slo


def _run(args: argparse.Namespace) -> int:
    classes = [_slo_arg(s) for s in args.slo] or [SLOClass("default", 2.0, 0.1)]
    trace = read_trace(args.trace, default_class=classes[0].name)
    if args.limit:
        trace = trace[: args.limit]
    if not trace:
        raise InputError(args.trace, "<file>", "no requests")
    bar = progress.bar(total=len(trace), desc="requests", unit="req", leave=False)

    def tick(_: object) -> None:
        bar.update(1)

    report = asyncio.run(
        replay(
            args.target,
            trace,
            classes,
            model=args.model or "",
            rate_scale=args.rate_scale,
            vocab_size=args.vocab_size,
            seed=args.seed,
            on_done=tick,
            send_default_class=bool(args.slo),
        )
    )
    bar.close()
    summary = report.summary()
    width = max(len(k) for k in summary)
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json:
        doc = {"summary": summary, "requests": report.rows()}
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


def register(sub: Any) -> None:
    p = sub.add_parser("loadgen", help="replay a trace against an OpenAI-compatible endpoint")
    p.add_argument(
        "--target", required=True, action="append", metavar="URL",
        help="base URL, e.g. http://127.0.0.1:8000; repeat it to spread the requests over "
        "several (request i goes to the (i mod N)-th, e.g. router replicas)",
    )  # fmt: skip
    p.add_argument("--trace", required=True, metavar="FILE", help="CSV or Azure 2023 trace")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the arrival rate")
    p.add_argument(
        "--slo", action="append", default=[], metavar="NAME:TTFT_S:TPOT_S",
        help="an SLO class (repeatable; the first is the default). Without any, requests go "
        "without X-SLO-Class (the server's default) and are scored against 2 s TTFT, 0.1 s TPOT",
    )  # fmt: skip
    p.add_argument("--model", help="model name (default: the target's /v1/models)")
    p.add_argument("--limit", type=int, default=0, help="replay only the first N requests")
    p.add_argument("--vocab-size", type=int, default=500, help="prompt token ids are below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--json",
        metavar="FILE",
        help="write the summary and every request (its times, `met`: whether it met its SLO, "
        "the target it went to, and the prefill/decode pods that served it where the server "
        "names them)",
    )
    p.set_defaults(func=_run)
