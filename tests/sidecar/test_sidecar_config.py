"""The sidecar's config file: every documented field parses; bad input names file and field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from disaggpool.emulator.config import keep_alive_from_env
from disaggpool.errors import InputError
from disaggpool.sidecar.config import load_config, parse_config

BASE: dict[str, Any] = {
    "model": "m",
    "slo_classes": [
        {"name": "a", "ttft_s": 1, "tpot_s": 0.1},
        {"name": "b", "ttft_s": 5, "tpot_s": 1},
    ],
    "pool": {
        "static": {
            "prefill": [{"name": "p", "url": "http://h:1"}],
            "decode": [{"name": "d", "url": "http://h:2/"}],
        }
    },
}


def test_full_config_parses(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(
        """
policy: least_loaded
model: meta-llama/Meta-Llama-3-8B
listen: {grpc: "0.0.0.0:50051", http: "127.0.0.1:0"}
grpc: {token_file: grpc-token, lease_s: 30, max_inflight: 100, max_inflight_per_client: 10}
auth: {api_keys_file: keys, upstream_api_key_file: /etc/vllm/key}
max_body_bytes: 1048576
max_model_len: 4096
forward_client_priority: true
debug_errors: true
decode_attempts: 3
upstream_timeouts: {connect_s: 2, first_byte_s: 100, idle_s: 20, total_s: 300}
slo_classes:
  - {name: interactive, ttft_s: 1.0, tpot_s: 0.05}
  - {name: batch, ttft_s: 30, tpot_s: 0.5}
default_slo_class: batch
predictor: online
scrape_interval_s: 0.5
max_inflight: 64
prefill_attempts: 3
tokenizer: {kind: emulator}
pool:
  kubernetes: {namespace: ns, selector: "disaggpool.io/pool=x", port: 8000}
profiles:
  dir: profiles
  kubernetes:
    namespace: ns
    selector: "disaggpool.io/pool=x,disaggpool.io/profile=true"
    owner: x
