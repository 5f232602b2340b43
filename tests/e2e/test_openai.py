"""The OpenAI-compatible API with the real ``openai`` client, in front of a real tritonserver on the
checked-in model repository (the embedded model), as ``lightspec serve`` runs them.

Two API servers share the one Triton: one reads the checkpoint from the model config (the embedded
model, which has no chat template), one is given a copy of that checkpoint whose tokenizer
transformers saved with a chat template (``--model-dir``), so chat is served by the same weights."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from lightspec_backend.launcher import TritonServer
from lightspec_backend.openai_api.command import OpenAIServer

from lightspec_core.models.tokenizer import TokenizerInfo
from tests.backend.openai_api.test_chat_template import chat_checkpoint
from tests.e2e.test_triton_server import grpc_generate, texts, wait_for

pytestmark = pytest.mark.triton

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "def fibonacci(n):"
MODELS = ["lightspec"]  # stages: process, the checked-in default: the engine runs every stage itself
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # the models lightspec serve loads by default, by name: the repository may hold other variants
    srv = TritonServer(ROOT / "model_repository", cache_dir=tmp_path_factory.mktemp("cache"),
                       model_control_mode="explicit", load_models=MODELS)  # fmt: skip
    srv.start(timeout_s=600)
    yield srv
    pid = srv.pid
    srv.stop(timeout_s=60)
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory, default_model) -> Path:
    return chat_checkpoint(default_model / "target", tmp_path_factory.mktemp("chat") / "target", TEMPLATE)


@pytest.fixture(scope="module")
def api(server):
    srv = OpenAIServer(server.grpc_url, port=0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def chat_api(server, chat_dir):
    srv = OpenAIServer(server.grpc_url, port=0, model_dir=chat_dir).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(api) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def chat_client(chat_api) -> openai.OpenAI:
    return openai.OpenAI(base_url=chat_api.url, api_key="unused", max_retries=0, timeout=120)


def reference(server, prompt: str, max_tokens: int, add_special_tokens: bool = True) -> tuple[str, int]:
    """Greedy text and token count straight from Triton's gRPC stream."""
    results, err = grpc_generate(server.grpc_url, text_input=prompt, max_tokens=max_tokens,
                                 exclude_input_in_output=True, add_special_tokens=add_special_tokens)  # fmt: skip
    assert err is None, err
    return texts(results)[0], len(results[0].as_numpy("output_ids"))


def prompt_tokens(prompt: str, model_dir: Path, add_special_tokens: bool = True) -> int:
    return len(TokenizerInfo.from_dir(model_dir).encode(prompt, add_special_tokens))


