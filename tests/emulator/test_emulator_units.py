"""Unit tests of the emulator's pure parts: the word tokenizer it shares with the sidecar, KV
blocks and leases, request parsing, response shapes, metric buckets, configuration, the command
line and the decode driver's per-step jitter. (The engines' aborts are tested in tests/engine.)"""

from __future__ import annotations

import asyncio
import itertools
import random
import statistics
from pathlib import Path

import pytest
from emulator_testkit import H100, make_profile

from disaggpool.emulator import cli
from disaggpool.emulator.config import (
    DEFAULT_MODEL,
    EmulatorConfig,
    keep_alive_from_env,
    side_channel_from_env,
)
from disaggpool.emulator.engine_driver import DecodeDriver
from disaggpool.emulator.errors import ApiError
from disaggpool.emulator.kv_blocks import BlockPool, Lease, LeaseTable
from disaggpool.emulator.metrics import Histogram, build_1_2_5_buckets
from disaggpool.emulator.requests import GenerationRequest, parse_completion
from disaggpool.emulator.responses import CHAT, COMPLETION, chunk, response, role_chunk
from disaggpool.engine.request import EngineRequest
from disaggpool.errors import InputError
from disaggpool.wordtokenizer import Tokenizer


# ---------------------------------------------------------------------------- tokenizer
def test_tokenizer_counts_words_and_punctuation() -> None:
    tok = Tokenizer()
    assert tok.pieces("Hello, world!  It's 42.") == [
        "Hello",
        ",",
        "world",
        "!",
        "It",
        "'",
        "s",
        "42",
        ".",
    ]
    assert tok.encode("Hello") == Tokenizer().encode("Hello")  # stable across instances
    assert all(0 <= i < tok.vocab_size for i in tok.encode("any text at all, ünïcödé 漢字"))


@pytest.mark.parametrize("vocab", [100, 32000, 150_000])
def test_tokenizer_round_trips_generated_text(vocab: int) -> None:
    tok = Tokenizer(vocab)
    rng = random.Random(vocab)
    ids = [tok.sample(rng) for _ in range(2000)]
    assert min(ids) >= 3  # never a special token
    assert tok.encode(tok.decode(ids)) == ids
    assert len({tok.word(i) for i in range(vocab)}) == vocab


