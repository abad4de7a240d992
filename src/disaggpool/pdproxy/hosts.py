"""The ``x-prefiller-host-port`` header: which prefill pods a gateway named for a request.

llm-d's contract: a comma-separated list of ``host:port`` (IPv6 hosts in brackets), tried first
entry first. An absent or empty header means no remote prefill. Anything else that is not a list
of well-formed entries is refused (`BadHeader`, a 400 naming the header): a proxy that guessed
would send the prompt somewhere nobody meant. At most `MAX_HOSTS` entries, so that one request
cannot make the proxy try a long list of hosts.
"""

from __future__ import annotations

import ipaddress
import re

from disaggpool.pdwire import PREFILLER_HEADER

__all__ = ["MAX_HOSTS", "PREFILLER_HEADER", "BadHeader", "prefill_hosts"]

MAX_HOSTS = 8

# A DNS name or an IPv4 address: letters, digits, dots and hyphens, no empty label.
_NAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                   r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")  # fmt: skip


class BadHeader(ValueError):
    """The header's value is not a list of ``host:port``; the message says which entry."""


def prefill_hosts(values: list[str]) -> list[str]:
    """The ``host:port`` entries of every copy of the header, in order; [] when none is given.
    Several copies of the header are read as one list, as HTTP joins repeated fields."""
    text = ",".join(v.strip() for v in values if v.strip())
    if not text:
        return []
    entries = [e.strip() for e in text.split(",")]
    if len(entries) > MAX_HOSTS:
        raise BadHeader(f"{len(entries)} entries, at most {MAX_HOSTS}")
    for entry in entries:
        _check(entry)
    return entries


def _check(entry: str) -> None:
    if not entry:
        raise BadHeader("an empty entry (two commas in a row, or one at an end)")
    host, sep, port = entry.rpartition(":")
    if not sep or not host:
        raise BadHeader(f"{entry[:100]!r} is not HOST:PORT")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise BadHeader(f"{entry[:100]!r}: the port must be 1-65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            raise BadHeader(f"{entry[:100]!r}: not an IPv6 address in brackets") from None
    elif not _NAME.match(host):
        raise BadHeader(f"{entry[:100]!r}: the host must be a DNS name, IPv4, or [IPv6]")
