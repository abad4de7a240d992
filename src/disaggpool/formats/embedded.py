"""The request traces shipped inside the package (`disaggpool.data`), read without a file system.

The package embeds the two Azure LLM inference traces 2023 (conversation and code services) and
the Mooncake conversation trace with its prefix blocks (all gzip-compressed; provenance and
licences in ``src/disaggpool/data/README.md``) so that the experiments and the demo run on a
fresh machine with nothing else present. This module is their only reader: `studies.paper_traces`
(the paper's mixed traces), scenarios (`trace.embedded`), `demo` and the tests take them from
here, by the names of `EMBEDDED_TRACES`. Parsing is `formats.traces.parse_trace` or
`formats.mooncake.parse_mooncake`, the same parsers and checks as for any trace file.
"""

from __future__ import annotations

import gzip
import importlib.resources

from disaggpool.formats.mooncake import parse_mooncake
from disaggpool.formats.traces import TraceRequest, parse_trace

__all__ = [
    "AZURE_2023_FILES",
    "EMBEDDED_TRACES",
    "SERVICE_CLASSES",
    "azure_services",
    "embedded_trace",
    "read_embedded_trace",
]

AZURE_2023_FILES = {"conv": "azure2023_conv.csv.gz", "code": "azure2023_code.csv.gz"}
"""Azure 2023 service name -> embedded resource (a gzip copy of the published CSV)."""

SERVICE_CLASSES = {"chat": "conv", "code": "code"}
"""Our SLO class -> the Azure 2023 service whose requests carry it (see `azure_services`)."""

EMBEDDED_TRACES = {
    "azure-conv": AZURE_2023_FILES["conv"],
    "azure-code": AZURE_2023_FILES["code"],
    "mooncake-conversation": "mooncake_conversation.jsonl.gz",
}
"""The names scenarios and the CLI use -> embedded resource."""

_PACKAGE = "disaggpool.data"


def embedded_trace(name: str, *, default_class: str = "") -> list[TraceRequest]:
    """The embedded trace called `name` (a key of `EMBEDDED_TRACES`); `KeyError` names the
    choices."""
    if name not in EMBEDDED_TRACES:
        raise KeyError(f"no embedded trace {name!r}; choose one of {', '.join(EMBEDDED_TRACES)}")
    return read_embedded_trace(EMBEDDED_TRACES[name], default_class=default_class)


def read_embedded_trace(name: str, *, default_class: str = "") -> list[TraceRequest]:
    """Parse the embedded resource `name` (a gzip CSV trace, or Mooncake JSON lines when it ends
    in ``.jsonl.gz``), sorted by arrival.

    Raises `InputError` (source ``disaggpool.data/NAME``) if it is malformed, `FileNotFoundError`
    if the package has no such resource.
    """
    resource = importlib.resources.files(_PACKAGE).joinpath(name)
    if name.endswith(".jsonl.gz"):
        with resource.open("rb") as raw, gzip.open(raw, "rt", encoding="utf-8") as text:
            return parse_mooncake(text, f"{_PACKAGE}/{name}", default_class=default_class)
    # utf-8-sig and newline="" as `read_trace` opens files, so both read the same bytes alike.
    with (
        resource.open("rb") as raw,
        gzip.open(raw, "rt", encoding="utf-8-sig", newline="") as text,
    ):
        return parse_trace(text, f"{_PACKAGE}/{name}", default_class=default_class)


def azure_services() -> dict[str, list[TraceRequest]]:
    """The embedded Azure 2023 traces keyed by our SLO class, every request labelled with it.

    ``chat``: the conversation service (19,366 requests); ``code``: the code service (8,819).
    Arrivals are seconds from each trace's first request (both cover the same hour).
    """
    return {
        slo_class: read_embedded_trace(AZURE_2023_FILES[service], default_class=slo_class)
        for slo_class, service in SERVICE_CLASSES.items()
    }
