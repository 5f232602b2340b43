"""Triton's errors -> OpenAI error objects with the right HTTP status and field."""

from __future__ import annotations

import pytest
from lightspec_backend.openai_api.convert import renamed_fields
from lightspec_backend.openai_api.errors import OpenAIError, from_triton, validation_error
from lightspec_backend.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from pydantic import ValidationError


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


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="lightspec", messages=[{"role": "user", "content": "hi"}], **kw)


def test_chat_names_messages_for_prompt_errors():
    err = from_triton("prompt: 2000 tokens, the context holds 1024", renamed=renamed_fields(chat()))
    assert err.param == "messages" and err.message.startswith("messages: ")


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"max_completion_tokens": 5000}, "max_completion_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({}, "max_tokens"),
    ],
)
def test_engine_length_errors_name_the_length_field_the_chat_request_sent(kw, param):
    err = from_triton(
        "max_tokens=5000: exceeds the model's context length (1024 tokens)", renamed=renamed_fields(chat(**kw))
    )
    assert err.status == 400 and err.param == param and err.message.startswith(f"{param}")


def test_grpc_status_decides_when_the_message_does_not():
    assert from_triton("failed to connect to all addresses", "StatusCode.UNAVAILABLE").status == 503
    assert from_triton("Request for unknown model: 'x' is not found", "StatusCode.NOT_FOUND").status == 404
    assert from_triton("something", "StatusCode.INVALID_ARGUMENT").status == 400


def test_validation_errors_name_the_field_path():
    err = validation_error([{"loc": ("body", "messages", 0, "role"), "msg": "Field required", "type": "missing"}])
    assert err.status == 400 and err.param == "messages.0.role" and err.message == "messages.0.role: Field required"
    unknown = validation_error([{"loc": ("body", "guided_json"), "msg": "Extra inputs", "type": "extra_forbidden"}])
    assert unknown.param == "guided_json" and "unknown field" in unknown.message


def first_error(model, **body) -> list[dict]:
    with pytest.raises(ValidationError) as e:
        model(model="lightspec", **body)
    return [{**err, "loc": ("body", *err["loc"])} for err in e.value.errors()]  # as FastAPI reports them


@pytest.mark.parametrize(
    ("model", "body", "param"),
    [
        (CompletionRequest, {"prompt": 5}, "prompt"),  # not "prompt.str"
        (CompletionRequest, {"prompt": "x", "stop": 5}, "stop"),
        (CompletionRequest, {"prompt": [[1, "a"]]}, "prompt"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": 5}]}]}, "messages.0.content"),
        (ChatCompletionRequest, {"messages": [{"role": "user"}], "tool_choice": 5}, "tool_choice"),
        (CompletionRequest, {"prompt": "x", "logit_bias": {"7": "high"}}, "logit_bias.7"),
    ],
)
def test_validation_errors_name_fields_and_indices_not_union_branches(model, body, param):
    err = validation_error(first_error(model, **body))
    assert err.param == param and err.message.startswith(f"{param}: ")


def test_invalid_json_names_no_field():
    fastapi_error = {"type": "json_invalid", "loc": ("body", 1), "msg": "JSON decode error",
                     "ctx": {"error": "Expecting property name enclosed in double quotes"}}  # fmt: skip
    err = validation_error([fastapi_error])
    assert err.status == 400 and err.param is None
    assert (
        err.message
        == "the request body is not valid JSON (Expecting property name enclosed in double quotes at character 1)"
    )


def test_error_types_follow_openai():
    assert OpenAIError("x", 404).type == "not_found_error"
    assert OpenAIError("x", 500).type == "server_error"


@pytest.mark.parametrize("status", [None, "StatusCode.NOT_FOUND"])
@pytest.mark.parametrize(
    "message",
    [
        "Request for unknown model: 'lightspec' has no available versions",
        "Request for unknown model: 'lightspec' version 1 is not at ready state",
    ],
)
def test_a_model_triton_knows_but_has_not_ready_is_503_not_404(message, status):
    err = from_triton(message, status)
    assert (err.status, err.type, err.code) == (503, "service_unavailable", "unavailable")
    assert "not ready" in err.message


@pytest.mark.parametrize("status", [None, "CANCELLED", "StatusCode.CANCELLED"])
def test_the_servers_drain_cancelling_a_request_is_503_a_clients_cancel_stays_499(status):
    # the orchestrator's message when a drain's grace period ends (shutdown or fault restart)
    drained = from_triton("request cancelled: the server shut down (grace period over)", status)
    assert (drained.status, drained.type, drained.code) == (503, "service_unavailable", "unavailable")
    assert from_triton("request cancelled", status).status == 499
    assert from_triton("Locally cancelled by application!", "StatusCode.CANCELLED").code == "cancelled"
