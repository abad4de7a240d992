"""The real vLLM engines of tests/realvllm, as processes: where the venv and model are, whether
they are there (`require_real_vllm`), one engine (`Engine`, `make_engine`), the NIXL prefill/decode
pair with its warm-up handoff (`PDPair`), and the `Launcher` that starts the groups the selected
tests need, all at once, and waits for each lazily. conftest.py turns these into the session
fixtures `single_engine` and `pd_pair` (its module docstring lists the environment variables);
`prometheus_value` and `post_json` are the small HTTP reads the other modules share."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from disaggpool import promtext
from disaggpool.pdwire import prefill_leg_params

VLLM_VERSION = "0.32.0"
SERVED_MODEL = "tiny"
MAX_MODEL_LEN = 2048
VENV = Path(os.environ.get("DISAGGPOOL_VLLM_VENV", "/var/cache/disaggpool/vllm-venv"))
MODEL = Path(os.environ.get("DISAGGPOOL_VLLM_MODEL", "/var/cache/disaggpool/tiny-llama"))
ENV_MARKER = VENV / ".disaggpool-vllm-env.sha256"
START_TIMEOUT_S = float(os.environ.get("DISAGGPOOL_REAL_VLLM_START_TIMEOUT", "360"))

#: A warm-up handoff counts as clean when D's leg answered within this (P's KV lease is 30 s).
WARM_LEG_WITHIN_S = 20.0

NIXL_COUNTERS = (
    "vllm:nixl_num_failed_transfers_total",
    "vllm:nixl_num_failed_notifications_total",
    "vllm:nixl_num_kv_expired_reqs_total",
    "vllm:nixl_num_notifications_after_expiry_total",
)
SINGLE = "single"
PD = "pd"


# ------------------------------------------------------------------ availability


def _unavailable_reason() -> str | None:
    required = os.environ.get("DISAGGPOOL_REQUIRE_REAL_VLLM") == "1"
    if not required and os.environ.get("DISAGGPOOL_SKIP_REAL_VLLM") == "1":
        return "DISAGGPOOL_SKIP_REAL_VLLM=1"
    if not (VENV / "bin" / "python").exists() or not ENV_MARKER.exists():
        return (
            f"real vLLM venv missing or incomplete at {VENV} "
            "(build it with: bash scripts/vllm_env.sh)"
        )
    if not (MODEL / "config.json").exists():
        return f"tiny model missing at {MODEL} (build it with: bash scripts/vllm_env.sh)"
    return None


def require_real_vllm() -> None:
    reason = _unavailable_reason()
    if reason is None:
        return
    if os.environ.get("DISAGGPOOL_REQUIRE_REAL_VLLM") == "1":
        pytest.fail(f"DISAGGPOOL_REQUIRE_REAL_VLLM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


# ------------------------------------------------------------------ engine processes


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpu_sets() -> tuple[str, str]:
    """Two disjoint OMP core sets (prefill, decode): without pinning the two engines fight over
    the cores and decode steps get several times slower (docs/real-vllm-on-cpu.md §5)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return str(cpus[0]), str(cpus[0])
    half = len(cpus) // 2
    return ",".join(map(str, cpus[:half])), ",".join(map(str, cpus[half:]))


@dataclass
class Engine:
    name: str
    port: int
    log_path: Path
    cmd: list[str]
    env: dict[str, str]
    kv_role: str | None = None
    side_channel_port: int | None = None
    kv_events_endpoint: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    ready_after_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own process group: API server, EngineCore, worker
            )

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        lines = [ln for ln in lines if "Route: " not in ln]
        return "\n".join(lines[-n:])

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, deadline: float) -> str | None:
        """None when /health answers 200, else a reason (process died or timeout)."""
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"{self.name} exited with code {self.proc.returncode}"
            if self.healthy():
                self.ready_after_s = round(time.monotonic() - self.started_at, 1)
                return None
            time.sleep(1.0)
        return f"{self.name} not healthy after {START_TIMEOUT_S:.0f}s"

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        self.proc = None
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=30)
        # Children (EngineCore, worker, resource tracker) share the process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def _engine_env(omp_bind: str, side_channel_port: int | None) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"PYTHONPATH", "VIRTUAL_ENV", "PROMETHEUS_MULTIPROC_DIR", "PYTHONHOME"}
    }
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND=omp_bind,
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{VENV / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
    )
    if side_channel_port is not None:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        # With UCX's default transports the KV pull between two local processes goes over TCP,
        # which only moves while P's worker calls into NIXL, i.e. while P's engine loop runs:
        # D legs then stall for seconds when P is idle, up to P's 30 s KV lease (README).
        # Shared memory needs no progress on P. Set UCX_TLS=all to get UCX's default back.
        env.setdefault("UCX_TLS", "self,sm,tcp")
    return env


