"""The settings of one emulated vLLM instance, resolved and checked once at start-up.

`cli` builds one from flags and the environment; tests build one directly. Everything downstream
reads resolved values (`served_name`, `model_len`, `num_gpu_blocks`) from here, so the defaults
that mirror vLLM live in one place.
"""

from __future__ import annotations

import dataclasses
import os
import uuid
from collections.abc import Mapping

from disaggpool.core.profile import CalibrationProfile
from disaggpool.engine.request import SchedulingPolicy
from disaggpool.errors import InputError
from disaggpool.formats.kv_events import KVEventsConfig
from disaggpool.pdwire import VLLM_KEEP_ALIVE_S

__all__ = [
    "DEFAULT_MODEL",
    "EmulatorConfig",
    "cannot_listen",
    "dev_mode_from_env",
    "keep_alive_from_env",
    "side_channel_from_env",
]

DEFAULT_MODEL = "disaggpool/emulated-model"


def dev_mode_from_env(env: Mapping[str, str] | None = None) -> bool:
    """vLLM's `VLLM_SERVER_DEV_MODE` ("1" enables the development endpoints)."""
    return (os.environ if env is None else env).get("VLLM_SERVER_DEV_MODE") == "1"


def keep_alive_from_env(env: Mapping[str, str] | None = None) -> float:
    """vLLM's `VLLM_HTTP_TIMEOUT_KEEP_ALIVE` (default 5 s): how long its HTTP server keeps an idle
    connection open. A client that pools connections for longer meets closed ones."""
    raw = (os.environ if env is None else env).get(
        "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", str(VLLM_KEEP_ALIVE_S)
    )
    try:
        seconds = int(raw)  # vLLM reads it with int()
    except ValueError:
        raise InputError(
            "VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "<env>", f"not an integer: {raw!r}"
        ) from None
    if seconds < 1:
        raise InputError("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "<env>", f"must be at least 1: {seconds}")
    return float(seconds)


def side_channel_from_env(
    env: Mapping[str, str] | None = None, *, port_flag: int | None = None
) -> tuple[str, int]:
    """vLLM's `VLLM_NIXL_SIDE_CHANNEL_HOST` (default localhost) and `_PORT` (default 5600).

    `port_flag` is `--side-channel-port`: vLLM has no flag for the port, only the variable, so
    the emulator keeps the variable and lets its own flag, when given, win over it.
    """
    env = os.environ if env is None else env
    host = env.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "localhost")
    if port_flag is not None:
        source, raw = "--side-channel-port", str(port_flag)
    else:
        source, raw = "VLLM_NIXL_SIDE_CHANNEL_PORT", env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "5600")
    where = "<arg>" if port_flag is not None else "<env>"
    try:
        port = int(raw)
    except ValueError:
        raise InputError(source, where, f"not an integer: {raw!r}") from None
    if not 0 <= port <= 65535:
        raise InputError(source, where, f"not a port: {port}")
    return host, port


def cannot_listen(errno: int | None, what: str, address: str, change: str) -> OSError:
    """A failure (`errno`) to bind `address`, stated to name the setting and how to change it.

    A bare "address already in use" leaves a user with two emulators on one machine guessing
    which of their ports clashed (the HTTP port, the NIXL side channel, the KV events socket).
    """
    reason = os.strerror(errno) if errno else "cannot bind"
    return OSError(errno, f"cannot listen on the {what} {address}: {reason}; {change}")


