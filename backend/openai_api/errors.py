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


def from_triton(message: str, status: str | None = None, prompt_field: str = "prompt") -> OpenAIError:
    """The OpenAI error for a Triton error ``message`` (``status``: the gRPC status name, when the
    error ended the call rather than arriving as a stream response; ``prompt_field``: the request
    field the prompt came from, ``messages`` for chat)."""
    status = (status or "").upper()
    lowered = message.lower()
    tensor = _leading_tensor(message)
    if tensor is not None or "INVALID_ARG" in status:
        field = TENSOR_TO_FIELD.get(tensor or "", tensor)
        field = prompt_field if field == "prompt" else field
        if tensor is not None and field != tensor:
            message = f"{field}: {message}"  # the client knows its field, not the tensor
        return OpenAIError(message, 400, param=field)
    if "UNAVAILABLE" in status or any(s in lowered for s in _UNAVAILABLE):
        return OpenAIError(f"the inference server is unavailable: {message}", 503, code="unavailable")
    if "NOT_FOUND" in status or "unknown model" in lowered:
        return OpenAIError(message, 404, param="model", code="model_not_found")
    if "CANCELLED" in status or "cancelled" in lowered:
        return OpenAIError(message, 499, code="cancelled")
    return OpenAIError(f"the inference server failed the request: {message}", 500, code="internal_error")


def validation_error(errors: list[dict]) -> OpenAIError:
    """A 400 for pydantic's first validation error, naming the field as a dotted path."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in err.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = err.get("msg", "invalid value")
    if err.get("type") == "extra_forbidden":
        msg = "unknown field (not part of the OpenAI API, or not supported by LightSpec)"
    return OpenAIError(f"{param}: {msg}" if param else msg, 400, param=param)
