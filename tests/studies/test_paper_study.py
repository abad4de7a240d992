"""Tests of disaggpool.studies.paper_study (the study's own setup) and the labels of paper_setup.

Everything here is pure: traces, SLO levels, splits, searches and run specs are built but not
simulated (the quick run in test_paper_quick does that).
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import NEEDS_DATASHEET, make_policy
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import RouterOptions
from disaggpool.studies.paper_config import PaperConfig, StudyConfig
from disaggpool.studies.paper_setup import (
    LABELS,
    SEARCH_POLICY,
    llama8b_setup,
    placed,
    placement_splits,
)
from disaggpool.studies.paper_study import (
    CASES,
    LEVERS,
    MAIN_LABELS,
    ROBUSTNESS_LABELS,
    VARIANTS,
    Study,
    ablation_variants,
    slo_classes,
    study_split,
    study_traces,
)
from disaggpool.studies.paper_traces import mixed_trace

CFG = PaperConfig.quick()
STUDY = StudyConfig.quick()


@pytest.fixture(scope="module")
def services() -> dict[str, list[TraceRequest]]:
    return azure_services()


@pytest.fixture(scope="module")
def study() -> Study:
    return Study.build(CFG)


# ------------------------------------------------------------------ the GPU-count split rule


@pytest.mark.parametrize(
    ("gpus", "split"),
    [(2, (1, 1)), (3, (1, 2)), (4, (1, 3)), (5, (2, 3)), (6, (2, 4)), (7, (2, 5)), (8, (3, 5))],
)
def test_study_split_keeps_the_studys_ratio(gpus: int, split: tuple[int, int]) -> None:
    assert study_split(gpus) == split
    assert sum(study_split(gpus)) == gpus


def test_study_split_at_six_is_the_studys_pool() -> None:
    assert study_split(6) == StudyConfig().split == (2, 4)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        study_split(1)


# ------------------------------------------------------------------ SLO levels


def test_slo_levels_apply_to_both_classes() -> None:
    tight = slo_classes(STUDY, "tight")
    loose = slo_classes(STUDY, "loose")
    assert [c.name for c in tight] == ["chat", "code"]
    assert {(c.ttft_s, c.tpot_s) for c in tight} == {(0.175, 0.0397)}
    assert [(c.ttft_s, c.tpot_s) for c in loose] == [pytest.approx((0.525, 0.1191))] * 2
    with pytest.raises(ValueError, match="tight"):
        slo_classes(STUDY, "medium")


# ------------------------------------------------------------------ traffic


def test_study_traces_are_clipped_to_2k_prompts(services: dict[str, list[TraceRequest]]) -> None:
    pairs = study_traces(STUDY, services)
    assert len(pairs) == len(STUDY.trace_cvs) == 3
    for k, (trace, history) in enumerate(pairs):
        start, length = 20.0 * 60.0 * k, STUDY.window_minutes * 60.0
        raw = [
            r for reqs in services.values() for r in reqs if start <= r.arrival_s < start + length
        ]
        assert len(trace) == len(raw)
        # Clipping does something (the raw window has longer prompts) and never lengthens one.
        assert max(r.prompt_tokens for r in raw) > STUDY.max_prompt
        assert max(r.prompt_tokens for r in trace) == STUDY.max_prompt
        assert sorted(min(r.prompt_tokens, STUDY.max_prompt) for r in raw) == sorted(
            r.prompt_tokens for r in trace
        )
        assert all(r.output_tokens <= STUDY.max_output for r in trace)
        assert {r.slo_class for r in trace} == {"chat", "code"}
        # The predictor's history: from outside the window, clipped alike.
        assert len(history) == STUDY.history
        assert max(r.prompt_tokens for r in history) <= STUDY.max_prompt


def test_study_traces_have_the_setups_arrival_cvs(
    services: dict[str, list[TraceRequest]],
) -> None:
    full = dataclasses.replace(STUDY, window_minutes=6.0)  # enough gaps for a CV estimate
    cvs = [workload.trace_stats(t)["interarrival_cv"] for t, _ in study_traces(full, services)]
    assert cvs == pytest.approx(list(full.trace_cvs), rel=0.25)
    assert cvs[0] < cvs[1] < cvs[2]


def test_chat_alone_is_one_class(services: dict[str, list[TraceRequest]]) -> None:
    trace, history = mixed_trace({"chat": services["chat"]}, 0, STUDY)
    assert trace and {r.slo_class for r in trace} == {"chat"}
    assert {r.slo_class for r in history} == {"chat"}


# ------------------------------------------------------------------ labels and variants


def test_labels_build_their_policies() -> None:
    sheet = builtin_profile(STUDY.datasheet)
    for label, arm in LABELS.items():
        datasheet = {"prefill-0": sheet} if arm.policy in NEEDS_DATASHEET else None
        assert make_policy(arm.policy, datasheet=datasheet, options=arm.options), label
    assert LABELS["calibrated"].options.pd_decider
    assert LABELS["uncalibrated"].options.pd_decider
    assert LABELS["length+local<512"].policy == "length"
    assert LABELS["length+local<512"].options.local_prefill_below == 512
    assert not LABELS["length"].options.local_prefill_below
    assert set(MAIN_LABELS) <= set(LABELS) and set(ROBUSTNESS_LABELS) <= set(MAIN_LABELS)


def test_every_lever_compares_two_variants_that_differ_in_one_thing() -> None:
    variants = {v.name: v for v in ablation_variants(1.0)}
    assert tuple(variants) == VARIANTS
    for lever, (on, off) in LEVERS.items():
        a, b = variants[on], variants[off]
        differences = [
            a.arm.policy != b.arm.policy,
            a.arm.options != b.arm.options,
            a.router != b.router,
            a.predictor != b.predictor,
        ]
        # Calibration swaps the policy (same scorer, datasheet constants), the rest one switch.
        assert sum(differences) == 1, lever
    # Off-by-default levers keep the setup's scrape interval and change only themselves.
    assert variants["late_binding"].router == RouterOptions(1.0, late_binding=True)
    assert variants["fresh_state"].router == RouterOptions(scrape_interval_s=0.0)


# ------------------------------------------------------------------ the study's derivation


def test_study_builds_both_levels_and_the_four_cases(study: Study) -> None:
    assert list(study.levels) == ["tight", "loose"]
    for level, setup in study.levels.items():
        assert setup.tags() == {"setup": "paper", "slo": level}
        assert setup.split == (2, 4)
        assert setup.router.scrape_interval_s == 1.0
        assert setup.nominal.kv_capacity_tokens == 60_000
    assert list(study.cases) == list(CASES)
    cases = study.cases
    assert cases["scarce_1p2d"].split == (1, 2)
    assert cases["decode3"].split == (2, 3)
    assert cases["stale_replicas"].router.replicas == 4
    assert {r.slo_class for r in cases["homogeneous_chat"].trace} == {"chat"}
    assert cases["decode3"].trace == study.tight.traces[0]


def test_study_searches_are_round_robin_at_each_point(study: Study) -> None:
    groups = study.searches()
    assert {k: len(v) for k, v in groups.items()} == {
        "paper/tight": 3,
        "paper/loose": 3,
        "paper/robustness": 4,
        "paper/gpu_count": 1,
    }
    for group in groups.values():
        for problem in group:
            assert problem.run.policy == SEARCH_POLICY
            assert problem.target_goodput == CFG.target_goodput
            assert 0 < problem.low < problem.high
    replicas = [p.run.router.replicas for p in groups["paper/robustness"]]
    assert replicas == [1, 1, 1, 4]
    gpu7 = groups["paper/gpu_count"][0].run
    n_p = sum(1 for i in gpu7.instances if i.role == "prefill")
    assert (n_p, len(gpu7.instances) - n_p) == study_split(7)


def _rated(study: Study) -> Study:
    rates = {k: [10.0 + i for i in range(len(v))] for k, v in study.searches().items()}
    return study.rated(rates)


def test_study_specs_carry_setup_level_and_experiment_keys(study: Study) -> None:
    rated = _rated(study)
    assert rated.levels["tight"].rates == (10.0, 11.0, 12.0)
    assert rated.case_rates == dict(zip(CASES, [10.0, 11.0, 12.0, 13.0], strict=True))
    specs = rated.specs()
    n_seeds = len(CFG.seeds)
    assert len(specs["main"]) == 2 * 3 * n_seeds * len(MAIN_LABELS)
    assert len(specs["ablation"]) == STUDY.ablation_traces * n_seeds * len(VARIANTS)
    assert len(specs["robustness"]) == len(CASES) * n_seeds * len(ROBUSTNESS_LABELS)
    assert len(specs["gpu_count"]) == len(STUDY.gpu_counts) * n_seeds * 4
    for name, group in specs.items():
        for spec in group:
            extra = dict(spec.extra)
            assert extra["setup"] == "paper"
            assert extra["slo"] in (("tight", "loose") if name == "main" else ("tight",))
    main_rate = {
        (dict(s.extra)["slo"], s.trace_name): workload.trace_stats(s.trace)["rate"]
        for s in specs["main"]
    }
    # Each trace runs at its own operating rate (rescaled from rate 1).
    assert main_rate[("tight", "mixed-0")] == pytest.approx(10.0, rel=0.3)
    assert main_rate[("loose", "mixed-2")] == pytest.approx(12.0, rel=0.3)
    ablation = {dict(s.extra)["variant"]: s for s in specs["ablation"]}
    assert ablation["fresh_state"].router.scrape_interval_s == 0.0
    assert ablation["calibrated"].router.scrape_interval_s == 1.0
    assert ablation["noisy_predictor"].predictor == "noisy:1.5"
    assert ablation["datasheet_constants"].policy == "uncalibrated"
    gpus = {dict(s.extra)["gpus"]: s for s in specs["gpu_count"]}
    for g, spec in gpus.items():
        n_p = sum(1 for i in spec.instances if i.role == "prefill")
        assert (n_p, len(spec.instances) - n_p) == study_split(g)
    described = rated.describe()
    assert described["rates_rps"]["loose"] == [10.0, 11.0, 12.0]
    assert described["robustness"]["stale_replicas"]["router_replicas"] == 4
    assert described["gpu_count"]["splits"]["6"] == "2P4D"


# ------------------------------------------------------------------ llama8b's placement


def test_quick_placement_searches_only_near_the_analytic_split() -> None:
    setup = llama8b_setup(CFG)
    centre = capacity.best_split(CFG.gpus, setup.cap)[0]
    assert placement_splits(setup, CFG) == [centre - 1, centre, centre + 1]
    full = dataclasses.replace(CFG, split_window=None)
    assert placement_splits(setup, full) == list(range(1, CFG.gpus))
    # The split carrying the most traffic wins; its per-trace rates become the setup's.
    found = [1.0, 1.0, 1.0, 3.0, 2.0, 4.0, 2.0, 2.0, 2.0]
    best = placed(setup, CFG, found)
    assert best.split == (centre, CFG.gpus - centre)
    assert best.rates == (3.0, 2.0, 4.0)
    assert math.isclose(best.split_rates[centre], 3.0)