"""
    )
    cfg = load_config(path)
    assert cfg.grpc.token_file == str(tmp_path / "grpc-token") and cfg.grpc.authenticated
    assert (cfg.grpc.lease_s, cfg.grpc.max_inflight, cfg.grpc.max_inflight_per_client) == (
        30,
        100,
        10,
    )
    assert cfg.auth.api_keys_file == str(tmp_path / "keys")
    assert cfg.auth.upstream_api_key_file == "/etc/vllm/key"
    assert (cfg.max_body_bytes, cfg.max_model_len, cfg.decode_attempts) == (1048576, 4096, 3)
    assert cfg.forward_client_priority and cfg.debug_errors
    t = cfg.upstream_timeouts
    assert (t.connect_s, t.first_byte_s, t.idle_s, t.total_s) == (2, 100, 20, 300)
    assert cfg.profiles_kubernetes is not None and cfg.profiles_kubernetes.owner == "x"
    assert cfg.policy == "least_loaded" and cfg.max_inflight == 64 and cfg.prefill_attempts == 3
    assert cfg.default_slo.name == "batch" and cfg.slo("interactive") is not None
    assert cfg.slo("") is cfg.default_slo and cfg.slo("nope") is None
    assert cfg.members_kubernetes is not None and cfg.members_kubernetes.namespace == "ns"
    assert cfg.profiles_dir == str(tmp_path / "profiles")  # relative to the config file
    assert cfg.tokenizer.kind == "emulator"


def test_static_members_strip_trailing_slash() -> None:
    cfg = parse_config(BASE)
    assert [m.url for m in cfg.static_members] == ["http://h:1", "http://h:2"]
    assert cfg.policy == "calibrated"


def test_pooled_connections_expire_before_vllms_own_keep_alive() -> None:
    # vLLM closes an idle connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE (the emulator mirrors
    # its default); reusing one for longer races the pod's close (test_upstream_keepalive.py).
    assert parse_config(BASE).upstream_keepalive_s < keep_alive_from_env({})
    assert parse_config({**BASE, "upstream_keepalive_s": 1.5}).upstream_keepalive_s == 1.5


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"policy": "fastest"}, "policy"),
        ({"policy": "uncalibrated"}, "policy"),
        ({"model": ""}, "model"),
        ({"slo_classes": []}, "slo_classes"),
        ({"slo_classes": [{"name": "a", "ttft_s": -1, "tpot_s": 1}]}, "slo_classes[0].ttft_s"),
        ({"default_slo_class": "zzz"}, "default_slo_class"),
        ({"predictor": "psychic"}, "predictor"),
        ({"predictor": "oracle"}, "predictor"),
        ({"listen": {"http": "nowhere"}}, "listen.http"),
        ({"scrape_interval_s": 0}, "scrape_interval_s"),
        ({"upstream_keepalive_s": -1}, "upstream_keepalive_s"),
        ({"max_inflight": 0}, "max_inflight"),
        ({"tokenizer": {"kind": "magic"}}, "tokenizer.kind"),
        ({"tokenizer": {"kind": "huggingface"}}, "tokenizer.path"),
        ({"pool": {}}, "pool"),
        ({"pool": {"static": {"prefill": [], "decode": []}}}, "pool.static.prefill"),
        (
            {
                "pool": {
                    "static": {
                        "prefill": [{"name": "p", "url": "ftp://x"}],
                        "decode": [{"name": "d", "url": "http://x"}],
                    }
                }
            },
            "pool.static.prefill[0].url",
        ),
        (
            {
                "pool": {
                    "static": {
                        "prefill": [{"name": "p", "url": "http://x"}],
                        "decode": [{"name": "p", "url": "http://y"}],
                    }
                }
            },
            "pool.static",
        ),
        ({"pool": {"kubernetes": {"namespace": "ns"}}}, "pool.kubernetes.selector"),
        ({"colour": "blue"}, "colour"),
        ({"listen": {"grpc": "0.0.0.0:50051"}}, "listen.grpc"),
        (
            {
                "listen": {"grpc": "198.18.0.1:1"},
                "grpc": {"tls": {"cert_file": "c", "key_file": "k"}},
            },
            "listen.grpc",
        ),
        (
            {"grpc": {"max_inflight": 4, "max_inflight_per_client": 8}},
            "grpc.max_inflight_per_client",
        ),
        ({"grpc": {"lease_s": 0}}, "grpc.lease_s"),
        ({"grpc": {"tls": {"cert_file": "c"}}}, "grpc.tls.key_file"),
        ({"grpc": {"token": "x"}}, "grpc.token"),
        ({"auth": {"keys": "x"}}, "auth.keys"),
        ({"max_body_bytes": 10}, "max_body_bytes"),
        ({"max_model_len": -1}, "max_model_len"),
        ({"decode_attempts": 0}, "decode_attempts"),
        ({"debug_errors": "yes"}, "debug_errors"),
        ({"upstream_timeouts": {"idle_s": 0}}, "upstream_timeouts.idle_s"),
        ({"upstream_timeouts": {"idle_s": 700}}, "upstream_timeouts.idle_s"),
        ({"upstream_timeouts": {"total_s": 9}, "upstream_timeout_s": 9}, "upstream_timeout_s"),
        (
            {"profiles": {"kubernetes": {"namespace": "n", "selector": "a in (b"}}},
            "profiles.kubernetes.selector",
        ),
        ({"policy": "least_loaded", "priority_scheduling": True}, "priority_scheduling"),
        ({"priority_scheduling": "yes"}, "priority_scheduling"),
        ({"shutdown_delay_s": -1}, "shutdown_delay_s"),
        ({"shutdown_delay_s": "5s"}, "shutdown_delay_s"),
        ({"shutdown_timeout_s": 0}, "shutdown_timeout_s"),
    ],
)
def test_bad_config_names_the_field(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_config({**BASE, **patch}, "sidecar.yaml")
    assert err.value.source == "sidecar.yaml"
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"model": ""}, "model: must be a non-empty string, got ''"),
        (
            {"pool": {"static": {"prefill": [], "decode": []}}},
            "pool.static.prefill: must be a non-empty list of {name, url}",
        ),
        ({"max_inflight": 0}, "max_inflight: must be an integer >= 1, got 0"),
        ({"scrape_interval_s": 0}, "scrape_interval_s: must be > 0, got 0"),
        ({"listen": "x"}, "listen: must be a mapping"),
        ({"colour": "blue"}, "colour: unknown field (allowed: "),
    ],
)
def test_bad_config_messages(patch: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError) as err:
        parse_config({**BASE, **patch}, "sidecar.yaml")
    assert str(err.value).startswith(f"sidecar.yaml: {message}")


def test_unreadable_file_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="cannot read"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"kv_events": {}}, "kv_events"),  # without prefix_index
        ({"prefix_index": True, "kv_events": {"port": 70000}}, "kv_events.port"),
        ({"prefix_index": True, "kv_events": {"stale_after_s": 0}}, "kv_events.stale_after_s"),
        ({"prefix_index": True, "kv_events": {"colour": 1}}, "kv_events.colour"),
    ],
)
def test_kv_events_settings_are_checked(patch: dict[str, Any], field: str) -> None:
    doc = {
        "policy": "calibrated",
        "model": "m",
        "slo_classes": [{"name": "c", "ttft_s": 1.0, "tpot_s": 0.1}],
        "pool": {"static": {"prefill": [{"name": "p", "url": "http://127.0.0.1:1"}],
                            "decode": [{"name": "d", "url": "http://127.0.0.1:2"}]}},
        **patch,
    }  # fmt: skip
    with pytest.raises(InputError) as err:
        parse_config(doc, "<test>")
    assert err.value.field.startswith(field), err.value


def test_members_name_their_kv_events_endpoint() -> None:
    pods = {
        "prefill": [
            {"name": "p0", "url": "http://127.0.0.1:1", "kv_events": "tcp://127.0.0.1:5557"},
            {"name": "p1", "url": "http://127.0.0.1:2", "kv_events": "ipc:///tmp/p1.ipc"},
        ],
        "decode": [{"name": "d", "url": "http://127.0.0.1:3"}],
    }
    doc = {
        "policy": "calibrated",
        "model": "m",
        "prefix_index": True,
        "kv_events": {},
        "slo_classes": [{"name": "c", "ttft_s": 1.0, "tpot_s": 0.1}],
        "pool": {"static": pods},
    }
    cfg = parse_config(doc, "<test>")
    assert [m.kv_events for m in cfg.static_members] == [
        "tcp://127.0.0.1:5557", "ipc:///tmp/p1.ipc", ""
    ]  # fmt: skip
    assert cfg.kv_events is not None and cfg.kv_events.port == 5557
    pods["prefill"][0]["kv_events"] = "127.0.0.1:5557"
    with pytest.raises(InputError, match=r"prefill\[0\]\.kv_events"):
        parse_config(doc, "<test>")


@pytest.mark.parametrize(
    ("autoscaling", "field"),
    [
        ({"max_replicas": 3}, "autoscaling.min_replicas"),
        ({"min_replicas": 4, "max_replicas": 3}, "autoscaling.max_replicas"),
        ({"min_replicas": 0, "max_replicas": 0}, "autoscaling.max_replicas"),
        (
            {"min_replicas": 1, "max_replicas": 3, "target_goodput": 1.0},
            "autoscaling.target_goodput",
        ),
        ({"min_replicas": 1, "max_replicas": 3, "startup_s": -5}, "autoscaling.startup_s"),
        ({"min_replicas": 1, "max_replicas": 3, "period_s": 0}, "autoscaling.period_s"),
        (
            {"min_replicas": 1, "max_replicas": 3, "pool": {"name": "p"}},
            "autoscaling.pool.namespace",
        ),
        ({"min_replicas": 1, "max_replicas": 3, "colour": 1}, "autoscaling.colour"),
        (
            {"min_replicas": 1, "max_replicas": 3, "burst_window_s": 60},
            "autoscaling.burst_window_s",
        ),
        ({"min_replicas": 1, "max_replicas": 3, "min_headroom": -0.1}, "autoscaling.min_headroom"),
        ({"min_replicas": 1, "max_replicas": 3, "min_headroom": 11}, "autoscaling.min_headroom"),
        ({"min_replicas": 1, "max_replicas": 3, "min_headroom": "x"}, "autoscaling.min_headroom"),
        ({"min_replicas": 1, "max_replicas": 3, "prefill": 2}, "autoscaling.prefill"),
        (
            {"min_replicas": 1, "max_replicas": 3, "prefill": {"min_replicas": 1}},
            "autoscaling.prefill.max_replicas",
        ),
        (
            {"min_replicas": 1, "max_replicas": 3, "prefill": {"max_replicas": 2}},
            "autoscaling.prefill.min_replicas",
        ),
        (
            {"min_replicas": 1, "max_replicas": 3,
             "prefill": {"min_replicas": 3, "max_replicas": 2}},
            "autoscaling.prefill.max_replicas",
        ),
        (
            {"min_replicas": 1, "max_replicas": 3,
             "prefill": {"min_replicas": 1, "max_replicas": 2, "step": 1}},
            "autoscaling.prefill.step",
        ),
    ],
)  # fmt: skip
def test_autoscaling_settings_are_checked(autoscaling: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_config({**BASE, "autoscaling": autoscaling}, "sidecar.yaml")
    assert err.value.field == field, str(err.value)


def test_autoscaling_defaults() -> None:
    a = parse_config({**BASE, "autoscaling": {"min_replicas": 1, "max_replicas": 5}}).autoscaling
    assert a is not None
    assert (a.startup_s, a.stabilization_s, a.target_goodput, a.period_s) == (120, 300, 0.9, 5)
    assert a.burst_window_s == 600
    assert a.pool_name == ""  # metrics only: nothing is written anywhere
    assert a.min_headroom == 0.0 and a.prefill is None  # no prefill recommendation


def test_autoscaling_prefill_bounds_and_headroom() -> None:
    raw = {"min_replicas": 1, "max_replicas": 5, "min_headroom": 0.3,
           "prefill": {"min_replicas": 0, "max_replicas": 4}}  # fmt: skip
    a = parse_config({**BASE, "autoscaling": raw}).autoscaling
    assert a is not None and a.min_headroom == 0.3
    assert a.prefill is not None and (a.prefill.min_replicas, a.prefill.max_replicas) == (0, 4)
    assert (a.min_replicas, a.max_replicas) == (1, 5)  # decode's, untouched


@pytest.mark.parametrize(
    ("patch", "field"),
    [
        ({"drift": {"window": 4, "min_samples": 5}}, "drift.min_samples"),
        ({"drift": {"window": 0}}, "drift.window"),
        ({"drift": {"period_s": -1}}, "drift.period_s"),
        ({"drift": {"pool": {"namespace": "a"}}}, "drift.pool.name"),
        (
            {
                "drift": {"pool": {"namespace": "a", "name": "x"}},
                "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                "pool": {"namespace": "a", "name": "y"}},
            },
            "drift.pool",
        ),
    ],
)  # fmt: skip
def test_drift_settings_are_checked(patch: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as err:
        parse_config({**BASE, **patch}, "sidecar.yaml")
    assert err.value.field == field, str(err.value)


LEASE = {"namespace": "serving", "name": "llama-router"}


def test_leader_election_defaults_and_fields() -> None:
    cfg = parse_config({**BASE, "leader_election": LEASE})
    le = cfg.leader_election
    assert le is not None and (le.namespace, le.name, le.identity) == (
        "serving",
        "llama-router",
        "",
    )
    t = le.timings  # client-go's defaults
    assert (t.lease_duration_s, t.renew_deadline_s, t.retry_period_s) == (15.0, 10.0, 2.0)
    timings = {"lease_duration_s": 6, "renew_deadline_s": 4, "retry_period_s": 0.5}
    cfg = parse_config({**BASE, "leader_election": {**LEASE, "identity": "r-0", **timings}})
    le = cfg.leader_election
    assert le is not None and le.identity == "r-0" and le.timings.retry_period_s == 0.5
    assert parse_config(BASE).leader_election is None
    endpoints = {"name": "llama-router", "ports": {"http": 8000, "grpc-epp": 9002}}
    cfg = parse_config({**BASE, "leader_election": {**LEASE, "endpoints": endpoints}})
    le = cfg.leader_election
    assert le is not None and le.endpoints is not None
    assert le.endpoints.ports == (("http", 8000), ("grpc-epp", 9002))
    assert le.endpoints.address == ""  # $POD_IP, read by the elector at start


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"name": None}, "leader_election.name: must be a non-empty string"),
        ({"name": "Router_Lease"}, "leader_election.name: not a Kubernetes object name"),
        ({"namespace": ""}, "leader_election.namespace: must be a non-empty string"),
        ({"identity": ""}, "leader_election.identity: must be a non-empty string"),
        ({"lease_duration_s": 0}, "leader_election.lease_duration_s: must be > 0"),
        (
            {"lease_duration_s": 0.5, "renew_deadline_s": 0.2, "retry_period_s": 0.1},
            "leader_election.lease_duration_s: must be at least 1",
        ),
        ({"renew_deadline_s": 15}, "leader_election.renew_deadline_s: must be shorter than"),
        ({"retry_period_s": 10}, "leader_election.retry_period_s: must be positive and shorter"),
        ({"renew_s": 3}, "leader_election.renew_s: unknown field"),
        ({"endpoints": {"name": "r"}}, "leader_election.endpoints.ports: must be a mapping"),
        (
            {"endpoints": {"name": "r", "ports": {}}},
            "leader_election.endpoints.ports: name at least one",
        ),
        (
            {"endpoints": {"name": "r", "ports": {"http": 70000}}},
            "leader_election.endpoints.ports.http: not a port",
        ),
        (
            {"endpoints": {"name": "R", "ports": {"http": 8000}}},
            "leader_election.endpoints.name: not a Kubernetes object name",
        ),
        (
            {"endpoints": {"name": "r", "ports": {"http": 8000}, "ip": "1.2.3.4"}},
            "leader_election.endpoints.ip: unknown field",
        ),
    ],
)
def test_bad_leader_election_names_the_field(patch: dict[str, Any], message: str) -> None:
    section = {k: v for k, v in {**LEASE, **patch}.items() if v is not None}
    with pytest.raises(InputError) as err:
        parse_config({**BASE, "leader_election": section}, "sidecar.yaml")
    assert str(err.value).startswith(f"sidecar.yaml: {message}"), str(err.value)