def check_spec_metrics(body: dict) -> None:
    """vLLM's per-request ``metrics.speculative_decoding``, consistent as aiperf checks it."""
    spec = body["metrics"]["speculative_decoding"]
    hist = spec["acceptance_histogram"]
    assert spec["num_spec_steps"] == sum(hist) > 0  # the embedded model speculates (mtp)
    assert sum(j * c for j, c in enumerate(hist)) == spec["num_accepted_draft_tokens"] <= spec["num_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(1 + spec["num_accepted_draft_tokens"] / sum(hist))


def test_models_lists_the_lightspec_orchestrator(client, default_model):
    models = client.models.list().data
    assert [m.id for m in models] == ["lightspec"]  # not its stage models
    assert Path(models[0].model_extra["root"]) == default_model / "target"


def test_greedy_completion_equals_triton_and_counts_tokens(client, server, default_model):
    want, n = reference(server, PROMPT, 24)
    r = client.completions.create(model="lightspec", prompt=PROMPT, max_tokens=24, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_tokens(PROMPT, default_model / "target")
    assert r.usage.completion_tokens == n == 24 and r.usage.total_tokens == r.usage.prompt_tokens + 24
    check_spec_metrics(r.model_dump())


def test_streamed_completion_equals_triton_and_ends_with_usage(client, server, default_model):
    want, _ = reference(server, PROMPT, 24)
    chunks = list(client.completions.create(model="lightspec", prompt=PROMPT, max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))  # fmt: skip
    assert len(chunks) > 3  # one event per step, not one at the end
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 24
    assert last.usage.prompt_tokens == prompt_tokens(PROMPT, default_model / "target")
    check_spec_metrics(last.model_dump())


def test_stop_string_ends_the_completion_before_it(client, server):
    want, _ = reference(server, PROMPT, 24)
    stop = want.strip().split()[1]  # a word from inside the greedy text
    r = client.completions.create(model="lightspec", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == want[: want.index(stop)]


def test_seed_and_sampling_fields_reach_triton(client, server):
    # a seeded request samples the same tokens with speculation (here over the API) as without
    # (over gRPC, no drafts): each position's draw is fixed by the seed and the position
    kw = {"temperature": 1.0, "top_p": 0.9, "seed": 7, "max_tokens": 16}
    results, err = grpc_generate(server.grpc_url, text_input=PROMPT, exclude_input_in_output=True,
                                 num_draft_tokens=0, **kw)  # fmt: skip
    assert err is None, err
    got = client.completions.create(model="lightspec", prompt=PROMPT, **kw)
    assert got.choices[0].text == texts(results)[0]
    other = client.completions.create(model="lightspec", prompt=PROMPT, **{**kw, "seed": 8})
    assert other.choices[0].text != got.choices[0].text


def test_a_batch_of_prompts_with_n_choices_each_is_every_choice_as_its_own_request(client, default_model):
    """Choice i is prompt i // n's (i % n)-th, sampled with seed + i % n as vLLM seeds it: the same
    tokens as that prompt asked alone with that seed (seeded sampling does not depend on the batch)."""
    prompts = [PROMPT, "import os\n"]
    kw = {"temperature": 1.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}
    r = client.completions.create(model="lightspec", prompt=prompts, n=2, seed=5, **kw)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    alone = [client.completions.create(model="lightspec", prompt=p, seed=5 + j, **kw) for p in prompts for j in (0, 1)]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.prompt_tokens == sum(prompt_tokens(p, default_model / "target") for p in prompts)
    assert r.usage.completion_tokens == 4 * 12
    check_spec_metrics(r.model_dump())


def test_streamed_chat_choices_interleave_by_index_each_with_its_role_and_finish(chat_client):
    messages = [{"role": "user", "content": PROMPT}]
    kw = {"model": "lightspec", "messages": messages, "max_tokens": 10, "temperature": 0.8, "seed": 9, "n": 3}
    whole = chat_client.chat.completions.create(**kw)
    stream = chat_client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    per = {i: [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in range(3)}
    assert all(len(c.choices) <= 1 for c in chunks) and sum(map(len, per.values())) == len(chunks) - 1
    for i, parts in per.items():
        assert parts[0].delta.role == "assistant" and [p.finish_reason for p in parts].count("length") == 1
        assert parts[-1].finish_reason == "length"
        assert "".join(p.delta.content or "" for p in parts) == whole.choices[i].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 30
    one = chat_client.chat.completions.create(**{**kw, "n": 1})  # the prompt counts once
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens == one.usage.prompt_tokens
    assert one.choices[0].message.content == whole.choices[0].message.content


def test_min_tokens_keeps_a_completion_going_past_its_end_token(client):
    prompt = 'if __name__ == "__main__":\n    main()\n'  # the embedded model ends this at once
    plain = client.completions.create(model="lightspec", prompt=prompt, max_tokens=8, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 4
    kept = client.completions.create(model="lightspec", prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"min_tokens": 4})  # fmt: skip
    assert kept.usage.completion_tokens >= 4


def test_vllm_sampling_extensions_at_their_neutral_values_change_nothing(client, server):
    """What vLLM's own benchmark client sends (``vllm bench serve``); another value is refused by name."""
    want, _ = reference(server, PROMPT, 8)
    neutral = {"repetition_penalty": 1.0, "min_p": 0.0, "skip_special_tokens": True,
               "include_stop_str_in_output": False, "stop_token_ids": []}  # fmt: skip
    r = client.completions.create(model="lightspec", prompt=PROMPT, max_tokens=8, temperature=0, extra_body=neutral)
    assert r.choices[0].text == want
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="lightspec", prompt=PROMPT, extra_body={"repetition_penalty": 1.1})
    assert e.value.body["param"] == "repetition_penalty"


def test_continuous_usage_comes_with_include_usage_only_as_in_vllm(client):
    def usages(options: dict) -> list:
        chunks = client.completions.create(model="lightspec", prompt=PROMPT, max_tokens=6, temperature=0,
                                           stream=True, stream_options=options)  # fmt: skip
        return [c.usage for c in chunks if c.choices]

    assert set(usages({"continuous_usage_stats": True})) == {None}
    counts = [u.completion_tokens for u in usages({"include_usage": True, "continuous_usage_stats": True})]
    assert counts == sorted(counts) and counts[-1] == 6


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"temperature": -1}, "temperature"), ({"n": 0}, "n"), ({"max_tokens": 5000}, "max_tokens"),
     ({"logprobs": 2}, "logprobs")],
)  # fmt: skip
def test_bad_values_are_bad_request_errors_naming_the_field(client, kw, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="lightspec", prompt=PROMPT, **kw)
    assert e.value.status_code == 400 and field in e.value.message
    assert e.value.body["param"] == field and e.value.body["type"] == "invalid_request_error"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt=PROMPT)
    assert "gpt-4o" in e.value.message


