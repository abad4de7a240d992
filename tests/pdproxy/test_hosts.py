"""The `x-prefiller-host-port` header as the proxy reads it (`pdproxy.hosts`)."""

from __future__ import annotations

import pytest

from disaggpool.pdproxy.hosts import MAX_HOSTS, BadHeader, prefill_hosts


def test_a_list_in_order_across_repeated_fields() -> None:
    got = prefill_hosts(["198.18.0.5:8000, [fd00::1]:8000", "p-0.pool.ns.svc:8200"])
    assert got == ["198.18.0.5:8000", "[fd00::1]:8000", "p-0.pool.ns.svc:8200"]


@pytest.mark.parametrize("values", [[], [""], ["  "], ["", " "]])
def test_absent_or_empty_is_no_prefill_host(values: list[str]) -> None:
    assert prefill_hosts(values) == []


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("p:1,", "empty entry"),
        ("p", "not HOST:PORT"),
        (":80", "not HOST:PORT"),
        ("p:65536", "port"),
        ("p:http", "port"),
        ("[::1:80", "host"),
        ("::1:80", "host"),
        ("p_q:80", "host"),
        ("-p:80", "host"),
        (",".join(["p:1"] * (MAX_HOSTS + 1)), f"at most {MAX_HOSTS}"),
    ],
)
def test_malformed_values_say_what_is_wrong(value: str, says: str) -> None:
    with pytest.raises(BadHeader, match=says):
        prefill_hosts([value])
