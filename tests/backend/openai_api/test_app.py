"""The app's HTTP answers that need no Triton: validation errors before a request is sent, and
503 while no server listens at the Triton address (a free port nothing is bound to)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient
from lightspec_backend.install import BACKEND_NAME
from lightspec_backend.launcher import free_ports
from lightspec_backend.openai_api import create_app
from tritonclient.utils import InferenceServerException


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(f"127.0.0.1:{free_ports(1)[0]}")) as c:
        yield c


def error(r, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    return body


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"model": "lightspec", "prompt": "x", "temperature": -1}, "temperature"),
        ("/v1/completions", {"model": "lightspec", "prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"model": "lightspec", "prompt": []}, "prompt"),
        ("/v1/completions", {"model": "lightspec", "prompt": "x", "best_of": 2}, "best_of"),
        ("/v1/completions", {"model": "lightspec", "prompt": "x", "guided_regex": "a+"}, "guided_regex"),
        ("/v1/completions", {"prompt": "x"}, "model"),
        ("/v1/completions", {"model": "lightspec", "prompt": "x", "max_tokens": "many"}, "max_tokens"),
        ("/v1/chat/completions", {"model": "lightspec", "messages": []}, "messages"),
        (
            "/v1/chat/completions",
            {"model": "lightspec", "messages": [{"role": "user", "content": "x"}], "logprobs": True},
            "logprobs",
        ),
        (
            "/v1/chat/completions",
            {"model": "lightspec", "messages": [{"role": "user", "content": "x"}], "top_p": 2},
            "top_p",
        ),
    ],
)
def test_bad_requests_are_400_naming_the_field_before_triton_is_asked(client, path, body, param):
    err = error(client.post(path, json=body), 400)
    assert err["type"] == "invalid_request_error" and err["param"] == param and param in err["message"]


def test_no_triton_is_503(client):
    assert "unavailable" in error(client.get("/v1/models"), 503)["message"]
    error(client.get("/health"), 503)
    error(client.post("/v1/completions", json={"model": "lightspec", "prompt": "x"}), 503)


def test_invalid_json_is_400_naming_no_field(client):
    r = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    err = error(r, 400)
    assert err["param"] is None and err["message"].startswith("the request body is not valid JSON")


@pytest.fixture
def engine_refusing_length(tmp_path):
    """An app whose Triton serves a model with a chat template and answers every request with the
    engine's error for a length beyond the context; ``.sent`` holds the requests' tensors."""
    from lightspec_backend.openai_api.errors import from_triton
    from lightspec_backend.openai_api.triton import ServedModel

    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": "{{ bos_token }}{{ messages[0].content }}"}')
    app, sent = create_app("127.0.0.1:1"), []

    async def find(name):
        return ServedModel("lightspec", tmp_path)

    async def generate(model, tensors, renamed=None):
        sent.append(tensors)
        raise from_triton("max_tokens=5000: exceeds the model's context length (1024 tokens)", None, renamed)
        yield  # an async generator, as Triton.generate

    app.state.triton.find, app.state.triton.generate = find, generate
    with TestClient(app) as c:
        c.sent = sent
        yield c


@pytest.mark.parametrize("length", ["max_tokens", "max_completion_tokens"])
def test_an_engine_length_error_names_the_field_the_chat_request_sent(engine_refusing_length, length):
    body = {"model": "lightspec", "messages": [{"role": "user", "content": "x"}], length: 5000}
    err = error(engine_refusing_length.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == length and err["message"].startswith(f"{length}")


def test_chat_template_kwargs_are_template_variables_and_request_fields_a_400(engine_refusing_length):
    body = {"model": "lightspec", "messages": [{"role": "user", "content": "x"}]}
    bos = {**body, "chat_template_kwargs": {"bos_token": "<B>"}}
    engine_refusing_length.post("/v1/chat/completions", json=bos)
    assert engine_refusing_length.sent[-1]["text_input"] == "<B>x"
    body["chat_template_kwargs"] = {"add_generation_prompt": False}
    err = error(engine_refusing_length.post("/v1/chat/completions", json=body), 400)
    assert err["param"] == "chat_template_kwargs.add_generation_prompt"


def test_the_prompt_reaches_triton_with_add_special_tokens_true_for_completions_false_for_chat(
    engine_refusing_length,
):
    client, sent = engine_refusing_length, engine_refusing_length.sent
    chat = {"model": "lightspec", "messages": [{"role": "user", "content": "x"}]}
    for body, path, want in [
        ({"model": "lightspec", "prompt": "x"}, "/v1/completions", True),
        ({"model": "lightspec", "prompt": "x", "add_special_tokens": False}, "/v1/completions", False),
        (chat, "/v1/chat/completions", False),
        ({**chat, "add_special_tokens": True}, "/v1/chat/completions", True),
    ]:
        client.post(path, json=body)
        assert sent[-1]["add_special_tokens"] is want, (path, body)


@pytest.mark.parametrize("stream", [False, True])
def test_a_choice_refused_ends_the_answer_with_its_error_and_closes_every_choices_stream(tmp_path, stream):
    """n=3: the choice with seed 2 is refused while the others still generate; the answer is its
    400, and the other choices' Triton streams are closed (their requests cancelled), not left open."""
    import asyncio

    from lightspec_backend.openai_api.errors import from_triton
    from lightspec_backend.openai_api.triton import Chunk, ServedModel

    app, closed = create_app("127.0.0.1:1"), []

    async def find(name):
        return ServedModel("lightspec", tmp_path)

    async def generate(model, tensors, renamed=None):
        try:
            if tensors["seed"] == 2:
                await asyncio.sleep(0.05)
                raise from_triton("top_k=7: refused by the test", None, renamed)
            while True:  # generates until its stream is closed
                yield Chunk("a", "", 3, 1, 0, 0, [])
                await asyncio.sleep(0.01)
        finally:
            closed.append(tensors["seed"])

    app.state.triton.find, app.state.triton.generate = find, generate
    body = {"model": "lightspec", "prompt": "x", "n": 3, "seed": 0, "stream": stream}
    with TestClient(app) as client:
        err = error(client.post("/v1/completions", json=body), 400)
    assert err["param"] == "top_k" and sorted(closed) == [0, 1, 2]


