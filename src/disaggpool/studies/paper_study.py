"""The ``paper`` setup: the study's own configuration, and its experiments.

The configuration as secondary summaries of "Calibrate, Then Route" report it (unconfirmed: the
study's code and full text are not available to us): Qwen2.5-3B at TP1 on A40s
(`a40-qwen2.5-3b`, with the study's 60k-token KV budget per engine), a fixed pool of 2 prefill +
4 decode instances, and one SLO for every request of both classes: TTFT 175 ms, TPOT 39.7 ms.
The study's "simulator-derived constants" arm is `a40-qwen2.5-3b-datasheet`: a roofline of the
same model with the A40's peak numbers, so the gap to the calibrated constants comes from the
model, nothing typed in. Two SLO levels run on it: ``tight`` (the study's targets) and ``loose``
(3x both), rows carry ``"slo"``.

Traffic: the same Azure conversation + code windows as llama8b's mixed traces
(`studies.paper_traces`), but prompts clipped to 2,048 tokens and arrival CVs 1.0, 1.5 and 2.0. Why:
the tight 175 ms TTFT is below the unloaded TTFT of a longer prompt on an A40 with this model (a
2k prompt takes ~140 ms unloaded: 125 ms of prefill, its KV transfer and a first decode step), so
longer prompts would miss whatever the router does; and with burstier arrivals (llama8b's CVs 2-4)
round-robin attains 0.85 goodput at no load at all under the tight SLO, so no operating point
exists by the principle both setups share. Each trace x SLO level runs at round-robin's 0.85
point (`studies.paper_setup`); the predictor first learns from 2,000 requests from outside the
window, clipped alike.

Experiments (every run with the setup's router: scraped every 1 s):

* ``main``: both SLO levels, all of `MAIN_LABELS` x 3 traces x seeds.
* ``ablation`` (tight): what each lever of ``calibrated`` earns, one row group per `Variant`
  (rows carry ``"variant"``), on the three traces (``--quick``: trace 0); `LEVERS` names the
  pairs compared.
* ``robustness`` (tight, trace 0): the cases of `CASES` (rows carry ``"case"``), each at its own
  round-robin 0.85 point: the conversation service alone (one class), 1 prefill + 2 decode,
  2 prefill + 3 decode, and 4 router replicas each with its own ledger and an even share of
  arrivals.
* ``gpu_count`` (tight, trace 0): G GPUs split with prefill = round(G/3) (`study_split`: 2P+4D at
  6, the study's ratio) at the rate round-robin carries at 0.85 goodput on 7 GPUs (2P+5D).

`Study` derives the setup (its searches go into `studies.paper`'s lockstep search) and builds the
runs. Called by `studies.paper`; `studies.paper_report` reads `LEVERS`, `CASES` and `VARIANTS`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from disaggpool.core.contracts import SLOClass
from disaggpool.core.hardware import builtin_profile
from disaggpool.core.policies.registry import PolicyOptions
from disaggpool.formats.embedded import azure_services
from disaggpool.formats.traces import TraceRequest
from disaggpool.sim import capacity, workload
from disaggpool.sim.cluster import RouterOptions
from disaggpool.sim.operating_point import SearchProblem
from disaggpool.sim.runner import RunSpec
from disaggpool.studies.paper_config import PaperConfig, StudyConfig
from disaggpool.studies.paper_setup import (
    LABELS,
    SWEEP_LABELS,
    Arm,
    Setup,
    constant_error_runs,
    paper_run,
    rate_search,
)
from disaggpool.studies.paper_traces import mixed_trace

__all__ = [
    "BASE_LABELS",
    "CASES",
    "GPU_COUNT_LABELS",
    "LEVERS",
    "MAIN_LABELS",
    "ROBUSTNESS_LABELS",
    "SLO_LEVELS",
    "VARIANTS",
    "Case",
    "Study",
    "Variant",
    "ablation_variants",
    "slo_classes",
    "study_split",
    "study_traces",
]

SLO_LEVELS = ("tight", "loose")

# The baselines, the peer-style decider, ours two ways: what both setups compare.
BASE_LABELS = (
    "round_robin",
    "random",
    "least_loaded",
    "length",
    "p2c",
    "length+local<512",
    "calibrated",
    "uncalibrated",
)
MAIN_LABELS = (*BASE_LABELS, "calibrated+priority", "study_weighted", "study_weighted_datasheet")
ROBUSTNESS_LABELS = BASE_LABELS
GPU_COUNT_LABELS = SWEEP_LABELS

CASES = ("homogeneous_chat", "scarce_1p2d", "decode3", "stale_replicas")
"""The robustness cases, in output order."""


@dataclasses.dataclass(frozen=True)
class Variant:
    """One arm of the ablation: a policy and switches, and what the router knows.

    `router` None is the setup's router; `predictor` is a `core.predictor.make_predictor` spec.
    """

    name: str
    arm: Arm
    router: RouterOptions | None = None
    predictor: str = "online"


def ablation_variants(scrape_interval_s: float) -> tuple[Variant, ...]:
    """The ablation's arms: ``calibrated`` with everything on, then one lever changed each."""
    cal = LABELS["calibrated"]
    no_pd = dataclasses.replace(cal.options, pd_decider=False)
    return (
        Variant("calibrated", cal),
        Variant("no_pd_decider", Arm("calibrated", no_pd)),
        Variant("no_guard", LABELS["calibrated_greedy"]),
        Variant("priority_scheduling", LABELS["calibrated+priority"]),
        Variant(
            "late_binding",
            cal,
            router=RouterOptions(scrape_interval_s=scrape_interval_s, late_binding=True),
        ),
        Variant("fresh_state", cal, router=RouterOptions(scrape_interval_s=0.0)),
        Variant("oracle_predictor", cal, predictor="oracle"),
        Variant("noisy_predictor", cal, predictor="noisy:1.5"),
        Variant("datasheet_constants", LABELS["uncalibrated"]),
        Variant("datasheet_no_pd", Arm("uncalibrated", PolicyOptions(pd_decider=False))),
        Variant("study_weighted", LABELS["study_weighted"]),
        Variant("study_weighted_datasheet", LABELS["study_weighted_datasheet"]),
    )


