"""A local pool's pods calibrated as the operator's Job calibrates them: `disaggpool calibrate`.

Each pod is probed over HTTP in turn, a decode pod with the first prefill pod as its KV peer (the
probe then measures the transfer into it), and its fitted profile written to
``<out_dir>/<pod>.yaml``, the directory a sidecar reads profiles from. A poor fit (exit 3: the
machine was busy while it probed) is probed again, up to the operator's default number of
attempts (`calibration.reprobeOnPoor`, `maxAttempts`), and the last one is kept, as the operator
keeps it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path

from disaggpool.core.profile import CalibrationProfile
from disaggpool.formats.profiles import load_profile
from disaggpool.localpool.processes import child_env, disaggpool_command, stderr_messages
from disaggpool.operator.spec import DEFAULT_MAX_PROBE_ATTEMPTS

__all__ = ["PROBE_ATTEMPTS", "calibrate_pods"]

PROBE_ATTEMPTS = DEFAULT_MAX_PROBE_ATTEMPTS


def _quiet(_: str) -> None:
    pass


def calibrate_pods(
    urls: Mapping[str, str],
    roles: Mapping[str, str],
    out_dir: Path,
    *,
    budget_s: float,
    max_num_seqs: int,
    say: Callable[[str], None] = _quiet,
) -> dict[str, CalibrationProfile]:
    """Probe every pod of `urls` (pod -> URL; `roles`: pod -> prefill or decode) for `budget_s`
    seconds each: pod -> fitted profile. `say` hears what the probe concluded, one line a pod
    (and a line per repeated probe). `RuntimeError` when a probe fails outright."""
    out_dir.mkdir(exist_ok=True)
    prefill_url = next(urls[n] for n, role in roles.items() if role == "prefill")
    for name, role in roles.items():
        say(f"calibrating {name} ({role}, {budget_s:.0f} s probe)")
        cmd = disaggpool_command(
            "calibrate", "--endpoint", urls[name], "--role", role, "--name", name,
            "--out", str(out_dir / f"{name}.yaml"), "--budget-seconds", str(budget_s),
            "--max-num-seqs", str(max_num_seqs),
        )  # fmt: skip
        if role == "decode":
            cmd += ["--peer", prefill_url]
        for attempt in range(1, PROBE_ATTEMPTS + 1):
            done = subprocess.run(cmd, env=child_env(), capture_output=True, text=True, check=False)
            said = stderr_messages(done.stderr)
            if done.returncode not in (0, 3):
                detail = "\n".join(said[-10:]) or done.stderr[-2000:]
                raise RuntimeError(f"calibrating {name} failed (exit {done.returncode}):\n{detail}")
            say("  " + (said or ["?"])[-1])
            if done.returncode == 0 or attempt == PROBE_ATTEMPTS:
                break
            say(f"  {name}: the fit is poor, probing again ({attempt + 1} of {PROBE_ATTEMPTS})")
    return {name: load_profile(out_dir / f"{name}.yaml") for name in roles}
