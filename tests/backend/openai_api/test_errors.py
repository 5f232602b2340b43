"""Triton's errors -> OpenAI error objects with the right HTTP status and field."""

from __future__ import annotations

import pytest
from lightspec_backend.openai_api.errors import OpenAIError, from_triton, validation_error


@pytest.mark.parametrize(
    ("message", "status", "param"),
    [
        ("max_tokens=5000: exceeds the model's context length (1024 tokens)", 400, "max_tokens"),
        ("text_input: the prompt is empty", 400, "prompt"),
        ("input_ids: token id 99999 is outside the vocabulary [0, 4096)", 400, "prompt"),
        ("prompt: 2000 tokens, the context holds 1024", 400, "prompt"),
        ("stop_words=['']: stop strings must be non-empty", 400, "stop"),
        ("temperature=-1.0: must be >= 0", 400, "temperature"),
        ("the model is shutting down", 503, None),
        ("the model was unloaded before the request finished", 503, None),
        ("request cancelled", 499, None),
        ("engine step failed: boom", 500, None),
    ],
)
def test_lightspec_error_messages_map_to_status_and_field(message, status, param):
    err = from_triton(message)
    assert (err.status, err.param) == (status, param)
    body = err.body()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    if status == 400:
        assert body["type"] == "invalid_request_error" and body["message"].startswith(param)


def test_chat_names_messages_for_prompt_errors():
    err = from_triton("prompt: 2000 tokens, the context holds 1024", prompt_field="messages")
    assert err.param == "messages" and err.message.startswith("messages: ")


def test_grpc_status_decides_when_the_message_does_not():
    assert from_triton("failed to connect to all addresses", "StatusCode.UNAVAILABLE").status == 503
    assert from_triton("Request for unknown model: 'x' is not found", "StatusCode.NOT_FOUND").status == 404
    assert from_triton("something", "StatusCode.INVALID_ARGUMENT").status == 400


def test_validation_errors_name_the_field_path():
    err = validation_error([{"loc": ("body", "messages", 0, "role"), "msg": "Field required", "type": "missing"}])
    assert err.status == 400 and err.param == "messages.0.role" and err.message == "messages.0.role: Field required"
    unknown = validation_error([{"loc": ("body", "guided_json"), "msg": "Extra inputs", "type": "extra_forbidden"}])
    assert unknown.param == "guided_json" and "unknown field" in unknown.message


def test_error_types_follow_openai():
    assert OpenAIError("x", 404).type == "not_found_error"
    assert OpenAIError("x", 500).type == "server_error"
