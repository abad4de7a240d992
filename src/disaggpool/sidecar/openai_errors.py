"""Error answers in the OpenAI shape, and what each refusal of the routing service becomes.

The front door's and its legs' one way to say no: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status (vLLM's own shape, which OpenAI clients parse), and the mapping of
`service.ServiceError`s: `Overloaded` 429 with Retry-After, `NoCapacity` 503 with Retry-After,
`Duplicate` 409, anything else 400 naming the field. `error_body` and `refusal` give the same
answers as bytes and parts, for the endpoint picker, which answers through Envoy (`sidecar.epp`).
"""

from __future__ import annotations

import json

from aiohttp import web

from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.service import Duplicate, NoCapacity, Overloaded, ServiceError

__all__ = ["Refusal", "error_body", "openai_error", "refusal", "refused"]

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestEntityTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def _error(status: int, message: str, param: str | None) -> dict[str, object]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """The JSON body of `openai_error`."""
    return json.dumps(_error(status, message, param)).encode()


def openai_error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(_error(status, message, param), status=status, headers=headers)


Refusal = tuple[int, str, str | None, dict[str, str]]  # status, message, param, headers


def refusal(exc: ServiceError, metrics: SidecarMetrics) -> Refusal:
    """What a request the routing service refused is answered (status, message, param,
    headers); a bad request is counted here (the service counts the others)."""
    if isinstance(exc, Overloaded):
        return 429, str(exc), None, {"Retry-After": "1"}
    if isinstance(exc, NoCapacity):
        return 503, str(exc), None, {"Retry-After": "5"}
    if isinstance(exc, Duplicate):
        return 409, f"{exc.field}: {exc}", exc.field, {}
    metrics.rejected.labels("bad_request").inc()
    return 400, f"{exc.field}: {exc}", exc.field or None, {}


def refused(exc: ServiceError, metrics: SidecarMetrics) -> web.Response:
    """The answer to a request the routing service refused."""
    status, message, param, headers = refusal(exc, metrics)
    return openai_error(status, message, param, headers or None)
