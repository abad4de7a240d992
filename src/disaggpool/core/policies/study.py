"""The scorer of "Calibrate, Then Route" in its own form: a weighted sum with hand-set weights.

As the study describes it (its code is not public; this is our reading): a prefill instance is
scored by the prompt's work there, ``(queued tokens + n) * tau_pre``; a decode instance ``d`` by

    w_b * backlog(d) * sigma(SLO) + w_s * o_hat * tau_dec(d) * (1 + rho * press(d)) * sigma(SLO)
        + w_q * queue(d)

with `backlog` the predicted output tokens still to come there, `o_hat` the request's predicted
output, `tau_dec` the instance's decode step time, `press` the KV fill beyond 80% after admitting
the request, `queue` the requests waiting there, and `sigma` the class's urgency (a tight TPOT
target weighs more). Only `tau_pre` and `tau_dec` come from the profile (calibrated or, for
`study_weighted_datasheet`, derived from the datasheet); the weights are hand-set and the terms
mix units (tokens, seconds, requests), so a uniform error in the constants shifts the balance
between them. Our own scorer (`calibrated`) is in seconds throughout; the paper experiment's
ablation compares how much each loses when fed datasheet constants.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence

from disaggpool.core.contracts import InstanceSnapshot, RequestFeatures
from disaggpool.core.policies.base import PerRole, Stage
from disaggpool.core.profile import CalibrationProfile

__all__ = ["StudyWeightedPolicy"]

#: The hand-set weights (our choice, fixed once: a token of backlog is worth a millisecond, a
#: waiting request a tenth of a second; pressure beyond 80% of the KV cache counts four-fold).
W_BACKLOG = 1e-3
W_SERVICE = 1.0
W_QUEUE = 0.1
RHO = 4.0
PRESSURE_FROM = 0.8
#: The TPOT target whose urgency is 1; a class twice as tight weighs twice as much.
REFERENCE_TPOT_S = 0.05


class StudyWeightedPolicy(PerRole):
    """The study's weighted-sum scorer (module docstring); `profiles` overrides the constants.
    Each role by its own sum, the lowest first (`PerRole`)."""

    def __init__(
        self,
        name: str = "study_weighted",
        *,
        profiles: Mapping[str, CalibrationProfile] | None = None,
    ) -> None:
        self.name = name
        self._override = profiles

    def _profile(self, inst: InstanceSnapshot) -> CalibrationProfile | None:
        """The constants to score `inst` with; None (counted in tokens) for a profile outside
        the physical bounds, whose zero capacity or step time the scores would divide by."""
        prof = self._override.get(inst.name) if self._override is not None else inst.profile
        return prof if prof is not None and not prof.implausible else None

    def pick(
        self,
        req: RequestFeatures,
        instances: Sequence[InstanceSnapshot],
        stage: Stage,
        rng: random.Random,
    ) -> InstanceSnapshot:
        if stage == "prefill":
            return self._prefill(req, instances)
        return self._decode(req, instances)

    def _prefill(
        self, req: RequestFeatures, prefills: Sequence[InstanceSnapshot]
    ) -> InstanceSnapshot:
        best_p, best_cost = prefills[0], math.inf
        for inst in prefills:
            prof = self._profile(inst)
            if prof is None:
                cost = float(inst.queued_tokens + req.prompt_tokens)
            else:
                tau_pre = prof.prefill.prompt_time(req.prompt_tokens) / req.prompt_tokens
                cost = (inst.queued_tokens + req.prompt_tokens) * tau_pre
            if cost < best_cost:
                best_p, best_cost = inst, cost
        return best_p

    def _decode(
        self, req: RequestFeatures, decodes: Sequence[InstanceSnapshot]
    ) -> InstanceSnapshot:
        sigma = REFERENCE_TPOT_S / req.slo.tpot_s
        o_hat = max(1.0, req.predicted_output_tokens)
        best_d, best_cost = decodes[0], math.inf
        for inst in decodes:
            prof = self._profile(inst)
            batch = inst.running + max(inst.queued, inst.waiting)
            if prof is None:
                tau_dec, press = 1.0, 0.0
            else:
                tau_dec = prof.decode.step(batch + 1, inst.kv_tokens_used + req.prompt_tokens)
                fill = (inst.kv_tokens_used + req.prompt_tokens + o_hat) / prof.kv_capacity_tokens
                press = max(0.0, fill - PRESSURE_FROM)
            cost = (
                W_BACKLOG * inst.remaining_output_tokens * sigma
                + W_SERVICE * o_hat * tau_dec * (1.0 + RHO * press) * sigma
                + W_QUEUE * max(inst.queued, inst.waiting)
            )
            if cost < best_cost:
                best_d, best_cost = inst, cost
        return best_d
