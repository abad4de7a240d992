"""Calibration drift: how far each pod's predictions have been from what it did, lately.

For every finished request the router knows what it predicted and what happened. A pod whose
hardware changed (throttled, a noisy neighbour, another driver) keeps being mispredicted in one
direction, while noise scatters around zero. `DriftTracker` keeps, per pod and quantity (TTFT,
TPOT), the relative errors |predicted - observed| / observed of the last `window` requests and
reports their median once it has `min_samples`: a median ignores the odd slow request and moves
only when most of the window is off. A pod's window restarts when its profile changes, so an
error is always about the profile in use (`profile_changed`).

Attribution: a request's TTFT error goes to the pod that prefilled it (its decode pod on the
local path), its TPOT error to its decode pod. Pure; the caller feeds it.
"""

from __future__ import annotations

from collections import deque
from statistics import median

__all__ = ["DriftTracker"]


class DriftTracker:
    """Per pod and quantity, the median relative error of the last `window` requests."""

    def __init__(self, window: int = 64, min_samples: int = 16) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self.window = window
        self.min_samples = min_samples
        self._errors: dict[tuple[str, str], deque[float]] = {}

    def observe(self, pod: str, quantity: str, predicted: float, observed: float) -> None:
        """One request's `quantity` ("ttft" or "tpot") on `pod`; ignored when `observed` <= 0."""
        if observed <= 0 or predicted < 0:
            return
        errors = self._errors.setdefault((pod, quantity), deque(maxlen=self.window))
        errors.append(abs(predicted - observed) / observed)

    def profile_changed(self, pod: str) -> None:
        """`pod` got a new profile: its errors were about the old one."""
        for key in [k for k in self._errors if k[0] == pod]:
            del self._errors[key]

    def error(self, pod: str) -> float | None:
        """The larger of the pod's TTFT and TPOT median errors; None before `min_samples`."""
        medians = [
            median(errors)
            for (name, _), errors in self._errors.items()
            if name == pod and len(errors) >= self.min_samples
        ]
        return max(medians) if medians else None

    def errors(self) -> dict[str, float]:
        """Every pod with enough samples -> its error."""
        pods = sorted({name for name, _ in self._errors})
        return {p: e for p in pods if (e := self.error(p)) is not None}
