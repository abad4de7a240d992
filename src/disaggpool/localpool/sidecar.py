"""A routing sidecar process in front of a local pool, and what it routed where.

`running_sidecar` writes a config, runs `disaggpool sidecar --config` on it and yields its URL
once it answers /health and has read the pool (one scrape and one pass over its profile
directory); leaving stops it, so each run gets a fresh router with nothing learned from the one
before. `routed_counts` reads from its /metrics how many requests it sent to each pod.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

from disaggpool import promtext
from disaggpool.localpool.processes import child_env, disaggpool_command, wait_http

__all__ = ["routed_counts", "running_sidecar", "static_pool"]


def static_pool(urls: Mapping[str, str], roles: Mapping[str, str]) -> dict[str, Any]:
    """The config's ``pool`` section for pods at `urls` (pod -> URL) with `roles` (pod -> role)."""
    return {
        "static": {
            role: [{"name": n, "url": urls[n]} for n, r in roles.items() if r == role]
            for role in ("prefill", "decode")
        }
    }


@contextlib.contextmanager
def running_sidecar(
    config: Mapping[str, Any],
    tmp: Path,
    name: str,
    procs: list[subprocess.Popen[bytes]],
) -> Iterator[str]:
    """A sidecar running `config` (its ``listen.http`` a free loopback address), ready: its URL.

    The config goes to ``tmp/<name>.yaml``, the log to ``tmp/<name>.log`` and the process into
    `procs` as well, so that `processes` stops it should this block not get to."""
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(dict(config)))
    log = (tmp / f"{name}.log").open("wb")
    proc = subprocess.Popen(
        disaggpool_command("sidecar", "--config", str(path)),
        env=child_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    procs.append(proc)
    url = f"http://{config['listen']['http']}"
    try:
        wait_http(f"{url}/health", proc)
        time.sleep(1.0)  # one scrape interval and a profile-directory pass
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def routed_counts(url: str) -> dict[str, dict[str, int]]:
    """Per role and pod, how many requests the sidecar at `url` sent there (from its metrics;
    under "prefill", "local" counts the prompts the P/D decider had a decode pod prefill itself)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as resp:
        metrics = resp.read().decode()
    counts: dict[str, dict[str, int]] = {"prefill": {}, "decode": {}}
    names = ["disaggpool_route_decisions_total", "disaggpool_local_prefills_total"]
    for sample in promtext.parse(metrics, names):
        local = sample.name == "disaggpool_local_prefills_total"
        role = "prefill" if local else sample.labels.get("role", "")
        pod = "local" if local else sample.labels["pod"]
        if role in counts:
            counts[role][pod] = counts[role].get(pod, 0) + int(sample.value)
    return {role: dict(sorted(c.items())) for role, c in counts.items()}