def test_chat_without_a_chat_template_is_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="lightspec", messages=[{"role": "user", "content": "hi"}])
    assert "chat template" in e.value.message and e.value.body["code"] == "missing_chat_template"


def test_chat_renders_the_template_and_equals_triton_on_the_rendered_prompt(chat_client, server, chat_dir):
    messages = [{"role": "system", "content": "Write Python."}, {"role": "user", "content": PROMPT}]
    from transformers import AutoTokenizer

    rendered = AutoTokenizer.from_pretrained(chat_dir).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    want, _ = reference(server, rendered, 20, add_special_tokens=False)  # the template wrote bos_token
    r = chat_client.chat.completions.create(model="lightspec", messages=messages, max_completion_tokens=20,
                                            temperature=0)  # fmt: skip
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.usage.prompt_tokens == prompt_tokens(rendered, chat_dir, False) and r.usage.completion_tokens == 20
    stream = chat_client.chat.completions.create(model="lightspec", messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []
    check_spec_metrics(chunks[-1].model_dump())


def test_a_chat_without_a_length_generates_to_the_end_of_the_context(chat_client, chat_dir):
    """vLLM's default: the rest of the context (1024 tokens for the embedded model), not a fixed count."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(chat_dir)
    body = PROMPT
    while True:  # a prompt that leaves a few dozen tokens of the context
        messages = [{"role": "user", "content": body}]
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        n = prompt_tokens(rendered, chat_dir, False)
        if n > 1024 - 48:
            break
        body += "\n    total = total + fibonacci(n - 1)"
    r = chat_client.chat.completions.create(model="lightspec", messages=messages, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 1024 - n
    assert r.choices[0].finish_reason == "length"


def engine_metric(server, name: str) -> float:
    """An engine statistic summed over its labels, under the name the backend exports it."""
    try:
        from lightspec_backend.metrics import exported_name
    except ImportError:  # a backend that exports every statistic as lightspec:<name>
        exported_name = "lightspec:{}".format
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        lines = r.read().decode().splitlines()
    values = [float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(exported_name(name) + "{")]
    assert values, f"{exported_name(name)} not exported"
    return sum(values)


def running(server) -> float:
    return engine_metric(server, "num_requests_running")


def generated(server) -> float:
    return engine_metric(server, "generation_tokens_total")


MAX = 1000  # with ignore_eos the request would run to its last token for many seconds


def abandon(api, stream: bool, release: threading.Event) -> None:
    """POST a long completion on a raw connection and close it once ``release`` is set (for a
    stream, after its first events arrived): a client that goes away mid-answer."""
    body = json.dumps({"model": "lightspec", "prompt": PROMPT, "max_tokens": MAX, "ignore_eos": True, "stream": stream})
    head = f"POST /v1/completions HTTP/1.1\r\nHost: {api.host}\r\nContent-Type: application/json\r\n"
    with socket.create_connection((api.host, api.port), timeout=60) as s:
        s.sendall(f"{head}Content-Length: {len(body)}\r\n\r\n{body}".encode())
        received = b""
        while stream and b"data: " not in received:
            received += s.recv(65536)
        release.wait(60)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_a_client_that_disconnects_frees_its_request(api, server, stream):
    assert wait_for(lambda: running(server) == 0, timeout=30)
    before = generated(server)
    release = threading.Event()
    t = threading.Thread(target=abandon, args=(api, stream, release))
    t.start()
    try:
        assert wait_for(lambda: running(server) == 1, timeout=60)
    finally:
        release.set()
        t.join(60)
    gone = time.monotonic()
    assert wait_for(lambda: running(server) == 0, timeout=10), "the engine still runs the abandoned request"
    freed_after = time.monotonic() - gone
    # long before it would have finished: far fewer tokens than asked were generated for it
    assert generated(server) - before < MAX / 2 and freed_after < 10
    r = openai.OpenAI(base_url=api.url, api_key="unused").completions.create(
        model="lightspec", prompt=PROMPT, max_tokens=4
    )
    assert r.usage.completion_tokens == 4  # and the stack still serves
