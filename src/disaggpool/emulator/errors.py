"""vLLM's error bodies: `ApiError` and the three shapes a 400 takes, byte for byte.

Every refusal leaves as ``{"error": {message, type, param, code}}`` (`error_body`). Three kinds
of 400 exist in vLLM, and each is copied with its own shape (checked against the wire
recording of real vLLM in `tests/realvllm/fixtures/vllm_0.32.0_wire.json`):

* request-schema (pydantic) errors (`schema_error`): a malformed JSON body, a field of the
  wrong type or a missing one. Type ``"Bad Request"``, param ``body.<field>`` (``body.<offset>``
  for JSON syntax), message ``1 validation error:\\n  {<pydantic error dict>}``;
* `VLLMValidationError` (`vllm_error`): type ``BadRequestError``, param the parameter, message
  suffixed ``(parameter=..., value=...)`` (stream options without streaming, context length,
  max_tokens);
* plain `ValueError` from the sampling parameters (`value_error`): type ``BadRequestError``,
  param null (min_tokens, temperature, top_p, out-of-vocabulary token ids).

An unknown model is a 404 ``NotFoundError``, a full queue a 503. `requests` raises these while
validating, `instance` raises the 503 and the 400 of a prompt that cannot fit, and `server`
writes `ApiError.body()` (and `error_body` for failures after a stream started).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SCHEMA_ERROR",
    "ApiError",
    "error_body",
    "schema_error",
    "value_error",
    "vllm_error",
]

_ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
SCHEMA_ERROR = "Bad Request"  # FastAPI request-validation errors: HTTPStatus.BAD_REQUEST.phrase


def error_body(
    status: int, message: str, param: str | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """vLLM's error object; the type defaults to the one vLLM reports for `status`."""
    return {
        "error": {
            "message": message,
            "type": err_type or _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": status,
        }
    }


class ApiError(Exception):
    """A request vLLM would refuse, with the HTTP status, type and `param` it would report."""

    def __init__(
        self, status: int, message: str, param: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.err_type = err_type

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.err_type)


_NO_VALUE = object()


def vllm_error(message: str, parameter: str, value: Any = _NO_VALUE) -> ApiError:
    """A `VLLMValidationError`: its str() appends the parameter and the rejected value."""
    extras = [f"parameter={parameter}"]
    if value is not _NO_VALUE and value is not None:
        extras.append(f"value={value}")
    return ApiError(400, f"{message} ({', '.join(extras)})", parameter)


def value_error(message: str) -> ApiError:
    """A plain ValueError from the sampling parameters: no param."""
    return ApiError(400, message, None)


def _summary(value: Any) -> Any:
    """A rejected input as vLLM's validation message shows it (containers summarised)."""
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    if isinstance(value, str) and len(value) > 50:
        return value[:47] + "..."
    return value


def schema_error(loc: str, kind: str, msg: str, value: Any, **ctx: str) -> ApiError:
    """A FastAPI/pydantic request-validation error for `body.<loc>`."""
    detail: dict[str, Any] = {
        "type": kind,
        "loc": f"body.{loc}" if loc else "body",
        "msg": msg,
        "input": _summary(value),
    }
    if ctx:
        detail["ctx"] = dict(ctx)
    return ApiError(
        400, f"1 validation error:\n  {detail!r}", str(detail["loc"]), err_type=SCHEMA_ERROR
    )
