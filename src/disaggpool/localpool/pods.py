"""Emulated vLLM pods as child processes: started from profiles, their gauges read, caches emptied.

`start_emulators` runs one `disaggpool emulate` per pod, timed by the profile it is given (the
pod's hidden truth: whoever routes to it learns it only by probing), each on its own HTTP port
and NIXL side-channel port (two emulators on one machine would otherwise clash on vLLM's default
side-channel port), and returns once every one answers /health. The readers use vLLM's own
surface (`/metrics`, `POST /reset_prefix_cache`), so they read a real vLLM pod alike.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

from disaggpool import promtext
from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.profiles import save_profile
from disaggpool.localpool.processes import child_env, disaggpool_command, free_port, wait_http

__all__ = ["cache_counts", "reset_caches", "start_emulators", "wait_idle"]


def start_emulators(
    profiles: Mapping[str, CalibrationProfile],
    tmp: Path,
    procs: list[subprocess.Popen[bytes]],
    *,
    seed: int,
    prefix_caching: bool,
) -> dict[str, str]:
    """One emulator per pod of `profiles` (pod name -> its true profile), ready: pod -> URL.

    The profiles go to ``tmp/true-<pod>.yaml``, the logs to ``tmp/<pod>.log``, the processes into
    `procs` (`processes` stops them). Pod k is seeded ``seed + k``. With `prefix_caching` the pods
    cache prompt prefixes and open vLLM's dev endpoints (`reset_caches` needs them)."""
    caching = ["--enable-prefix-caching"] if prefix_caching else ["--no-enable-prefix-caching"]
    urls: dict[str, str] = {}
    started: list[subprocess.Popen[bytes]] = []
    for name, true in profiles.items():
        path = tmp / f"true-{name}.yaml"
        save_profile(true, path)
        port = free_port()
        urls[name] = f"http://127.0.0.1:{port}"
        env = child_env(VLLM_NIXL_SIDE_CHANNEL_PORT=str(free_port()))
        if prefix_caching:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        log = (tmp / f"{name}.log").open("wb")
        started.append(
            subprocess.Popen(
                disaggpool_command("emulate", "--profile", str(path), "--port", str(port),
                                   "--seed", str(seed + len(started)), *caching),
                env=env, stdout=log, stderr=subprocess.STDOUT,
            )
        )  # fmt: skip
        procs.append(started[-1])
    for name, proc in zip(profiles, started, strict=True):
        wait_http(f"{urls[name]}/health", proc)
    return urls


def _running(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
    return sum(s.value for s in promtext.parse(text, names))


def wait_idle(urls: Sequence[str], timeout: float = 120.0) -> None:
    """Until no pod at `urls` runs or queues a request (at most `timeout` seconds)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if all(_running(u) == 0 for u in urls):
            return
        time.sleep(0.5)


def cache_counts(urls: Sequence[str]) -> tuple[float, float]:
    """Prompt tokens looked up and found cached, summed over the pods at `urls`."""
    names = ["vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"]
    queries = hits = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
            fams = promtext.parse(resp.read().decode(), names)
        queries += promtext.total(fams, names[0])
        hits += promtext.total(fams, names[1])
    return queries, hits


def reset_caches(urls: Sequence[str], timeout: float = 60.0) -> None:
    """Empty every pod's prefix cache (vLLM's dev endpoint), so that no run finds the previous
    one's prompts; a pod refuses while KV is still lent (a lease not yet returned): retried."""
    end = time.monotonic() + timeout
    for url in urls:
        while True:
            req = urllib.request.Request(f"{url}/reset_prefix_cache", data=b"", method="POST")
            with urllib.request.urlopen(req, timeout=5) as resp:
                if json.loads(resp.read()).get("success"):
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"{url}: the prefix cache could not be reset")
            time.sleep(0.5)
