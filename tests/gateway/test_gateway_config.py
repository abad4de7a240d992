"""The sidecar config's `listen.ext_proc` and `gateway` section: defaults, checks naming the field,
and the exposure rule the gRPC port already follows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disaggpool.errors import InputError
from disaggpool.sidecar.config import Member, parse_config
from disaggpool.sidecar.epp import destination


def _doc(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "slo_classes": [{"name": "chat", "ttft_s": 1.0, "tpot_s": 0.1}],
        "pool": {
            "static": {
                "prefill": [{"name": "p0", "url": "http://198.18.0.1:8000"}],
                "decode": [{"name": "d0", "url": "http://198.18.0.2:8000"}],
            }
        },
        **extra,
    }


def test_defaults_no_picker_destination_the_pod_itself() -> None:
    c = parse_config(_doc())
    assert c.ext_proc_listen == ""
    assert (c.gateway.destination_port, c.gateway.decision_timeout_s) == (0, 1.0)
    gateway = {"destination_port": 8001, "decision_timeout_s": 0.5}
    c = parse_config(_doc(listen={"ext_proc": "127.0.0.1:9002"}, gateway=gateway))
    assert c.ext_proc_listen == "127.0.0.1:9002"
    assert (c.gateway.destination_port, c.gateway.decision_timeout_s) == (8001, 0.5)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"listen": {"ext_proc": "9002"}}, "listen.ext_proc"),
        ({"gateway": {"destination_port": 70000}}, "gateway.destination_port"),
        ({"gateway": {"destination_port": -1}}, "gateway.destination_port"),
        ({"gateway": {"decision_timeout_s": 0}}, "gateway.decision_timeout_s"),
        ({"gateway": {"timeout": 1}}, "gateway"),
    ],
)
def test_bad_values_name_the_field(extra: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_config(_doc(**extra), "sidecar.yaml")
    assert field in str(err.value)


def test_the_picker_listens_beyond_loopback_only_with_credentials(tmp_path: Path) -> None:
    with pytest.raises(InputError) as err:
        parse_config(_doc(listen={"ext_proc": "0.0.0.0:9002"}), "sidecar.yaml")
    assert "listen.ext_proc" in str(err.value) and "grpc.token_file" in str(err.value)
    token = tmp_path / "token"
    token.write_text("t\n")
    c = parse_config(_doc(listen={"ext_proc": "0.0.0.0:9002"}, grpc={"token_file": str(token)}))
    assert c.ext_proc_listen == "0.0.0.0:9002"


def test_the_destination_is_the_pods_address_or_the_gateway_port() -> None:
    assert destination(Member("d0", "decode", "http://198.18.2.3:8000")) == "198.18.2.3:8000"
    assert destination(Member("d0", "decode", "http://198.18.2.3:8000"), 8001) == "198.18.2.3:8001"
    assert destination(Member("d0", "decode", "http://[fd00::1]:8000")) == "[fd00::1]:8000"
    assert destination(Member("d0", "decode", "http://198.18.2.3")) == "198.18.2.3:80"
