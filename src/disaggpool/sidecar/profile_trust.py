"""Which profile each pod is scored with, and, when it is not a trusted one, why, said once.

The routing service (`sidecar.service`) owns one `ProfileTrust` and hands it every profile event:

* **installed** (`install`): a profile the collectors (re)loaded. A profile that is not trusted
  (a re-probe that came out poor) never replaces a trusted one, which is kept until a new fit is
  trusted (the pod's drift error keeps asking for re-probes). Anything installed starts the pod's
  drift window over.
* **refused** (`rejected`): a profile file or ConfigMap that does not parse or is not physics
  (`core.profile.BOUNDS`). The pod is scored as a pod without a trusted profile (the median
  trusted profile of its pool, else least-loaded: the calibrated policy's rule), even if it had
  a trusted one: what was written for it now is broken, and guessing which older fit still holds
  is not the router's to do. `disaggpool_profile_rejected{pod}` is 1 until a valid profile comes.
* **distrusted** (`drift.max_error` > 0): a pod whose drift error (`core.drift`: the median
  relative error of its recent TTFT or TPOT predictions) exceeds `max_error` has a profile its
  own requests contradict. It keeps the profile, marked (`CalibrationProfile.distrust`, so it is
  no longer `trusted` and the policy scores the pod with the median trusted profile), and
  `disaggpool_profile_distrusted{pod}` is 1, until a different profile is installed (a re-probe:
  a new `fitted_at`; the same profile delivered again changes nothing). The drift window keeps
  running meanwhile: its error, written on the pool, is what makes the operator re-probe.

Every state change is one warning in the log (`disaggpool.sidecar`), and a decision that falls
back because of a pod says why once per pod and profile change (`fallback_used`). Decode pods
whose trusted profile did not measure its KV transfer are logged with what prices it
(`note_transfer_stand_ins`).

The distrust check runs where the drift errors are fed (`DriftTracker.watch`, on a finished
request's report), one median per report, never on the route path. Synchronous and
loop-confined, like the service.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

from disaggpool.core.drift import DriftTracker
from disaggpool.core.policies.calibrated import median_measured_transfer
from disaggpool.core.profile import CalibrationProfile, KVTransferModel
from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.state import PoolState

__all__ = ["ProfileTrust"]

log = logging.getLogger("disaggpool.sidecar")


class ProfileTrust:
    """Profile installation, refusal and distrust for one pool (see the module docstring)."""

    def __init__(
        self,
        state: PoolState,
        drift: DriftTracker,
        metrics: SidecarMetrics,
        clock: Callable[[], float],
        *,
        max_error: float = 0.0,
    ) -> None:
        self.state = state
        self.drift = drift
        self.metrics = metrics
        self.clock = clock
        self.max_error = max_error
        self._rejected: dict[str, str] = {}  # pod -> why its profile was refused
        self._kept_logged: dict[str, str] = {}  # pod -> fitted_at of an untrusted profile refused
        self._untrusted_logged: set[str] = set()
        # decode pod -> the measured transfer standing in for its unmeasured one (None: defaults)
        self._stand_ins_logged: dict[str, KVTransferModel | None] = {}
        self._gauged: set[str] = set()  # pods with profile_rejected/profile_distrusted series
        if max_error > 0.0:
            drift.watch(max_error, self._contradicted)

    # ------------------------------------------------------------------ events
    def install(self, pod: str, profile: CalibrationProfile | None, now: float) -> bool:
        """Give `pod` its (re)loaded `profile` (None clears it); False when refused: an untrusted
        profile never replaces a trusted one, and the profile a pod is distrusted with, delivered
        again, is not a new one."""
        inst = self.state.instances.get(pod)
        current = inst.profile if inst is not None else None
        if profile is not None and current is not None and current.distrust and profile == current:
            return False  # equal ignores `distrust`: a re-list or a rewritten file, not a re-probe
        if profile is not None and not profile.trusted and current is not None and current.trusted:
            if self._kept_logged.get(pod) != profile.fitted_at:
                self._kept_logged[pod] = profile.fitted_at
                log.warning(
                    "pod %s: new profile is %s (%s); keeping the trusted one fitted %s",
                    pod, profile.quality, profile.notes or "no reason given", current.fitted_at,
                )  # fmt: skip
            return False
        if self._rejected.pop(pod, None) is not None:
            log.info("pod %s: a valid profile replaces the refused one", pod)
        self.state.set_profile(pod, profile, now)
        self._set_gauges(pod, rejected=False, distrusted=False)
        self.profile_changed(pod)
        return True

    def rejected(self, pod: str, message: str) -> None:
        """The collectors could not use the profile written for `pod` (`message` says why: the
        file and field at fault). The pod is scored as one without a trusted profile until a
        valid profile is installed. Cheap and quiet when repeated: a watch reports the same
        refusal on every re-list."""
        inst = self.state.instances.get(pod)
        if inst is None:
            return
        repeated = self._rejected.get(pod) == message
        self._rejected[pod] = message
        dropped = inst.profile
        if dropped is not None:  # what was written for it now is broken: stop using it too
            self.state.set_profile(pod, None, self.clock())
            self.profile_changed(pod)
        self._set_gauges(pod, rejected=True, distrusted=False)
        if repeated and dropped is None:
            return
        self._untrusted_logged.add(pod)  # said here: the first fallback need not say it again
        log.warning(
            "pod %s: profile refused (%s): scored as a pod without a trusted profile (the median "
            "trusted profile of its pool, else least-loaded) until a valid one is installed%s",
            pod,
            message,
            f"; its previous profile (fitted {dropped.fitted_at or 'at an unknown time'}) is "
            "no longer used"
            if dropped is not None
            else "",
        )

    def _contradicted(self, pod: str, error: float) -> None:
        """The drift watch: `pod`'s error exceeds `max_error`. Stop trusting its profile."""
        inst = self.state.instances.get(pod)
        profile = inst.profile if inst is not None else None
        if inst is None or profile is None or not profile.trusted:
            return  # nothing trusted to stop trusting (it is already scored without one)
        why = f"drift error {error:.3g} > drift.max_error {self.max_error:g}"
        # The same profile, marked: its age, metrics and annotation still describe it.
        self.state.set_profile(
            pod, dataclasses.replace(profile, distrust=why), inst.profile_loaded_at
        )
        self._set_gauges(pod, rejected=False, distrusted=True)
        self._untrusted_logged.add(pod)
        log.warning(
            "pod %s: %s: its profile (fitted %s) mispredicts it and is no longer trusted; scored "
            "as a pod without a trusted profile until a new profile is installed",
            pod,
            why,
            profile.fitted_at or "at an unknown time",
        )
        self.note_transfer_stand_ins()  # its measured transfer no longer counts in the median

    def profile_changed(self, pod: str) -> None:
        """A pod's profile was (re)loaded: warn again if it is still untrusted, say again what
        prices the KV transfer of decode pods that did not measure theirs, and start its drift
        window over (its errors were about the old profile)."""
        self._untrusted_logged.discard(pod)
        self._kept_logged.pop(pod, None)
        self.drift.profile_changed(pod)
        self.note_transfer_stand_ins()

    # ------------------------------------------------------------------ saying why
    def why_untrusted(self, pod: str) -> str:
        """Why `pod` has no trusted profile, for a log line ("" when it has one)."""
        inst = self.state.instances.get(pod)
        p = inst.profile if inst is not None else None
        if p is None:
            refused = self._rejected.get(pod)
            return f"refused: {refused}" if refused is not None else "none"
        if p.distrust:
            return f"distrusted: {p.distrust}"
        if p.implausible:
            return f"not physics: {p.implausible}"
        return "" if p.trusted else p.quality

    def fallback_used(self, pod: str, fallback: str) -> None:
        """A decision fell back (`fallback`: median-profile or least-loaded) and chose `pod`:
        warn once per pod and profile change when `pod` is one without a trusted profile."""
        if pod in self._untrusted_logged:
            return
        why = self.why_untrusted(pod)
        if not why:
            return
        self._untrusted_logged.add(pod)
        log.warning(
            "pod %s has no trusted calibration profile (%s): routing with %s",
            pod,
            why,
            "the median trusted profile" if fallback == "median-profile" else "least-loaded",
        )

    def note_transfer_stand_ins(self) -> None:
        """Log, for each decode pod whose trusted profile did not measure its KV transfer (probed
        without --peer), what the calibrated policy prices it with: the median measured transfer
        of the decode pool, or the profile's defaults when no pod measured one (the rule is
        `core.policies.calibrated`'s). Once per pod and stand-in; call it when profiles or
        membership change, which is all that changes the stand-in. Also forgets the profile
        gauges of pods that left the pool."""
        decodes = self.state.members("decode")
        stand_in = median_measured_transfer(i.profile for i in decodes)
        logged = self._stand_ins_logged
        for inst in decodes:
            p = inst.profile
            if p is None or p.transfer_measured or not p.trusted:
                logged.pop(inst.name, None)
                continue
            if inst.name in logged and logged[inst.name] == stand_in:
                continue
            logged[inst.name] = stand_in
            if stand_in is None:
                log.warning(
                    "pod %s: KV transfer not measured (probed without --peer) and no decode pod "
                    "measured one: the calibrated policy prices it with its defaults (%s)",
                    inst.name,
                    _transfer_text(p.kv_transfer),
                )
            else:
                log.warning(
                    "pod %s: KV transfer not measured (probed without --peer): the calibrated "
                    "policy prices it with the decode pool's median measured transfer (%s), not "
                    "its profile's defaults (%s)",
                    inst.name,
                    _transfer_text(stand_in),
                    _transfer_text(p.kv_transfer),
                )
        self._forget_departed()

    # ------------------------------------------------------------------ metrics
    def _set_gauges(self, pod: str, *, rejected: bool, distrusted: bool) -> None:
        """Both gauges of a pod of the pool: a pod gets its series with its first profile."""
        if pod not in self.state.instances:
            return
        m = self.metrics
        m.profile_rejected.labels(pod).set(1.0 if rejected else 0.0)
        m.profile_distrusted.labels(pod).set(1.0 if distrusted else 0.0)
        self._gauged.add(pod)

    def _forget_departed(self) -> None:
        """Pods that left the pool leave the profile gauges (and their refusals) too."""
        present = {name for name, inst in self.state.instances.items() if not inst.removed}
        for pod in [p for p in self._rejected if p not in present]:
            del self._rejected[pod]
        for pod in self._gauged - present:
            self.metrics.profile_rejected.remove(pod)
            self.metrics.profile_distrusted.remove(pod)
        self._gauged &= present


def _transfer_text(m: KVTransferModel) -> str:
    """A KV transfer model for a log line: '2 ms + 20 GB/s'."""
    return f"{m.k0 * 1e3:.3g} ms + {m.bandwidth_bytes_per_s / 1e9:.3g} GB/s"
