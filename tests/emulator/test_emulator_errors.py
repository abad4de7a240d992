"""vLLM's validation errors and statuses, as the emulator returns them over HTTP."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest
from emulator_testkit import Http, eventually, make_profile, sample

from disaggpool.emulator.harness import EmulatorThread


@pytest.fixture
def emu(start_emulator: Any) -> EmulatorThread:
    emu: EmulatorThread = start_emulator(served_model_names=("llama",), max_model_len=100)
    return emu


def _error(reply: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert reply.status == status, reply.body
    assert reply.headers["content-type"].startswith("application/json")
    err: dict[str, Any] = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status
    if param is not None:
        assert err["param"] == param
    return err


COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


SCHEMA = "Bad Request"  # request-schema (pydantic) errors
VLLM = "BadRequestError"  # VLLMValidationError (param named) and ValueError (param null)


@pytest.mark.parametrize(
    ("path", "body", "err_type", "param", "fragment"),
    [
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1}, VLLM, "max_tokens", "at least 1"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, VLLM, "max_tokens", "at least 1"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": "many"}, SCHEMA, "body.max_tokens", "integer"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 2.5}, SCHEMA, "body.max_tokens", "integer"),
        (COMPLETIONS, {"prompt": "x", "stream_options": {}}, VLLM, "stream_options", "stream=True"),
        (
            COMPLETIONS,
            {"prompt": "x", "stream": False, "stream_options": {"include_usage": True}},
            VLLM,
            "stream_options",
            "Stream options can only be defined when `stream=True`. (parameter=stream_options)",
        ),
        (
            COMPLETIONS,
            {"prompt": "x", "max_tokens": 3, "min_tokens": 5},
            VLLM,
            None,
            "min_tokens must be less than or equal to max_tokens=3, got 5.",
        ),
        (COMPLETIONS, {"prompt": "x", "min_tokens": -2}, VLLM, None, "greater than or equal"),
        (COMPLETIONS, {"max_tokens": 3}, VLLM, "prompt", "prompt"),
        (COMPLETIONS, {"prompt": ""}, VLLM, "prompt", "prompt"),
        (COMPLETIONS, {"prompt": 12}, SCHEMA, "body.prompt", "valid string"),
        (COMPLETIONS, {"prompt": [1, 2, 10**9]}, VLLM, None, "out of vocabulary"),
        (COMPLETIONS, {"prompt": "x", "stream": "sometimes"}, SCHEMA, "body.stream", "boolean"),
        (COMPLETIONS, {"prompt": "x", "temperature": -1}, VLLM, None, "non-negative"),
        (COMPLETIONS, {"prompt": "x", "top_p": 2}, VLLM, None, "(0, 1]"),
        (
            COMPLETIONS,
            {"prompt": "x", "kv_transfer_params": [1]},
            SCHEMA,
            "body.kv_transfer_params",
            "valid dictionary",
        ),
        (
            CHAT,
            {"messages": MSG, "max_completion_tokens": -5},
            VLLM,
            "max_completion_tokens",
            "at least 1",
        ),
        (CHAT, {"max_tokens": 3}, SCHEMA, "body.messages", "Field required"),
        (CHAT, {"messages": "hi"}, SCHEMA, "body.messages", "valid list"),
        (CHAT, {"messages": [{"content": "x"}]}, SCHEMA, "body.messages.0.role", "required"),
        (CHAT, {"messages": MSG, "max_tokens": 4, "min_tokens": 9}, VLLM, None, "max_tokens=4"),
    ],
)
def test_bad_request(
    emu: EmulatorThread,
    http: Http,
    path: str,
    body: Any,
    err_type: str,
    param: str | None,
    fragment: str,
) -> None:
    err = _error(http.post(emu.url + path, body), 400)
    assert (err["type"], err["param"]) == (err_type, param)
    assert fragment in err["message"]
    if err_type == SCHEMA:
        assert err["message"].startswith("1 validation error:\n  {")


@pytest.mark.parametrize("raw", [b"", b"{", b"not json", b"\xff\xfe", b"[1, 2"])
@pytest.mark.parametrize("path", [COMPLETIONS, CHAT, "/tokenize", "/detokenize"])
def test_malformed_json_is_400(emu: EmulatorThread, http: Http, path: str, raw: bytes) -> None:
    err = _error(http.post(emu.url + path, raw), 400)
    assert err["type"] == "Bad Request"
    assert re.fullmatch(r"body\.\d+", err["param"])
    assert "'type': 'json_invalid'" in err["message"] and "JSON decode error" in err["message"]


def test_malformed_json_message_is_vllms(emu: EmulatorThread, http: Http) -> None:
    raw = b'{"model": "llama", "prompt": "gek", "max_tokens": 3'  # cut short at offset 51
    err = _error(http.post(emu.url + COMPLETIONS, raw), 400, "body.51")
    assert err["message"] == (
        "1 validation error:\n  {'type': 'json_invalid', 'loc': 'body.51', 'msg': "
        "'JSON decode error', 'input': '<dict of 0 items>', 'ctx': {'error': "
        "\"Expecting ',' delimiter\"}}"
    )


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_content_type_must_be_json(
    emu: EmulatorThread, http: Http, content_type: str | None
) -> None:
    headers = {} if content_type is None else {"Content-Type": content_type}
    reply = http.request(
        "POST", emu.url + COMPLETIONS, b'{"prompt": "x"}', headers, json_type=False
    )
    err = _error(reply, 400)
    assert (err["type"], err["param"]) == ("Bad Request", None)
    assert "Only 'application/json' is allowed" in err["message"]
    ok = {"Content-Type": "application/json; charset=utf-8"}
    assert http.request("POST", emu.url + COMPLETIONS, b'{"prompt": "x"}', ok).status == 200


@pytest.mark.parametrize("body", [[], "prompt", 3, None])
def test_body_must_be_an_object(emu: EmulatorThread, http: Http, body: Any) -> None:
    err = _error(http.post(emu.url + COMPLETIONS, body if body is not None else b"null"), 400)
    assert (err["type"], err["param"]) == ("Bad Request", "body")


def test_unknown_model_is_404(emu: EmulatorThread, http: Http) -> None:
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": MSG})):
        err = _error(http.post(emu.url + path, {**body, "model": "gpt-4"}), 404, "model")
        assert err["type"] == "NotFoundError"
        assert err["message"] == "The model `gpt-4` does not exist. Valid aliases: llama."


def test_context_length(emu: EmulatorThread, http: Http) -> None:
    # "w " * 99 is 99 words plus BOS: exactly max_model_len, no room for an output token
    # (max_tokens null means "up to the context limit").
    body = {"prompt": "w " * 99, "max_tokens": None}
    err = _error(http.post(emu.url + COMPLETIONS, body), 400, "input_tokens")
    assert err["message"].startswith("This model's maximum context length is 100 tokens.")
    err = _error(http.post(emu.url + COMPLETIONS, {"prompt": "w " * 300, "max_tokens": 3}), 400)
    assert err["param"] == "input_tokens"
    assert err["message"] == (
        "This model's maximum context length is 100 tokens. However, your prompt contains at "
        "least 101 input tokens, which exceeds this limit even without any output tokens. "
        "Please reduce the length of the input prompt. (parameter=input_tokens, value=101)"
    )
    err = _error(
        http.post(emu.url + COMPLETIONS, {"prompt": "w " * 89, "max_tokens": 11}), 400, "max_tokens"
    )
    assert err["message"] == (
        "'max_tokens' or 'max_completion_tokens' is too large: 11. This model's maximum "
        "context length is 100 tokens and your request has 90 input tokens (11 > 100 - 90). "
        "(parameter=max_tokens, value=11)"
    )
    err = _error(
        http.post(emu.url + COMPLETIONS, {"prompt": "w", "max_tokens": 300}), 400, "max_tokens"
    )
    assert err["message"] == (
        "max_tokens=300 cannot be greater than max_model_len=100. Please request fewer output "
        "tokens. (parameter=max_tokens, value=300)"
    )
    ok = http.post(emu.url + COMPLETIONS, {"prompt": "w " * 89, "max_tokens": 10})
    assert ok.status == 200


def test_n_and_batches_are_refused_not_ignored(emu: EmulatorThread, http: Http) -> None:
    _error(http.post(emu.url + COMPLETIONS, {"prompt": "x", "n": 2}), 400, "n")
    _error(http.post(emu.url + COMPLETIONS, {"prompt": ["a", "b"]}), 400, "prompt")
    assert http.post(emu.url + COMPLETIONS, {"prompt": ["a"], "max_tokens": 1}).status == 200


def test_queue_limit_is_503(start_emulator: Any, http: Http) -> None:
    # One sequence slot: the first request runs, the second waits, the third is refused.
    profile = make_profile(max_num_seqs=1, decode={"d0": 0.05})
    emu = start_emulator(profile, max_num_queued_reqs=1)
    statuses: list[int] = []

    def call() -> None:
        # 40 steps of 50 ms: each state lasts 2 s, which a loaded machine's polling still sees
        # (at 4 tokens CI once missed the first request's 0.2 s of running).
        statuses.append(http.post(emu.url + COMPLETIONS, {"prompt": "x", "max_tokens": 40}).status)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for i, t in enumerate(threads):
        t.start()
        # The first request runs, the second waits: each state reached before the next call.
        eventually(lambda i=i: _running_waiting(http, emu.url, (1, i)))
    err = _error(http.post(emu.url + COMPLETIONS, {"prompt": "x", "max_tokens": 1}), 503)
    assert err["type"] == "ServiceUnavailableError"
    for t in threads:
        t.join()
    assert statuses == [200, 200]
    assert http.post(emu.url + COMPLETIONS, {"prompt": "x", "max_tokens": 1}).status == 200


def _running_waiting(http: Http, url: str, expected: tuple[int, int]) -> None:
    fams = http.metrics(url)
    got = (
        sample(fams, "vllm:num_requests_running"),
        sample(fams, "vllm:num_requests_waiting"),
    )
    assert got == expected


def test_extra_fields_are_accepted(emu: EmulatorThread, http: Http) -> None:
    body = {"prompt": "x", "max_tokens": 2, "ignore_eos": True, "whatever": {"a": 1}, "stop": "."}
    assert http.post(emu.url + COMPLETIONS, body).status == 200


def test_priority_needs_priority_scheduling(emu: EmulatorThread, http: Http) -> None:
    """vLLM refuses a non-zero priority (body, or the X-Vllm-Priority header that overrides it)
    unless started with --scheduling-policy priority."""
    body = {"prompt": "x", "max_tokens": 1}
    err = _error(http.post(emu.url + COMPLETIONS, {**body, "priority": 1}), 400)
    assert err["message"] == "Got priority 1 but Priority scheduling is not enabled."
    _error(http.post(emu.url + COMPLETIONS, body, {"X-Vllm-Priority": "2"}), 400)
    assert http.post(emu.url + COMPLETIONS, {**body, "priority": 0}).status == 200
    # The header overrides the body: priority 0 by header makes the body's 3 harmless.
    assert (
        http.post(emu.url + COMPLETIONS, {**body, "priority": 3}, {"X-Vllm-Priority": "0"}).status
        == 200
    )
    _error(http.post(emu.url + COMPLETIONS, body, {"X-Vllm-Priority": "high"}), 400, "priority")
    _error(http.post(emu.url + COMPLETIONS, {**body, "priority": "high"}), 400, "body.priority")


def test_priority_scheduling_serves_the_lower_value_first(start_emulator: Any, http: Http) -> None:
    # One sequence slot: the first request runs; of the two that wait, priority 0 goes first.
    profile = make_profile(max_num_seqs=1, decode={"d0": 0.05})
    emu = start_emulator(profile, scheduling_policy="priority")
    finished: list[int] = []

    def call(priority: int, tokens: int) -> None:
        body = {"prompt": "x", "max_tokens": tokens, "priority": priority}
        assert http.post(emu.url + COMPLETIONS, body).status == 200
        finished.append(priority)

    # The first holds the slot for 3 s, so both others are seen waiting on a loaded machine too.
    threads = [threading.Thread(target=call, args=a) for a in ((7, 60), (5, 4), (0, 4))]
    for i, t in enumerate(threads):
        t.start()
        eventually(lambda i=i: _running_waiting(http, emu.url, (1, i)))
    for t in threads:
        t.join()
    assert finished == [7, 0, 5]