VARIANTS = tuple(v.name for v in ablation_variants(1.0))
"""The ablation's variant names, in output order."""

LEVERS: dict[str, tuple[str, str]] = {
    # What the product's levers earn: all on minus the lever off.
    "pd_decider": ("calibrated", "no_pd_decider"),
    "scarcity_guard": ("calibrated", "no_guard"),
    # Off by default (the engines must run --scheduling-policy priority).
    "priority_scheduling": ("priority_scheduling", "calibrated"),
    "calibration": ("calibrated", "datasheet_constants"),
    # Calibration for each scorer form without the decider (the study's form has none).
    "calibration_without_pd": ("no_pd_decider", "datasheet_no_pd"),
    "calibration_study_form": ("study_weighted", "study_weighted_datasheet"),
    # What the router does not have by default, and what it would earn.
    "late_binding": ("late_binding", "calibrated"),
    "fresh_state": ("fresh_state", "calibrated"),
    "oracle_predictor": ("oracle_predictor", "calibrated"),
    "noisy_predictor": ("noisy_predictor", "calibrated"),
}
"""Lever -> (with, without) variants: the lever's points are mean(with) - mean(without)."""


def study_split(gpus: int) -> tuple[int, int]:
    """(prefill, decode) of `gpus` GPUs at the study's 1:2 ratio: prefill = round(G/3)."""
    if gpus < 2:
        raise ValueError(f"a disaggregated pool needs at least 2 GPUs, got {gpus}")
    p = max(1, round(gpus / 3))
    return p, gpus - p


def slo_classes(study: StudyConfig, level: str) -> tuple[SLOClass, ...]:
    """Both classes with the same targets: the study's (``tight``) or 3x them (``loose``)."""
    if level not in SLO_LEVELS:
        raise ValueError(f"SLO level must be one of {SLO_LEVELS}, got {level!r}")
    k = 1.0 if level == "tight" else study.loose_factor
    return tuple(
        SLOClass(name, round(study.tight_ttft_s * k, 6), round(study.tight_tpot_s * k, 6))
        for name in ("chat", "code")
    )


def study_traces(
    study: StudyConfig, services: Mapping[str, Sequence[TraceRequest]]
) -> list[tuple[list[TraceRequest], list[TraceRequest]]]:
    """The setup's mixed traces and predictor histories, one per arrival CV."""
    return [mixed_trace(services, k, study) for k in range(len(study.trace_cvs))]


