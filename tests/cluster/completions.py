"""One OpenAI completion sent to a pod on the test node: what the tests ask a router or engine."""

from __future__ import annotations

import json
import urllib.request
from typing import Any


def complete(
    ip: str, model: str, prompt: str, tokens: int, timeout: float = 60, api_key: str = ""
) -> dict[str, Any]:
    """POST /v1/completions to `ip`:8000 for exactly `tokens` tokens (with `api_key` as a Bearer
    token); the parsed answer."""
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True}
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(
        f"http://{ip}:8000/v1/completions", json.dumps(body).encode(), headers, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return dict(json.loads(resp.read()))