def test_a_port_in_use_fails_start_naming_the_port_and_the_way_out():
    import socket

    from lightspec_backend.openai_api.command import OpenAIServer

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=rf"did not start on 127\.0\.0\.1:{port} .*--openai-port 0"):
            OpenAIServer("127.0.0.1:1", port=port, log_level="critical").start(timeout_s=10)


class FakeTritonClient:
    """tritonclient's aio gRPC client as ``Triton`` uses it: a repository index whose models'
    states a test sets (``state``: name -> READY, LOADING, ...; a name absent is unknown to Triton),
    the configs of LightSpec orchestrators, and a stream that fails with ``stream_error``."""

    def __init__(self):
        self.state: dict[str, str] = {}
        self.stream_error = ""

    async def get_model_repository_index(self, as_json=False, client_timeout=None):
        models = [SimpleNamespace(name=n, version="1", state=s, reason="") for n, s in self.state.items()]
        return SimpleNamespace(models=models)

    async def get_model_config(self, name, version="", client_timeout=None):
        assert self.state.get(name) == "READY", "Triton gives no config for a model that is not ready"
        return SimpleNamespace(config=SimpleNamespace(backend=BACKEND_NAME, parameters={}))

    def stream_infer(self, requests):
        error = InferenceServerException(self.stream_error)

        class Responses:
            async def __aiter__(self):
                yield None, error

            def cancel(self):
                pass

        return Responses()

    async def close(self):
        pass


@pytest.fixture
def fake_triton(tmp_path, monkeypatch):
    """An app over a ``FakeTritonClient`` (``.triton``) that lists the index afresh on every look-up."""
    from lightspec_backend.openai_api import triton

    monkeypatch.setattr(triton, "_LIST_TTL_S", -1.0)
    app = create_app("127.0.0.1:1", model_dir=tmp_path)
    app.state.triton._client = fake = FakeTritonClient()
    with TestClient(app) as c:
        c.triton = fake
        yield c


def test_a_model_loading_or_gone_after_serving_is_503_and_only_a_name_triton_lacks_404(fake_triton):
    client, triton = fake_triton, fake_triton.triton
    completion = {"model": "lightspec", "prompt": "x", "max_tokens": 4}
    for state in ["LOADING", "UNAVAILABLE", ""]:  # a restart's load, its unload, and no state yet
        triton.state = {"lightspec": state}
        for r in (client.post("/v1/completions", json=completion), client.get("/v1/models/lightspec")):
            err = error(r, 503)
            assert err["type"] == "service_unavailable" and err["code"] == "unavailable", state
            assert "lightspec" in err["message"] and "not ready" in err["message"]
    unknown = {**completion, "model": "gpt-4"}
    assert error(client.post("/v1/completions", json=unknown), 404)["code"] == "model_not_found"
    triton.state = {"lightspec": "READY"}
    assert client.get("/v1/models/lightspec").json()["id"] == "lightspec"
    triton.state = {}  # served before, gone from the index (a reload under way): still not a 404
    assert error(client.get("/v1/models/lightspec"), 503)["code"] == "unavailable"
    assert error(client.get("/v1/models/gpt-4"), 404)["code"] == "model_not_found"


@pytest.mark.parametrize(
    "message",
    [
        "Request for unknown model: 'lightspec' is not found",  # unloaded between the look-up and the request
        "Request for unknown model: 'lightspec' has no available versions",
        "request cancelled: the server shut down (grace period over)",
    ],
)
def test_a_served_model_failing_a_request_as_unloaded_or_drained_is_503(fake_triton, message):
    fake_triton.triton.state, fake_triton.triton.stream_error = {"lightspec": "READY"}, message
    for stream in (False, True):
        body = {"model": "lightspec", "prompt": "x", "stream": stream}
        assert error(fake_triton.post("/v1/completions", json=body), 503)["code"] == "unavailable"