@dataclasses.dataclass(frozen=True, slots=True)
class EmulatorConfig:
    """One instance. `profile` is the *true* profile: it drives the timing, never the routing.

    `side_channel_port` 0 picks a free port (tests); the advertised `remote_port` is then the
    port actually bound. `engine_id` defaults to a random uuid4, as vLLM's does.
    """

    profile: CalibrationProfile
    model: str = ""
    served_model_names: tuple[str, ...] = ()
    max_model_len: int | None = None
    seed: int = 0
    kv_lease_duration: float = 30.0
    max_num_queued_reqs: int | None = None
    jitter: float = 0.03
    startup_delay: float = 0.0
    host: str = "127.0.0.1"
    port: int = 8000
    side_channel_host: str = "localhost"
    side_channel_port: int = 5600
    engine_id: str = dataclasses.field(default_factory=lambda: str(uuid.uuid4()))
    vocab_size: int = 32000
    # vLLM's prefix caching (on by default there too): prefill legs reuse the cached KV of
    # their prompt's leading full blocks (`engine.prefix_cache`).
    enable_prefix_caching: bool = True
    # vLLM's --kv-events-config: the prefill engine's cache changes published over ZMQ.
    kv_events: KVEventsConfig = dataclasses.field(default_factory=KVEventsConfig)
    # vLLM's --scheduling-policy: "priority" orders waiting requests by their `priority`; under
    # "fcfs" a request with a non-zero priority is refused (400), as vLLM refuses it.
    scheduling_policy: SchedulingPolicy = "fcfs"
    # vLLM's VLLM_SERVER_DEV_MODE=1: its development endpoints; the emulator serves the one a
    # prefix-cache benchmark needs, POST /reset_prefix_cache (else 404, as vLLM).
    server_dev_mode: bool = False
    # How long a decode leg waits for the prefill side to answer a KV read before failing it.
    pull_timeout: float = 5.0
    # vLLM's VLLM_HTTP_TIMEOUT_KEEP_ALIVE: an idle client connection is closed after this long,
    # so that a router pooling connections for longer meets the closes vLLM's server makes.
    http_keep_alive: float = VLLM_KEEP_ALIVE_S
    # vLLM's --api-key (or VLLM_API_KEY): requests under /v1, /v2, /inference and /cohere need
    # one of them as `Authorization: Bearer`; /health, /metrics, /tokenize stay open, as there.
    api_keys: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InputError("--max-model-len", "<arg>", "must be at least 2")
        if self.model_len > self.profile.kv_capacity_tokens:
            # vLLM refuses to start when one max-length sequence cannot fit in the KV cache.
            raise InputError(
                "--max-model-len",
                "<arg>",
                f"{self.model_len} exceeds the profile's KV capacity "
                f"({self.profile.kv_capacity_tokens} tokens)",
            )
        if self.http_keep_alive <= 0:
            raise InputError("VLLM_HTTP_TIMEOUT_KEEP_ALIVE", "<env>", "must be positive")
        if self.kv_lease_duration <= 0:
            raise InputError("--kv-lease-duration", "<arg>", "must be positive")
        if self.max_num_queued_reqs is not None and self.max_num_queued_reqs < 1:
            raise InputError("--max-num-queued-reqs", "<arg>", "must be at least 1")
        if not 0 <= self.jitter < 1:
            raise InputError("--jitter", "<arg>", "must be in [0, 1)")
        if self.startup_delay < 0:
            raise InputError("--startup-delay", "<arg>", "must be non-negative")
        if self.vocab_size < 16:
            raise InputError("vocab_size", "<arg>", "must be at least 16")

    @property
    def model_path(self) -> str:
        """What `--model` names (the `root` of /v1/models)."""
        return self.model or self.profile.model or DEFAULT_MODEL

    @property
    def served_names(self) -> tuple[str, ...]:
        return self.served_model_names or (self.model_path,)

    @property
    def served_name(self) -> str:
        """The first served name: the /v1/models id and the `model_name` metrics label."""
        return self.served_names[0]

    @property
    def model_len(self) -> int:
        return self.max_model_len or self.profile.max_model_len

    @property
    def block_size(self) -> int:
        return self.profile.block_size

    @property
    def num_gpu_blocks(self) -> int:
        return self.profile.kv_capacity_tokens // self.profile.block_size

    def engine_profile(self) -> CalibrationProfile:
        """The profile the engine models run with: the true one, at this instance's max length."""
        return dataclasses.replace(self.profile, max_model_len=self.model_len)
