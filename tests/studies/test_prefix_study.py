"""`sim prefix` end to end on a small case: the search, every policy, the findings, the table
and the plots; and what must hold on Mooncake traffic: routers that keep a prefix index find
more of the prompts cached than cache-blind ones."""

from __future__ import annotations

from pathlib import Path

from disaggpool.studies import prefix_report
from disaggpool.studies.prefix_study import POLICIES, PrefixConfig, run_prefix


def test_small_prefix_experiment(tmp_path: Path) -> None:
    cfg = PrefixConfig(
        requests=400, seeds=(1,), traces=("mooncake",), pools=("hetero",), caches=("gpu",),
        search_steps=4, n_prefill=4, decode_pools=(3,),
    )  # fmt: skip
    doc = run_prefix(cfg, workers=1)
    rows = doc["experiments"]["prefix"]
    assert {r["policy"] for r in rows} == set(POLICIES)
    assert all(r["requests"] == 400 and r["cache_blocks"] == 190_000 // 512 for r in rows)
    assert all(r["decode_pods"] == 3 for r in rows)
    hit = {r["policy"]: r["prefix_hit"] for r in rows}
    # The engines cache in every run; only what the router knows differs.
    assert min(hit["calibrated"], hit["dynamo_kv"], hit["cache_aware"]) > max(
        hit["least_loaded"], hit["length"], hit["calibrated_blind"]
    )
    assert all(0.0 < h < 1.0 for h in hit.values())
    found = doc["findings"]["prefix"]["mooncake/hetero/gpu/3d"]
    assert found["best_other"] not in ("calibrated", "calibrated_no_pd", "calibrated_blind")
    assert found["rate_rps"] > 0.5  # the search left the bracket's floor
    assert "mooncake/hetero/gpu/3d" in prefix_report.tables(doc)
    (png,) = prefix_report.write_plots(doc, tmp_path)
    assert png.name == "prefix_mooncake.png" and png.stat().st_size > 10_000