def make_engine(
    name: str,
    log_dir: Path,
    omp_bind: str,
    kv_role: str | None = None,
    *,
    kv_events: bool = False,
) -> Engine:
    port = free_port()
    cmd = [
        str(VENV / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(MODEL),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--dtype",
        "float32",
    ]
    side = None
    if kv_role is not None:
        side = free_port()
        cfg = {"kv_connector": "NixlConnector", "kv_role": kv_role, "kv_buffer_device": "cpu"}
        cmd += ["--kv-transfer-config", json.dumps(cfg)]
    events_endpoint = None
    if kv_events:
        # An ipc:// endpoint, which vLLM binds: a socket file, nothing listens on the network.
        # (vLLM 0.32 on CPU delivered nothing through a PUB that connects to the test's SUB.)
        events_endpoint = f"ipc://{tempfile.gettempdir()}/disaggpool-kv-{port}.ipc"
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": events_endpoint,
            "topic": "kv@single",
        }
        cmd += ["--kv-events-config", json.dumps(events)]
    return Engine(
        name=name,
        port=port,
        log_path=log_dir / f"{name}-{port}.log",
        cmd=cmd,
        env=_engine_env(omp_bind, side),
        kv_role=kv_role,
        side_channel_port=side,
        kv_events_endpoint=events_endpoint,
    )


