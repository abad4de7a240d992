"""Calibration drift: how far each pod's predictions have been from what it did, lately.

For every finished request the router knows what it predicted and what happened. A pod whose
hardware changed (throttled, a noisy neighbour, another driver) keeps being mispredicted in one
direction, while noise scatters around zero. `DriftTracker` keeps, per pod and quantity (TTFT,
TPOT), the relative errors |predicted - observed| / observed of the last `window` requests and
reports their median once it has `min_samples`: a median ignores the odd slow request and moves
only when most of the window is off. A pod's window restarts when its profile changes, so an
error is always about the profile in use (`profile_changed`).

A watch (`watch`) calls back, once per window, the first time a pod's error exceeds a threshold:
the sidecar then stops trusting that pod's profile until a new one is installed
(`sidecar.profile_trust`, config `drift.max_error`). The check costs one median of the observed
quantity's window per observation, and nothing once the pod has been reported.

Attribution: a request's TTFT error goes to the pod that prefilled it (its decode pod on the
local path), its TPOT error to its decode pod. Pure; the caller feeds it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from statistics import median

__all__ = ["DriftTracker"]

#: Called with (pod, its error) when the error first exceeds the watch's threshold.
Alarm = Callable[[str, float], None]


class DriftTracker:
    """Per pod and quantity, the median relative error of the last `window` requests."""

    def __init__(self, window: int = 64, min_samples: int = 16) -> None:
        if not 1 <= min_samples <= window:
            raise ValueError(f"need 1 <= min_samples <= window, got {min_samples}, {window}")
        self.window = window
        self.min_samples = min_samples
        # pod -> quantity -> errors: a pod's windows are found without scanning every pod's.
        self._errors: dict[str, dict[str, deque[float]]] = {}
        self._threshold = 0.0  # 0: no watch
        self._alarm: Alarm | None = None
        self._alarmed: set[str] = set()  # pods reported since their window (re)started

    def watch(self, threshold: float, alarm: Alarm) -> None:
        """Call `alarm(pod, error)` when a pod's error (`error`) first exceeds `threshold`, once
        until the pod's window restarts (`profile_changed`); `threshold` 0 turns the watch off."""
        if not threshold >= 0.0:  # NaN too: it would never compare greater
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        self._threshold, self._alarm = threshold, alarm

    def observe(self, pod: str, quantity: str, predicted: float, observed: float) -> None:
        """One request's `quantity` ("ttft" or "tpot") on `pod`; ignored when `observed` <= 0."""
        if observed <= 0 or predicted < 0:
            return
        windows = self._errors.get(pod)
        if windows is None:
            windows = self._errors[pod] = {}
        errors = windows.get(quantity)
        if errors is None:
            errors = windows[quantity] = deque(maxlen=self.window)
        errors.append(abs(predicted - observed) / observed)
        # The pod's error is the largest of its quantities' medians, and only this one moved:
        # it alone can have just crossed the threshold.
        if (
            self._threshold > 0.0
            and len(errors) >= self.min_samples
            and pod not in self._alarmed
            and median(errors) > self._threshold
        ):
            self._alarmed.add(pod)
            error = self.error(pod)  # >= this median: never None here
            assert self._alarm is not None and error is not None
            self._alarm(pod, error)

    def profile_changed(self, pod: str) -> None:
        """`pod` got a new profile: its errors were about the old one (and the watch may report
        it again)."""
        self._errors.pop(pod, None)
        self._alarmed.discard(pod)

    def error(self, pod: str) -> float | None:
        """The larger of the pod's TTFT and TPOT median errors; None before `min_samples`."""
        medians = [
            median(errors)
            for errors in self._errors.get(pod, {}).values()
            if len(errors) >= self.min_samples
        ]
        return max(medians) if medians else None

    def errors(self) -> dict[str, float]:
        """Every pod with enough samples -> its error."""
        return {p: e for p in sorted(self._errors) if (e := self.error(p)) is not None}
