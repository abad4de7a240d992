"""Fuzz: any body at the front door's generation endpoints gets a well-formed answer (a JSON
document, or an SSE stream of JSON events ending in [DONE]) with a 2xx or 4xx status, never a
5xx, and the books add up over the whole run: every request answered and counted once, every
admitted one closed, nothing left in flight.

"Admitted" is observed, not guessed: a request is admitted when a pod received a leg of it (the
pods sit behind counting `FaultyPod` proxies), which is also when the router booked it.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from faultkit import Accounting, Kit, pod, post_json, sidecar_doc
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sidecar_testkit import A40

GENERATION = ["/v1/completions", "/v1/chat/completions"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
any_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]) | json_values},
        optional={"content": st.text(max_size=40) | json_values, "name": json_values},
    ),
    max_size=3,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant"]), "content": st.text(max_size=40)}
    ),
    min_size=1,
    max_size=3,
)
budgets = st.integers(1, 24) | st.sampled_from([255, 256, 10**12, 2**63])
FIELDS = {
    "model": st.just("test/model"),
    "max_tokens": budgets,
    "min_tokens": st.integers(0, 3),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
    "priority": st.integers(-10, 10),
    "slo_class": st.just("interactive"),
    "temperature": st.floats(0.0, 2.0),
    "seed": st.integers(0, 2**31),
    "ignore_eos": st.booleans(),
}


def bodies() -> st.SearchStrategy[bytes | dict[str, Any]]:
    """Raw bytes, any JSON, a valid request, or a valid request with one field (known or not)
    set to any JSON value."""
    completion = st.fixed_dictionaries(
        {
            "prompt": st.text(min_size=1, max_size=60)
            | st.lists(st.integers(0, 30_000), min_size=1, max_size=20)
        },
        optional=FIELDS,
    )
    chat = st.fixed_dictionaries(
        {"messages": messages},
        optional={
            **FIELDS,
            "max_completion_tokens": budgets,
            "add_generation_prompt": st.booleans(),
        },
    )
    valid = completion | chat
    keys = st.sampled_from(
        [*FIELDS, "prompt", "messages", "max_completion_tokens", "kv_transfer_params", "n",
         "add_special_tokens", "add_generation_prompt"]
    ) | st.text(max_size=10)  # fmt: skip
    one_field = st.tuples(valid, keys, json_values).map(lambda t: {**t[0], t[1]: t[2]})
    odd_messages = st.tuples(chat, any_messages).map(lambda t: {**t[0], "messages": t[1]})
    return (
        valid
        | one_field
        | odd_messages
        | json_values.map(lambda v: json.dumps(v).encode())
        | st.binary(max_size=120)
    )


def check_answer(status: int, headers: dict[str, str], body: bytes) -> None:
    assert 200 <= status < 500, (status, body[:300])
    ctype = headers.get("content-type", "")
    if status >= 400:
        assert ctype.startswith("application/json"), (status, ctype, body[:300])
        error = json.loads(body)["error"]
        assert isinstance(error["message"], str) and error["message"], body[:300]
        return
    if ctype.startswith("text/event-stream"):
        assert body.endswith(b"data: [DONE]\n\n"), body[-300:]
        for event in body.split(b"\n\n")[:-2]:
            assert event.startswith(b"data: "), event[:200]
            doc = json.loads(event[len(b"data: ") :])
            assert "error" not in doc, doc
        return
    assert ctype.startswith("application/json"), (ctype, body[:300])
    assert "choices" in json.loads(body), body[:300]


@pytest.mark.parametrize("tokenizer", ["emulator", "engine"])
def test_fuzzed_bodies_get_well_formed_answers_and_the_books_add_up(
    kit: Kit, tokenizer: str
) -> None:
    """`tokenizer`: prompts measured in process (the demo's) or by the pod's `/tokenize` (the
    default, and what a real pool uses)."""
    fast = A40.scaled(50.0)
    p0 = kit.emulator(fast, max_model_len=256, kv_lease_duration=1.0)
    d0 = kit.emulator(fast, max_model_len=256)
    prefill, decode = kit.faulty(p0.url), kit.faulty(d0.url)
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", prefill.url)], [pod("d0", decode.url)], tokenizer={"kind": tokenizer}
        )
    )
    books = Accounting(sc.url)
    sent, admitted = [0], [0]

    @settings(
        max_examples=150,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(path=st.sampled_from(GENERATION), body=bodies())
    # Messages without content or with a non-string role: the in-process chat template reads
    # both, so these are where a KeyError (a 500) would come from.
    @example(path="/v1/chat/completions", body={"messages": [{"role": "user"}]})
    @example(path="/v1/chat/completions", body={"messages": [{"role": 1, "content": None}]})
    def one(path: str, body: bytes | dict[str, Any]) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        legs = sum(prefill.legs.values()) + sum(decode.legs.values())
        status, headers, answer = post_json(sc.url + path, raw)
        sent[0] += 1
        admitted[0] += sum(prefill.legs.values()) + sum(decode.legs.values()) > legs
        check_answer(status, headers, answer)

    one()
    books.settle(sent=sent[0], admitted=admitted[0])