@dataclass
class PDPair:
    prefill: Engine
    decode: Engine

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return (self.prefill, self.decode)

    warmup: dict[str, Any] = field(default_factory=dict)
    kv_held_s: list[float] = field(default_factory=list)  # per test handoff, see `record_handoff`

    @property
    def kv_roles(self) -> dict[str, str | None]:
        return {"prefill": self.prefill.kv_role, "decode": self.decode.kv_role}

    def warm_up(self) -> dict[str, Any]:
        """Take both engines' one-time costs before the tests, so that no test handoff runs into
        P's 30 s KV lease (``kv_lease_duration``).

        Measured on 0.32.0 CPU (see README): (a) an API server's first request can take tens of
        seconds on a loaded machine (lazy initialisation); (b) D's first NIXL handshake with P
        (``add_remote_agent``, the UCX wire-up) blocked for 13 to 30 s in some runs until P's
        engine loop ran again (sending P requests meanwhile helped in some runs, not in all).
        If D's first leg outlives the lease, P releases the blocks
        ("Releasing expired KV blocks", vllm:nixl_num_kv_expired_reqs_total +1) and D reads them
        anyway ("Potentially invalid KV blocks"), the silent failure of docs/vllm-protocol.md §2.5.
        Once (with UCX_TLS=self,sm,tcp) D's ZMQ metadata request to P's side channel timed out
        after about 20 s (``zmq.error.Again``, ``handshake_failed``) and D answered HTTP 500,
        as docs/vllm-protocol.md §2.5 says for a failed handshake.
        So: one plain request to each engine, then up to three handoffs, until one succeeds
        well inside the lease (a leg that outlived it "succeeded" on blocks P had freed, and
        left P an expired request: CI saw a 30.2 s warm-up leg), during which P gets small
        requests that keep its engine loop moving.
        """
        t_start = time.monotonic()
        plain = {"model": SERVED_MODEL, "prompt": "gek kar", "max_tokens": 2}
        for engine in self.engines:
            post_json(engine.url + "/v1/completions", plain, {})
        first_requests_s = round(time.monotonic() - t_start, 3)

        kv = prefill_leg_params()
        attempts = []
        for attempt in range(3):
            outcome = self._warm_up_handoff(kv, attempt)
            attempts.append(outcome)
            if outcome["error"] is None and outcome["decode_leg_s"] < WARM_LEG_WITHIN_S:
                break
        slowest = max(a["decode_leg_s"] for a in attempts)
        # A slow leg may have outlived P's 30 s lease; let the expiry (and its counters) land
        # before taking the baseline that test_pd_metrics compares with.
        time.sleep(max(0.0, 35 - slowest) + 2 if slowest > 10 else 1)
        self.settle_expiries()
        self.warmup = {
            "first_plain_requests_s": first_requests_s,
            "handoffs": attempts,
            "nixl_counters_after": {
                role: {name: prometheus_value(e.url, name) for name in NIXL_COUNTERS}
                for role, e in (("prefill", self.prefill), ("decode", self.decode))
            },
            "error": attempts[-1]["error"],
        }
        return self.warmup

    def record_handoff(self, handoff_s: float, timeout_s: float = 45.0) -> float:
        """After a test handoff that took `handoff_s` (P's leg and D's), wait until P has freed
        its KV blocks, poking both engines, and record how long P held them at most.

        P's lease starts when its engine finishes the prefill, before its answer, so the whole
        handoff bounds the time before D's pull. The release can lag after D answers: D's
        "done reading" notification and P's handling of it move only when each engine's loop
        steps (CI saw an expiry after a series of handoffs none slower than 19 s). Poking here
        makes every handoff end with P's blocks free, and the recorded time is what
        test_pd_metrics compares with P's 30 s lease.
        """
        t0 = time.monotonic()
        poke = {"model": SERVED_MODEL, "prompt": "gek", "max_tokens": 1}
        while time.monotonic() - t0 < timeout_s:
            if prometheus_value(self.prefill.url, "vllm:kv_cache_usage_perc") == 0:
                break
            for engine in self.engines:
                post_json(engine.url + "/v1/completions", poke, {})
            time.sleep(0.2)
        held = handoff_s + time.monotonic() - t0
        self.kv_held_s.append(held)
        return held

    def settle_expiries(self, timeout_s: float = 30.0) -> None:
        """A warm-up leg that outlived P's lease leaves P an expired request; D's late read of it
        reaches P as a notification whenever P's loop gets to it, seconds later (seen in CI: 8 s
        after the leg returned, after the baseline was taken, which then failed test_pd_metrics).
        Wait, poking P, until each expired request's late notification is counted, or until
        `timeout_s` (a request D never read sends none)."""
        expired = "vllm:nixl_num_kv_expired_reqs_total"
        late = "vllm:nixl_num_notifications_after_expiry_total"
        poke = {"model": SERVED_MODEL, "prompt": "gek", "max_tokens": 1}
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            url = self.prefill.url
            if prometheus_value(url, late) >= prometheus_value(url, expired):
                return
            post_json(url + "/v1/completions", poke, {})
            time.sleep(0.5)

    def _warm_up_handoff(self, kv: dict[str, Any], attempt: int) -> dict[str, Any]:
        prompt = " ".join(["gek", "kar"] * 20 + ["bir"] * attempt)
        hdr = {"X-Request-Id": f"warmup-{os.getpid()}-{attempt}"}
        body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1, "kv_transfer_params": kv}
        p = post_json(self.prefill.url + "/v1/completions", body, hdr)
        d_body = {
            "model": SERVED_MODEL,
            "prompt": prompt,
            "max_tokens": 2,
            "ignore_eos": True,
            "kv_transfer_params": p["kv_transfer_params"],
        }
        result: dict[str, Any] = {}

        def decode_leg() -> None:
            try:
                result["response"] = post_json(self.decode.url + "/v1/completions", d_body, hdr)
            except urllib.error.HTTPError as e:  # a failed handshake gives HTTP 500
                result["error"] = f"HTTP {e.code}: {e.read()[:300]!r}"
            except Exception as e:
                result["error"] = repr(e)

        t0 = time.monotonic()
        leg = threading.Thread(target=decode_leg, daemon=True)
        leg.start()
        pokes = 0
        while leg.is_alive() and time.monotonic() - t0 < 120:
            leg.join(0.25)
            if leg.is_alive():
                poke = {"model": SERVED_MODEL, "prompt": "gek", "max_tokens": 1}
                post_json(self.prefill.url + "/v1/completions", poke, {})
                pokes += 1
        leg.join(1)
        return {
            "decode_leg_s": round(time.monotonic() - t0, 3),
            "prefill_pokes": pokes,
            "error": result.get("error") or (None if "response" in result else "timeout"),
        }


