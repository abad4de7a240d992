"""The request traces shipped inside the package (`disaggpool.data`), read without a file system.

The package embeds the two Azure LLM inference traces 2023 (conversation and code services,
gzip-compressed; provenance and licence in ``src/disaggpool/data/README.md``) so that the paper
experiment and the demo run on a fresh machine with nothing else present. This module is their
only reader: `sim.paper_traces` (the paper's mixed traces), `demo` and the tests take them from
here. Parsing is `formats.traces.parse_trace`, the same parser and checks as any trace file.
"""

from __future__ import annotations

import gzip
import importlib.resources

from disaggpool.formats.traces import TraceRequest, parse_trace

__all__ = ["AZURE_2023_FILES", "SERVICE_CLASSES", "azure_services", "read_embedded_trace"]

AZURE_2023_FILES = {"conv": "azure2023_conv.csv.gz", "code": "azure2023_code.csv.gz"}
"""Azure 2023 service name -> embedded resource (a gzip copy of the published CSV)."""

SERVICE_CLASSES = {"chat": "conv", "code": "code"}
"""Our SLO class -> the Azure 2023 service whose requests carry it (see `azure_services`)."""

_PACKAGE = "disaggpool.data"


def read_embedded_trace(name: str, *, default_class: str = "") -> list[TraceRequest]:
    """Parse the embedded resource `name` (a gzip CSV trace), sorted by arrival.

    Raises `InputError` (source ``disaggpool.data/NAME``) if it is malformed, `FileNotFoundError`
    if the package has no such resource.
    """
    resource = importlib.resources.files(_PACKAGE).joinpath(name)
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
