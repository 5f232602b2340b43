"""``stages: local`` and ``process``: the orchestrator runs its stages in its own process, or its
engine with them in a child process. The repository has no stage models, the server answers with
plain greedy decoding's text for MTP and draft-model speculation, the metrics still count the drafts
it verified, and a request the engine cannot take is refused naming the field."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from lightspec_backend.launcher import TritonServer
from lightspec_backend.metrics import exported_name
from lightspec_backend.repository import write_model_repository

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from tests.e2e.test_triton_server import grpc_generate, stop_cleanly, texts, wait_for

PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(root):", "class Stack:\n    def push(self, x):"]
OVERRIDES = {"num_kv_blocks": "128", "block_size": "16", "policy": "static:3"}


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(EngineConfig(speculation="none", num_kv_blocks=128, block_size=16))
    yield {p: engine.generate([p], SamplingParams(max_tokens=40))[0].text for p in PROMPTS}
    engine.close()


@pytest.fixture(scope="module", params=[("local", "mtp"), ("local", "draft"), ("process", "mtp")])
def server(request, tmp_path_factory):
    stages, speculation = request.param
    root = tmp_path_factory.mktemp(f"{stages}-{speculation}")
    repo = write_model_repository(root / "repo", {**OVERRIDES, "stages": stages, "speculation": speculation})
    srv = TritonServer(repo, cache_dir=root / "cache", model_control_mode="explicit", load_models=["lightspec"])
    srv.start(timeout_s=600)
    yield srv
    stop_cleanly(srv)


@pytest.mark.triton
def test_concurrent_greedy_streams_equal_decoding_without_speculation(server, reference):
    """Three streams at once, so that steps batch them, drafts verified in the orchestrator's process."""
    got: dict[str, str] = {}
    errors: list = []

    def run(prompt: str) -> None:
        results, err = grpc_generate(server.grpc_url, text_input=prompt, max_tokens=40, stream=True,
                                     exclude_input_in_output=True)  # fmt: skip
        errors.append(err) if err is not None else got.update({prompt: "".join(texts(results))})

    threads = [threading.Thread(target=run, args=(p,)) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and got == reference
    name = exported_name("spec_decode_num_draft_tokens_total")

    def drafted() -> list[float]:
        body = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
        return [float(line.rsplit(" ", 1)[1]) for line in body.splitlines() if line.startswith(name)]

    # the backend publishes its metrics every 0.25 s and when idle: wait for the count
    counts = wait_for(lambda: (d := drafted()) and d[0] > 0 and d, timeout=5.0) or drafted()
    assert counts and counts[0] > 0, f"{name} not exported or zero"


@pytest.mark.triton
def test_a_request_beyond_the_context_is_refused_naming_max_tokens(server):
    """Within the context alone, beyond it with the prompt: a check only the engine's side makes."""
    results, err = grpc_generate(server.grpc_url, text_input=PROMPTS[0], max_tokens=1023, stream=True)
    assert err is not None and "max_tokens=1023: prompt" in str(err) and "exceeds the context" in str(err)
    assert not results
    results, err = grpc_generate(server.grpc_url, text_input=PROMPTS[0], max_tokens=4, stream=True)
    assert err is None and texts(results)  # the next request is served
