"""Error answers in the OpenAI shape, and what each refusal of the routing service becomes.

The front door's and its legs' one way to say no: ``{"error": {"message", "type", "param",
"code"}}`` with the HTTP status (vLLM's own shape, which OpenAI clients parse), and the mapping of
`service.ServiceError`s: `Overloaded` 429 with Retry-After, `NoCapacity` 503 with Retry-After,
`Duplicate` 409, anything else 400 naming the field.
"""

from __future__ import annotations

from aiohttp import web

from disaggpool.sidecar.metrics import SidecarMetrics
from disaggpool.sidecar.service import Duplicate, NoCapacity, Overloaded, ServiceError

__all__ = ["openai_error", "refused"]

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


def openai_error(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "Error"),
            "param": param,
            "code": status,
        }
    }
    return web.json_response(body, status=status, headers=headers)


def refused(exc: ServiceError, metrics: SidecarMetrics) -> web.Response:
    """The answer to a request the routing service refused."""
    if isinstance(exc, Overloaded):
        return openai_error(429, str(exc), headers={"Retry-After": "1"})
    if isinstance(exc, NoCapacity):
        return openai_error(503, str(exc), headers={"Retry-After": "5"})
    if isinstance(exc, Duplicate):
        return openai_error(409, f"{exc.field}: {exc}", exc.field)
    metrics.rejected.labels("bad_request").inc()
    return openai_error(400, f"{exc.field}: {exc}", exc.field or None)
