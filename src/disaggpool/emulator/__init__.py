"""A GPU-free stand-in for a vLLM 0.33 server, for tests of the router, sidecar and operator.

It speaks vLLM's OpenAI HTTP API, its `/metrics` names and its prefill/decode (NIXL pull) wire
protocol, while its timing comes from a calibration profile run through the same engine model the
simulator uses (`disaggpool.engine`). One instance serves every role, as vLLM does: a request is a
prefill leg, a decode leg or a plain (aggregated) request according to its `kv_transfer_params`.

Modules, one job each:

* `config`: the settings of one instance (`EmulatorConfig`);
* `errors`: vLLM's error bodies and statuses (`ApiError`);
* `requests`: parsing and validation of completion, chat, tokenize and detokenize bodies;
* `responses`: completion and chat bodies, whole and streamed, from one builder;
* `engine_driver`: drives `PrefillEngine`/`DecodeEngine` on the asyncio clock;
* `kv_blocks`: the prefill side's KV block pool and leases (pure records);
* `kv_lending`: the prefill side's lending of blocks to decode peers, their leases' timers;
* `kv_side_channel`: the loopback TCP exchange by which a decode leg pulls KV from a prefill one;
* `metrics`: Prometheus exposition with vLLM's names, types, labels and buckets;
* `job`: one request's life in the instance (its state, engine listener and events);
* `instance`: one emulated vLLM instance (engines, KV lending and pulls, metrics) without HTTP;
* `server`: the aiohttp routes;
* `harness`: run an instance in a background thread (for tests);
* `cli`: `main(argv)`, wired as ``disaggpool emulate`` (also ``python -m disaggpool.emulator``).

Prompts, `/tokenize` and output text use the deterministic word tokenizer
`disaggpool.wordtokenizer` (shared with the sidecar's ``emulator`` prompt counter). README.md next
to this file lists what matches vLLM and what does not.
"""

from __future__ import annotations

from disaggpool.emulator.config import EmulatorConfig

__all__ = ["EmulatorConfig"]