@dataclasses.dataclass(frozen=True)
class Case:
    """One robustness case: a trace (and history), a pool split and what the router knows."""

    name: str
    trace_name: str
    trace: tuple[TraceRequest, ...]
    history: tuple[TraceRequest, ...]
    split: tuple[int, int]
    router: RouterOptions


@dataclasses.dataclass(frozen=True)
class Study:
    """The paper setup at both SLO levels, its robustness cases, and the runs built on them.

    `build` derives everything but the operating rates; `searches` are the rates' searches and
    `rated` returns the study with them, ready for `specs` and `describe`.
    """

    cfg: PaperConfig
    levels: dict[str, Setup]
    cases: dict[str, Case]
    case_rates: dict[str, float] = dataclasses.field(default_factory=dict)
    gpu_rate: float = math.nan  # round-robin's 0.85 point on 7 GPUs

    @classmethod
    def build(cls, cfg: PaperConfig) -> Study:
        study = cfg.study
        services = azure_services()
        pairs = study_traces(study, services)
        nominal = builtin_profile(study.profile)
        router = RouterOptions(scrape_interval_s=cfg.scrape_interval_s)
        all_requests = [r for t, _ in pairs for r in t]
        levels = {}
        for level in SLO_LEVELS:
            slo = slo_classes(study, level)
            levels[level] = Setup(
                name="paper",
                nominal=nominal,
                datasheet=builtin_profile(study.datasheet),
                slo=slo,
                cap=capacity.pool_capacity(nominal, all_requests, slo[0].tpot_s),
                split=study.split,
                rates=(),
                traces=tuple(tuple(t) for t, _ in pairs),
                histories=tuple(tuple(h) for _, h in pairs),
                router=router,
                slo_level=level,
            )
        chat, chat_history = mixed_trace({"chat": services["chat"]}, 0, study)
        trace0, history0 = pairs[0]
        n_p, n_d = study.split

        def case(name: str, split: tuple[int, int], replicas: int = 1) -> Case:
            return Case(
                name,
                "mixed-0",
                tuple(trace0),
                tuple(history0),
                split,
                dataclasses.replace(router, replicas=replicas),
            )

        cases = {
            "homogeneous_chat": Case(
                "homogeneous_chat",
                "chat-0",
                tuple(chat),
                tuple(chat_history),
                study.split,
                router,
            ),
            "scarce_1p2d": case("scarce_1p2d", (1, 2)),
            "decode3": case("decode3", (n_p, n_d - 1)),
            "stale_replicas": case("stale_replicas", study.split, replicas=4),
        }
        return cls(cfg, levels, cases)

    @property
    def tight(self) -> Setup:
        return self.levels["tight"]

    def _guess(self, trace: Sequence[TraceRequest], split: tuple[int, int]) -> float:
        cap = capacity.pool_capacity(self.tight.nominal, trace, self.tight.tightest_tpot_s)
        return capacity.bottleneck_rps(split[0], split[1], cap)

    def searches(self) -> dict[str, list[SearchProblem]]:
        """Every operating-point search of the setup, by group (`rated` takes their rates)."""
        cfg = self.cfg
        groups = {
            f"paper/{level}": [
                rate_search(setup, cfg, t, h, *setup.split, self._guess(t, setup.split))
                for t, h in zip(setup.traces, setup.histories, strict=True)
            ]
            for level, setup in self.levels.items()
        }
        groups["paper/robustness"] = [
            rate_search(
                self.tight,
                cfg,
                c.trace,
                c.history,
                *c.split,
                self._guess(c.trace, c.split),
                router=c.router,
            )
            for c in self.cases.values()
        ]
        split7 = study_split(7)
        t0, h0 = self.tight.traces[0], self.tight.histories[0]
        groups["paper/gpu_count"] = [
            rate_search(self.tight, cfg, t0, h0, *split7, self._guess(t0, split7))
        ]
        return groups

    def rated(self, rates: Mapping[str, Sequence[float]]) -> Study:
        """The study with the rates `searches` found (keyed and ordered as it returned them)."""
        return dataclasses.replace(
            self,
            levels={
                level: dataclasses.replace(setup, rates=tuple(rates[f"paper/{level}"]))
                for level, setup in self.levels.items()
            },
            case_rates=dict(zip(self.cases, rates["paper/robustness"], strict=True)),
            gpu_rate=rates["paper/gpu_count"][0],
        )

    def specs(self) -> dict[str, list[RunSpec]]:
        """The runs of the setup's experiments, keyed by experiment."""
        return {
            "main": self._main(),
            "ablation": self._ablation(),
            "robustness": self._robustness(),
            "gpu_count": self._gpu_count(),
            "constant_error": constant_error_runs(self.tight, self.cfg, self.cfg.error_traces),
        }

    def _main(self) -> list[RunSpec]:
        return [
            paper_run(
                setup,
                "main",
                f"mixed-{k}",
                workload.rescale(t, rate),
                h,
                *setup.split,
                label,
                seed,
                rate_rps=round(rate, 4),
            )
            for setup in self.levels.values()
            for k, (t, h, rate) in enumerate(
                zip(setup.traces, setup.histories, setup.rates, strict=True)
            )
            for seed in self.cfg.seeds
            for label in MAIN_LABELS
        ]

    def _ablation(self) -> list[RunSpec]:
        setup = self.tight
        return [
            paper_run(
                setup,
                "ablation",
                f"mixed-{k}",
                workload.rescale(t, rate),
                h,
                *setup.split,
                v.arm.policy,
                seed,
                arm=v.arm,
                router=v.router,
                predictor=v.predictor,
                variant=v.name,
                rate_rps=round(rate, 4),
            )
            for k, (t, h, rate) in enumerate(
                zip(setup.traces, setup.histories, setup.rates, strict=True)
            )
            if k < self.cfg.study.ablation_traces
            for seed in self.cfg.seeds
            for v in ablation_variants(self.cfg.scrape_interval_s)
        ]

    def _robustness(self) -> list[RunSpec]:
        return [
            paper_run(
                self.tight,
                "robustness",
                c.trace_name,
                workload.rescale(c.trace, self.case_rates[c.name]),
                c.history,
                *c.split,
                label,
                seed,
                router=c.router,
                case=c.name,
                rate_rps=round(self.case_rates[c.name], 4),
            )
            for c in self.cases.values()
            for seed in self.cfg.seeds
            for label in ROBUSTNESS_LABELS
        ]

    def _gpu_count(self) -> list[RunSpec]:
        setup = self.tight
        trace = workload.rescale(setup.traces[0], self.gpu_rate)
        return [
            paper_run(
                setup,
                "gpu_count",
                "mixed-0",
                trace,
                setup.histories[0],
                *study_split(gpus),
                label,
                seed,
                gpus=gpus,
                rate_rps=round(self.gpu_rate, 4),
            )
            for gpus in self.cfg.study.gpu_counts
            for seed in self.cfg.seeds
            for label in GPU_COUNT_LABELS
        ]

    def describe(self) -> dict[str, Any]:
        """The paper block of the document's ``setups``."""
        study, tight = self.cfg.study, self.tight
        return {
            "source": "the study's configuration as secondary summaries report it (unconfirmed)",
            "profile": tight.nominal.name,
            "datasheet": tight.datasheet.name,
            "kv_capacity_tokens": tight.nominal.kv_capacity_tokens,
            "target_goodput": self.cfg.target_goodput,
            "router": dataclasses.asdict(tight.router),
            "gpus": sum(study.split),
            "split": {"prefill": study.split[0], "decode": study.split[1]},
            "slo_levels": {
                level: {"ttft_s": s.slo[0].ttft_s, "tpot_s": s.slo[0].tpot_s}
                for level, s in self.levels.items()
            },
            "rates_rps": {
                level: [round(r, 4) for r in s.rates] for level, s in self.levels.items()
            },
            "robustness": {
                c.name: {
                    "trace": c.trace_name,
                    "split": {"prefill": c.split[0], "decode": c.split[1]},
                    "router_replicas": c.router.replicas,
                    "rate_rps": round(self.case_rates.get(c.name, math.nan), 4),
                }
                for c in self.cases.values()
            },
            "gpu_count": {
                "rate_rps": round(self.gpu_rate, 4),
                "splits": {str(g): "{}P{}D".format(*study_split(g)) for g in study.gpu_counts},
            },
            "traces": [workload.trace_stats(t) for t in tight.traces],
            "trace_cvs": list(study.trace_cvs),
            "max_prompt": study.max_prompt,
            "window_minutes": study.window_minutes,
            "seeds": list(self.cfg.seeds),
        }