def prometheus_value(url: str, sample: str) -> float:
    """Sum of one sample's values in an engine's /metrics."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return promtext.total(promtext.parse(text, [sample]), sample)


def post_json(url: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=180) as r:
        return json.loads(r.read())


@dataclass
class Launcher:
    """Starts the engine groups the selected tests need, all at once, and waits lazily."""

    log_dir: Path
    groups: set[str]
    engines: list[Engine] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _single: Engine | None = None
    _pd: PDPair | None = None

    def start_all(self) -> None:
        p_cpus, _ = _cpu_sets()
        if SINGLE in self.groups:
            self._single = make_engine("single", self.log_dir, p_cpus, kv_events=True)
            self._single.start()
            self.engines.append(self._single)
        if PD in self.groups:
            self._pd = self._start_pd("kv_producer", "kv_consumer")

    def _start_pd(self, p_role: str, d_role: str) -> PDPair:
        p_cpus, d_cpus = _cpu_sets()
        pair = PDPair(
            make_engine("prefill", self.log_dir, p_cpus, p_role),
            make_engine("decode", self.log_dir, d_cpus, d_role),
        )
        for e in (pair.prefill, pair.decode):
            e.start()
            self.engines.append(e)
        return pair

    def _fail(self, engines: list[Engine], reason: str) -> None:
        tails = "\n\n".join(f"--- {e.name} log ({e.log_path}) ---\n{e.log_tail()}" for e in engines)
        pytest.fail(f"{reason}\n{tails}", pytrace=False)

    def single(self) -> Engine:
        with self._lock:
            if SINGLE in self.results:
                return self._checked(SINGLE)
            assert self._single is not None, "single engine group was not launched"
            err = self._single.wait_healthy(time.monotonic() + START_TIMEOUT_S)
            self.results[SINGLE] = err
            if err is None:
                print(f"\n[realvllm] single engine ready after {self._single.ready_after_s}s")
            return self._checked(SINGLE)

    def pd(self) -> PDPair:
        with self._lock:
            if PD in self.results:
                return self._checked(PD)
            assert self._pd is not None, "P/D group was not launched"
            pair = self._pd
            deadline = time.monotonic() + START_TIMEOUT_S
            err = pair.prefill.wait_healthy(deadline) or pair.decode.wait_healthy(deadline)
            died = any(e.proc is None or e.proc.poll() is not None for e in pair.engines)
            if err is not None and died:
                # A role that this vLLM rejects makes an engine exit; retry as measured before.
                self.notes.append(f"kv_producer/kv_consumer failed ({err}); retried with kv_both")
                print(f"\n[realvllm] {err}; retrying the P/D pair with kv_role=kv_both")
                print(pair.prefill.log_tail(20), pair.decode.log_tail(20), sep="\n")
                pair.prefill.stop()
                pair.decode.stop()
                pair = self._pd = self._start_pd("kv_both", "kv_both")
                deadline = time.monotonic() + START_TIMEOUT_S
                err = pair.prefill.wait_healthy(deadline) or pair.decode.wait_healthy(deadline)
            if err is None:
                print(
                    f"\n[realvllm] P/D pair ready (prefill {pair.prefill.ready_after_s}s, "
                    f"decode {pair.decode.ready_after_s}s, roles {pair.kv_roles})"
                )
                warm = pair.warm_up()
                print(f"[realvllm] NIXL handshake warm-up: {warm}")
                if warm["error"] is not None:
                    err = f"P/D warm-up handoff failed: {warm['error']}"
            self.results[PD] = err
            return self._checked(PD)

    def _checked(self, group: str) -> Any:
        err = self.results[group]
        if group == SINGLE:
            assert self._single is not None
            if err is not None:
                self._fail([self._single], f"real vLLM single engine did not start: {err}")
            return self._single
        assert self._pd is not None
        if err is not None:
            self._fail(
                [self._pd.prefill, self._pd.decode], f"real vLLM P/D pair did not start: {err}"
            )
        return self._pd

    def stop_all(self) -> None:
        for e in self.engines:
            e.stop()
