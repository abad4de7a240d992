"""What the end of each request teaches the sidecar's signals, beside what the router learns.

The router (`core.router.Router`) forgets a request and teaches its output-length predictor; the
routing service (`sidecar.service`) then hands the request's entry here, which feeds:

* goodput per SLO class: `disaggpool_requests_total{slo_class,outcome}` (met, missed, failed,
  shed; aborted ones, which the client ended, stay out of goodput);
* traffic heterogeneity: the coefficient of variation of prompt + output tokens over a sliding
  window (`core.heterogeneity`), which the decode autoscaler reads;
* demand: arrivals, the routed mix (prompts, predicted outputs, local prefills), token volumes
  and how far each request was from its targets (`core.demand.DemandWindow`, what the
  autoscalers size the pools from);
* predicted-vs-observed error of TTFT and TPOT, per pod in `core.drift` (the TTFT is the
  prefilling pod's doing, the decode pod's on the local path), which distrusts a profile its own
  requests contradict (`sidecar.profile_trust`) and asks the operator to re-probe.

Synchronous and loop-confined, like the service.
"""

from __future__ import annotations

from disaggpool.core.demand import DemandWindow
from disaggpool.core.drift import DriftTracker
from disaggpool.core.heterogeneity import SlidingSpread
from disaggpool.core.ledger import Entry
from disaggpool.sidecar.metrics import SidecarMetrics

__all__ = ["Outcomes"]


class Outcomes:
    """The signals fed by finished, failed and shed requests (module docstring)."""

    def __init__(
        self,
        metrics: SidecarMetrics,
        demand: DemandWindow,
        spread: SlidingSpread,
        drift: DriftTracker,
    ) -> None:
        self.metrics = metrics
        self.demand = demand
        self.spread = spread
        self.drift = drift

    def arrived(self, now: float) -> None:
        self.demand.arrived(now)

    def admitted(self, now: float, prompt: int, predicted_output: float, *, local: bool) -> None:
        """A request was routed (after `arrived`); `local`: its decode pod prefills it."""
        self.demand.admitted(now, prompt, predicted_output, local=local)

    def finished(
        self,
        rec: Entry,
        output_tokens: int,
        ttft_s: float,
        tpot_s: float,
        now: float,
        *,
        predicted_ttft_s: float | None = None,
        predicted_tpot_s: float | None = None,
        met: bool | None = None,
    ) -> None:
        """A completed request; `met` overrides judging the SLO on ttft_s/tpot_s."""
        m = self.metrics
        self.spread.add(float(rec.prompt_tokens + output_tokens))
        m.heterogeneity.set(self.spread.cv)
        slo = rec.slo
        self.demand.finished(
            now, rec.prompt_tokens, output_tokens, ttft_s / slo.ttft_s, tpot_s / slo.tpot_s
        )
        if met is None:
            met = slo.met(ttft_s, tpot_s)
        m.outcome(slo.name, "met" if met else "missed")
        err = m.prediction_error
        if predicted_ttft_s is not None and ttft_s > 0:
            err.labels("ttft").observe(abs(predicted_ttft_s - ttft_s) / ttft_s)
            pod = rec.prefill or rec.decode
            if pod:
                self.drift.observe(pod, "ttft", predicted_ttft_s, ttft_s)
        if predicted_tpot_s is not None and tpot_s > 0 and output_tokens > 1:
            err.labels("tpot").observe(abs(predicted_tpot_s - tpot_s) / tpot_s)
            if rec.decode:
                self.drift.observe(rec.decode, "tpot", predicted_tpot_s, tpot_s)

    def failed(self, rec: Entry, *, aborted: bool = False) -> None:
        """A request that ended in an error (or expired); `aborted`: the client left."""
        if aborted:
            self.metrics.requests.labels(rec.slo.name, "aborted").inc()
        else:
            self.metrics.outcome(rec.slo.name, "failed")

    def shed(self, slo_class: str) -> None:
        """Refused at the door: its class is sheddable and it would have missed its SLO."""
        self.metrics.rejected.labels("shed").inc()
        self.metrics.outcome(slo_class, "shed")
