"""A zero or absurd calibration profile (a profile file that parses, says `quality: good`, and
whose coefficients are zero or physically impossible): the pod is scored as a pod without a
trusted profile, the refusal is counted, and every request is answered (never a 500)."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from emulator_testkit import eventually
from faultkit import Accounting, Kit, metric, pod, post_json, sidecar_doc
from sidecar_testkit import A40

from disaggpool.core.profile import profile_to_dict


def broken(**sections: dict[str, float]) -> dict[str, Any]:
    doc = copy.deepcopy(profile_to_dict(A40))
    for key, values in sections.items():
        doc[key].update(values)
    return doc


ZERO = broken(
    prefill={"p0": 0, "p1": 0, "p2": 0}, decode={"d0": 0, "d1": 0, "d2": 0}, kv_transfer={"k0": 0}
)
# A decode step of a nanosecond and a prefill of a picosecond per token: no engine is that fast.
ABSURD = broken(prefill={"p0": 1e-12, "p1": 1e-12, "p2": 0}, decode={"d0": 1e-9, "d1": 0, "d2": 0})


@pytest.mark.parametrize(
    ("bad", "both"),
    [(ZERO, True), (ZERO, False), (ABSURD, False)],
    ids=["zero-both-decode-pods", "zero-one-decode-pod", "absurd"],
)
def test_a_zero_or_absurd_profile_leaves_the_pod_untrusted_and_requests_answered(
    kit: Kit, bad: dict[str, Any], both: bool
) -> None:
    p0, d0, d1 = kit.emulator(), kit.emulator(), kit.emulator()
    profiles = kit.profiles(p0=A40, d0=bad, d1=bad if both else A40)
    sc = kit.sidecar(
        sidecar_doc(
            [pod("p0", p0.url)],
            [pod("d0", d0.url), pod("d1", d1.url)],
            policy="calibrated",
            profiles={"dir": profiles},
        )
    )

    def loaded() -> None:  # the directory is read in one pass: p0's is in, d0's was judged
        assert metric(sc.url, "disaggpool_profile_trusted", pod="p0") == 1

    eventually(loaded, timeout=5.0)
    books = Accounting(sc.url)
    for i in range(6):
        status, _, raw = post_json(f"{sc.url}/v1/completions", {"prompt": f"z{i}", "max_tokens": 3})
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 3
    assert metric(sc.url, "disaggpool_profile_trusted", pod="d0") == 0
    assert metric(sc.url, "disaggpool_profile_trusted", pod="d1") == (0 if both else 1)
    assert metric(sc.url, "disaggpool_profile_rejected", pod="d0") == 1
    assert metric(sc.url, "disaggpool_route_fallbacks_total") >= 1
    books.settle(sent=6, admitted=6)