def test_chat_template_is_counted() -> None:
    tok = Tokenizer()
    text = tok.chat_prompt([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<s><|user|>\nhi\n<|assistant|>\n"
    assert tok.encode(text)[0] == 1  # BOS
    assert len(tok.encode(text)) == 12


# ---------------------------------------------------------------------------- blocks and leases
def test_block_pool() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 1
    assert pool.allocate(2) is None and pool.num_free == 1  # all or nothing
    pool.free(a)
    pool.free(a)  # idempotent
    assert pool.num_free == 4 and pool.num_used == 0


def test_lease_table_expiry_and_heartbeats() -> None:
    table = LeaseTable(duration=3.0)
    table.hold(Lease("a", [0], 10, expires=3.0))
    table.hold(Lease("b", [1], 10, expires=4.0))
    assert table.next_expiry() == 3.0
    assert table.extend(["a", "zzz"], now=2.5) == 1  # to 2.5 + 2 = 4.5
    assert table.next_expiry() == 4.0
    assert [lease.request_id for lease in table.expire(4.0)] == ["b"]
    assert table.was_expired("b") and not table.was_expired("a")
    assert table.release("a") is not None and table.release("a") is None
    assert table.expire(100.0) == [] and table.next_expiry() is None


# ---------------------------------------------------------------------------- request parsing
def _parse(body: object) -> GenerationRequest:
    return parse_completion(body, Tokenizer(), ["m"], 1000)


def test_leg_kinds() -> None:
    remote = {
        "do_remote_prefill": True,
        "remote_engine_id": "e",
        "remote_request_id": "r",
        "remote_host": "h",
        "remote_port": 5600,
        "remote_block_ids": [[1]],
    }
    assert _parse({"prompt": "x"}).kind == "local"
    assert _parse({"prompt": "x", "kv_transfer_params": {"do_remote_decode": True}}).kind == (
        "prefill"
    )
    decode = _parse({"prompt": "x", "kv_transfer_params": remote})
    assert decode.kind == "decode" and decode.remote is not None and decode.remote.port == 5600
    partial = {k: v for k, v in remote.items() if k != "remote_host"}
    assert _parse({"prompt": "x", "kv_transfer_params": partial}).kind == "local"
    bad_port = _parse({"prompt": "x", "kv_transfer_params": {**remote, "remote_port": 70000}})
    assert bad_port.remote is not None and bad_port.remote.port == -1  # fails when pulled


def test_lax_coercion_like_pydantic() -> None:
    spec = _parse({"prompt": "x", "max_tokens": "5", "stream": "true", "seed": 3.0})
    assert (spec.max_tokens, spec.stream, spec.seed) == (5, True, 3)
    with pytest.raises(ApiError) as err:
        _parse({"prompt": "x", "max_tokens": 2.5})
    assert (err.value.param, err.value.err_type) == ("body.max_tokens", "Bad Request")


# ---------------------------------------------------------------------------- response shapes
def test_one_builder_dresses_completion_and_chat_differently() -> None:
    """The differences vLLM makes between the endpoints, as the shape data produces them (the
    full bodies are compared with real vLLM's recording in test_emulator_vs_real_vllm)."""
    use = {"prompt_tokens": 1, "total_tokens": 2, "completion_tokens": 1}
    whole = response(CHAT, "chatcmpl-x", 1, "m", " hi", "length", use, None, "fp")
    assert whole["object"] == "chat.completion" and whole["kv_transfer_params"] is None
    assert whole["choices"][0]["message"]["content"] == " hi"
    assert list(whole)[-6:-3] == ["prompt_logprobs", "prompt_token_ids", "prompt_text"]
    plain = response(COMPLETION, "cmpl-x", 1, "m", " hi", "length", use, {"a": 1}, "fp")
    assert plain["choices"][0]["text"] == " hi" and plain["kv_transfer_params"] == {"a": 1}
    assert "prompt_text" not in plain and "message" not in plain["choices"][0]
    role = role_chunk(CHAT, "chatcmpl-x", 1, "m")
    assert role["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "token_ids" not in role["choices"][0] and "stop_reason" not in role["choices"][0]
    assert role["prompt_token_ids"] is None and "usage" not in role
    mid, last = chunk(CHAT, "c", 1, "m", " a"), chunk(CHAT, "c", 1, "m", " b", "length", use)
    assert "stop_reason" not in mid["choices"][0] and mid["choices"][0]["token_ids"] is None
    assert last["choices"][0]["stop_reason"] is None and last["usage"] == use
    assert "stop_reason" in chunk(COMPLETION, "c", 1, "m", " a")["choices"][0]


# ---------------------------------------------------------------------------- metrics
def test_buckets() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    h = Histogram([1.0, 2.0])
    for v in (0.5, 1.0, 1.5, 3.0):
        h.observe(v)
    assert h.cumulative() == [("1.0", 2.0), ("2.0", 3.0), ("+Inf", 4.0)]
    assert (h.count, h.sum) == (4, 6.0)


# ---------------------------------------------------------------------------- config and CLI
def test_config_defaults() -> None:
    cfg = EmulatorConfig(H100)
    assert cfg.served_name == cfg.model_path == H100.model
    assert cfg.model_len == H100.max_model_len
    assert cfg.num_gpu_blocks == H100.kv_capacity_tokens // 16
    assert EmulatorConfig(make_profile(model="")).served_name == DEFAULT_MODEL
    named = EmulatorConfig(make_profile(), model="/models/x", served_model_names=("x", "y"))
    assert (named.model_path, named.served_name) == ("/models/x", "x")
    with pytest.raises(InputError):
        EmulatorConfig(make_profile(kv_capacity_tokens=1000), max_model_len=2000)


def test_side_channel_env() -> None:
    assert side_channel_from_env({}) == ("localhost", 5600)
    assert side_channel_from_env(
        {"VLLM_NIXL_SIDE_CHANNEL_HOST": "198.18.0.7", "VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    ) == ("198.18.0.7", 5601)
    with pytest.raises(InputError):
        side_channel_from_env({"VLLM_NIXL_SIDE_CHANNEL_PORT": "x"})
    # --side-channel-port wins over the variable; a bad one is named as the flag
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5601"}
    assert side_channel_from_env(env, port_flag=5700) == ("localhost", 5700)
    assert side_channel_from_env(env, port_flag=0) == ("localhost", 0)
    with pytest.raises(InputError, match="--side-channel-port"):
        side_channel_from_env(env, port_flag=70000)


def test_keep_alive_env() -> None:
    assert keep_alive_from_env({}) == 5.0  # vLLM's default
    assert keep_alive_from_env({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": "2"}) == 2.0
    for bad in ("2.5", "x", "0"):
        with pytest.raises(InputError, match="VLLM_HTTP_TIMEOUT_KEEP_ALIVE"):
            keep_alive_from_env({"VLLM_HTTP_TIMEOUT_KEEP_ALIVE": bad})


def test_cli_parses_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "5701")
    args = cli.build_parser().parse_args(
        [
            "--profile", "a40-llama3-8b",
            "--port", "8100",
            "--served-model-name", "a", "b",
            "--max-model-len", "4096",
            "--kv-lease-duration", "5",
            "--max-num-queued-reqs", "10",
            "--jitter", "0",
            "--startup-delay", "1.5",
            "--no-enable-prefix-caching",
        ]
    )  # fmt: skip
    cfg = cli.config_from_args(args)
    assert cfg.enable_prefix_caching is False
    default = cli.build_parser().parse_args(["--profile", "a40-llama3-8b"])
    assert cli.config_from_args(default).enable_prefix_caching is True
    assert cfg.profile.name == "a40-llama3-8b"
    assert (cfg.port, cfg.served_names, cfg.model_len) == (8100, ("a", "b"), 4096)
    assert (cfg.kv_lease_duration, cfg.max_num_queued_reqs, cfg.jitter) == (5.0, 10, 0.0)
    assert (cfg.startup_delay, cfg.side_channel_port) == (1.5, 5701)
    flag = cli.build_parser().parse_args(["--profile", "a40-llama3-8b", "--side-channel-port", "0"])
    assert cli.config_from_args(flag).side_channel_port == 0  # the flag wins over the variable
    assert "--side-channel-port" in cli.build_parser().format_help()


def test_cli_bad_input_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--profile", "no-such-profile"]) == 2
    assert "no-such-profile" in capsys.readouterr().err
    assert cli.main(["--profile", "h100-llama3-8b", "--max-model-len", "10000000"]) == 2


def test_decode_step_jitter_is_drawn_at_every_step() -> None:
    """A live decode engine varies step by step around the profile's step time (the shared
    engine holds one draw per batch, which a client timing a batch would see as a bias)."""
    prof = make_profile(decode={"d0": 0.002, "d1": 0.0, "d2": 0.0})
    tokens = 60

    class Listener:
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.times: list[float] = []
            self.done = done

        def on_tokens(self, n: int, t: float) -> None:
            self.times += [t] * n

        def on_finished(self, t: float) -> None:
            self.done.set_result(None)

        def on_transfer_started(self, t: float) -> None:
            pass

        def on_transferred(self, t: float) -> None:
            pass

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        driver = DecodeDriver(prof, jitter=0.05, rng_seed=3)
        listener = Listener(loop.create_future())
        req = EngineRequest(0, loop.time(), 16, tokens - 1, "x")
        assert driver.submit(req, listener, local=True)
        await asyncio.wait_for(listener.done, 10)
        driver.close()
        return listener.times  # model times, whatever the delivery

    times = asyncio.run(run())
    gaps = [b - a for a, b in itertools.pairwise(times[1:])]
    assert len(gaps) == tokens - 2
    assert len({round(g, 9) for g in gaps}) > len(gaps) // 2  # drawn per step, not per batch
    assert statistics.mean(gaps) == pytest.approx(0.002, rel=0.03)  # 58 draws, sd 0.7%
