"""OpenAI error objects and the mapping of Triton's errors onto them.

The body is OpenAI's: ``{"error": {"message", "type", "param", "code"}}``. A Triton error reaches a
gRPC stream as its message alone (the stream's error responses carry no status code), so the
mapping reads the message: LightSpec's ``INVALID_ARG`` messages start with the tensor's name
(:mod:`lightspec_backend.inputs`), which becomes the OpenAI field it came from.
"""

from __future__ import annotations

import re

from ..tensors import INPUT_SPECS

# tensor -> the OpenAI request field it is filled from
TENSOR_TO_FIELD = {
    "text_input": "prompt",
    "input_ids": "prompt",
    "stop_words": "stop",
    "max_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "ignore_eos": "ignore_eos",
    "num_draft_tokens": "num_draft_tokens",
    "priority": "priority",
}
_TYPES = {400: "invalid_request_error", 404: "not_found_error", 499: "cancelled", 503: "service_unavailable"}
_UNAVAILABLE = ("shutting down", "unloaded", "failed to connect", "unavailable", "connection refused", "not ready")
# Triton's "Request for unknown model" for a model in its repository that is loading or unloaded: a
# restart's window, which a client should retry, unlike a name Triton does not know ("is not found")
_NOT_READY = ("has no available versions", "is not at ready state")
# a cancellation the server made (a drain's grace period over, on shutdown or a fault restart), not
# the client: 503 tells the client to retry where 499 would blame it
_SERVER_CANCELLED = ("server shut down", "grace period")


class OpenAIError(Exception):
    """An error the API answers with ``status`` and an OpenAI error object."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def _leading_tensor(message: str) -> str | None:
    m = re.match(r"\s*([a-z_]+)\s*(?:[=:\[])", message)
    return m.group(1) if m and (m.group(1) in INPUT_SPECS or m.group(1) in ("prompt", "stop")) else None


def field_of(tensor: str, renamed: dict[str, str] | None = None) -> str:
    """The OpenAI request field that ``tensor`` (or a ``SamplingParams`` name) is filled from, as
    the client named it: ``renamed`` maps a field's usual name to the one the request used
    (chat's ``messages`` for ``prompt``, ``max_completion_tokens`` for ``max_tokens``)."""
    field = TENSOR_TO_FIELD.get(tensor, tensor)
    return (renamed or {}).get(field, field)


def from_triton(message: str, status: str | None = None, renamed: dict[str, str] | None = None) -> OpenAIError:
    """The OpenAI error for a Triton error ``message`` (``status``: the gRPC status name, when the
    error ended the call rather than arriving as a stream response; ``renamed``: the request's
    field names, see :func:`field_of`)."""
    status = (status or "").upper()
    lowered = message.lower()
    tensor = _leading_tensor(message)
    if tensor is not None or "INVALID_ARG" in status:
        field = field_of(tensor, renamed) if tensor is not None else None
        if tensor is not None and field != tensor:
            message = f"{field}: {message}"  # the client knows its field, not the tensor
        return OpenAIError(message, 400, param=field)
    if "UNAVAILABLE" in status or any(s in lowered for s in _UNAVAILABLE):
        return OpenAIError(f"the inference server is unavailable: {message}", 503, code="unavailable")
    if any(s in lowered for s in _NOT_READY):
        return model_not_ready(message)
    if "NOT_FOUND" in status or "unknown model" in lowered:
        return OpenAIError(message, 404, param="model", code="model_not_found")
    if "CANCELLED" in status or "cancelled" in lowered:
        if any(s in lowered for s in _SERVER_CANCELLED):
            return OpenAIError(f"the inference server is unavailable: {message}", 503, code="unavailable")
        return OpenAIError(message, 499, code="cancelled")
    return OpenAIError(f"the inference server failed the request: {message}", 500, code="internal_error")


def model_not_ready(detail: str) -> OpenAIError:
    """The 503 for a model Triton has but cannot run yet (loading, restarting, unloaded)."""
    return OpenAIError(f"the model is not ready (loading or restarting), retry: {detail}", 503, code="unavailable")


def _is_union_branch(part: str) -> bool:
    # pydantic names the member of a union it tried (``str``, ``list[int]``, ``function-after[...]``);
    # a field name never has brackets
    return part in ("str", "int", "float", "bool", "bytes", "none") or re.fullmatch(r"[a-z-]+\[.*\]", part) is not None


def validation_error(errors: list[dict]) -> OpenAIError:
    """A 400 for pydantic's first validation error, naming the field as a dotted path of field
    names and list indices."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = tuple(err.get("loc", ()))
    if err.get("type") == "json_invalid":  # FastAPI's: loc is ("body", character position)
        detail = (err.get("ctx") or {}).get("error", err.get("msg", ""))
        at = f" at character {loc[-1]}" if loc and isinstance(loc[-1], int) else ""
        return OpenAIError(f"the request body is not valid JSON ({detail}{at})", 400)
    loc = loc[1:] if loc[:1] == ("body",) else loc
    param = ".".join(str(p) for p in loc if not (isinstance(p, str) and _is_union_branch(p))) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the OpenAI API, or not supported by LightSpec)"
    return OpenAIError(f"{param}: {msg}" if param else msg, 400, param=param)
