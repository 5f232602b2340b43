"""The vLLM-backend and TensorRT-LLM request conventions, HTTP strictness and vLLM's metric names,
through a real tritonserver (the nvidia-pytriton wheel's 2.51 binary) with the smoke model."""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend.client import grpc_inputs, input_array
from lightspec_backend.launcher import TritonServer
from lightspec_backend.repository import write_model_repository

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from tests.e2e.test_triton_server import grpc_stream, stop_cleanly, wait_for

pytestmark = pytest.mark.triton

MODELS = ["lightspec", "lightspec_target", "lightspec_batched"]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server(tmp_path_factory, smoke_model):
    root = tmp_path_factory.mktemp("conventions")
    overrides = {"model_dir": str(smoke_model / "target"), "num_kv_blocks": "64", "block_size": "16",
                 "num_threads": "1", "stages": "triton"}  # fmt: skip
    repo = write_model_repository(root / "repo", overrides)
    srv = TritonServer(repo, cache_dir=root / "cache", model_control_mode="explicit", load_models=MODELS)
    srv.start(timeout_s=600)
    yield srv
    stop_cleanly(srv)


@pytest.fixture(scope="module")
def reference(smoke_model):
    engine = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=64, block_size=16))
    yield engine
    engine.close()


def greedy(reference: LLMEngine, max_tokens: int, **kw) -> str:
    return reference.generate([PROMPT], SamplingParams(max_tokens=max_tokens, **kw))[0].text


def batched_inputs(**tensors) -> list:
    """Every input with shape [1, 1] (lists: [1, N]), as TensorRT-LLM clients send them."""
    out = []
    for name, value in tensors.items():
        arr = input_array(name, value)[None, ...]
        t = grpcclient.InferInput(name, list(arr.shape), "BYTES" if arr.dtype == object else
                                  {np.bool_: "BOOL", np.int32: "INT32", np.uint64: "UINT64",
                                   np.float32: "FP32", np.int64: "INT64"}[arr.dtype.type])  # fmt: skip
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def http_post(server: TritonServer, path: str, body: dict, timeout: float = 120.0):
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]


def scrape(server: TritonServer) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        return r.read().decode()


def sample(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total, found = 0.0, False
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total, found = total + float(m.group(2)), True
    assert found, f"{name} {labels} not exported"
    return total


def text_of(results) -> str:
    return "".join(t.decode() for r in results for t in r.as_numpy("text_output").reshape(-1))


# ---- the vLLM backend's convention ------------------------------------------------------------------


def test_vllm_backend_request_with_sampling_parameters_streams_the_plain_request_text(server, reference):
    plain, err = grpc_stream(
        server.grpc_url,
        "lightspec",
        grpc_inputs(text_input=PROMPT, max_tokens=12, stream=True, exclude_input_in_output=True),
    )
    assert err is None
    sp = json.dumps({"max_tokens": "12", "temperature": "0", "top_p": "1", "n": 1, "best_of": 1})
    vllm, err = grpc_stream(server.grpc_url, "lightspec",
                       grpc_inputs(text_input=PROMPT, stream=True, sampling_parameters=sp,
                                   exclude_input_in_output=True, return_finish_reason=True,
                                   return_num_output_tokens=True))  # fmt: skip
    assert err is None and len(vllm) > 1
    assert text_of(vllm) == text_of(plain) == greedy(reference, 12)
    assert vllm[-1].as_numpy("finish_reason")[0] == b"length"


def test_unknown_sampling_parameters_key_is_invalid_arg_naming_it(server):
    _, err = grpc_stream(
        server.grpc_url,
        "lightspec",
        grpc_inputs(text_input=PROMPT, sampling_parameters='{"max_tokens": 4, "top_kk": 3}'),
    )
    assert err is not None and "sampling_parameters: top_kk: unknown key" in err.message()


# ---- TensorRT-LLM's convention: [1, 1] shapes to the batched front -------------------------------


def trtllm_inputs(**extra) -> list:
    return batched_inputs(text_input=PROMPT, max_tokens=12, bad_words=[""], stop_words=[""], top_k=1, top_p=1.0,
                          temperature=0.0, random_seed=0, beam_width=1, pad_id=0, **extra)  # fmt: skip


def test_trtllm_style_request_streams_through_the_batched_front(server, reference):
    results, err = grpc_stream(
        server.grpc_url, "lightspec_batched", trtllm_inputs(stream=True, exclude_input_in_output=True)
    )
    assert err is None and len(results) > 1
    assert all(r.as_numpy("text_output").shape == (1, 1) for r in results)
    assert results[0].as_numpy("output_ids").ndim == 2
    assert text_of(results) == greedy(reference, 12)
    assert results[-1].as_numpy("finish_reason")[0, 0] == b"length"


def test_trtllm_style_non_streaming_returns_one_batched_response_with_the_prompt(server, reference):
    (result,), err = grpc_stream(server.grpc_url, "lightspec_batched", trtllm_inputs(min_length=12))
    assert err is None
    assert result.as_numpy("text_output")[0, 0].decode() == PROMPT + greedy(reference, 12, min_tokens=12)


def test_trtllm_end_to_end_client_defaults_stream_greedy_text(server, reference):
    # its client streams with exclude_input_in_output false and temperature 1.0, no top_k or top_p:
    # TensorRT-LLM decodes that greedily and streams only the new text
    inputs = batched_inputs(text_input=PROMPT, max_tokens=24, stream=True, exclude_input_in_output=False,
                            temperature=1.0, end_id=-1, pad_id=2)  # fmt: skip
    results, err = grpc_stream(server.grpc_url, "lightspec_batched", inputs)
    assert err is None, err
    assert text_of(results) == greedy(reference, 24, ignore_eos=True)


def test_trtllm_beam_width_2_is_invalid_arg_naming_it(server):
    inputs = batched_inputs(text_input=PROMPT, max_tokens=4, beam_width=2)
    _, err = grpc_stream(server.grpc_url, "lightspec_batched", inputs)
    assert err is not None and err.message().startswith("beam_width=2: not supported")


PERF = [
    "kv_cache_alloc_new_blocks",
    "kv_cache_reused_blocks",
    "kv_cache_alloc_total_blocks",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
]


def test_trtllm_return_perf_metrics_streams_kv_blocks_and_steady_clock_times(server, reference):
    t0 = time.monotonic_ns()
    inputs = batched_inputs(text_input=PROMPT, max_tokens=12, stream=True, return_perf_metrics=True)
    results, err = grpc_stream(server.grpc_url, "lightspec_batched", inputs, outputs=["text_output", *PERF])
    t1 = time.monotonic_ns()
    assert err is None, err
    assert text_of(results) == greedy(reference, 12)
    last = {n: results[-1].as_numpy(n) for n in PERF}
    assert all(a is not None and a.shape == (1, 1) for a in last.values())
    assert [last[n].dtype for n in PERF] == [np.int32] * 3 + [np.int64] * 4
    new, reused, total, arrival, scheduled, first, final = (int(last[n][0, 0]) for n in PERF)
    assert total == new >= 1 and reused >= 0
    # the server's CLOCK_MONOTONIC is this process's time.monotonic_ns (TensorRT-LLM's steady clock)
    assert t0 <= arrival <= scheduled <= first <= final <= t1
    # HTTP generate on lightspec: the outputs only when asked for
    status, body = http_post(server, "/v2/models/lightspec/generate", {"text_input": PROMPT, "max_tokens": 4})
    assert status == 200 and not set(PERF) & set(json.loads(body)), body
    status, body = http_post(server, "/v2/models/lightspec/generate",
                             {"text_input": PROMPT, "max_tokens": 4, "return_perf_metrics": True})  # fmt: skip
    assert status == 200 and set(PERF) <= set(json.loads(body)), body


def test_http_generate_on_the_batched_front(server, reference):
    status, body = http_post(server, "/v2/models/lightspec_batched/generate",
                             {"text_input": PROMPT, "max_tokens": 8, "bad_words": "", "stop_words": "",
                              "exclude_input_in_output": True})  # fmt: skip
    assert status == 200, body
    assert json.loads(body)["text_output"] == greedy(reference, 8)


@pytest.mark.parametrize("parameters", [{"stream": True}, {"stream": True, "temperature": 0.5, "seed": 1}])
def test_batched_front_forwards_grpc_request_parameters_as_lightspec_reads_them(server, parameters):
    # without drafts every token is one response, and a seeded sample is the same on both paths
    tensors = {"text_input": PROMPT, "max_tokens": 8, "num_draft_tokens": 0}
    plain, err = grpc_stream(server.grpc_url, "lightspec", grpc_inputs(**tensors), parameters=parameters)
    assert err is None and len(plain) == 8
    batched, err = grpc_stream(server.grpc_url, "lightspec_batched", batched_inputs(**tensors), parameters=parameters)
    assert err is None, err
    assert len(batched) == len(plain) and text_of(batched) == text_of(plain)


@pytest.mark.parametrize("endpoint", ["generate", "generate_stream"])
def test_batched_front_forwards_http_body_keys_that_are_not_inputs(server, endpoint):
    # Over HTTP a key the model declares as an input (temperature, stream, also inside "parameters")
    # becomes that input; only the others (stop, min_p here) reach the model as request parameters.
    body = {"text_input": PROMPT, "max_tokens": 8, "num_draft_tokens": 0, "stop": "ss", "parameters": {"min_p": 0.0}}
    if endpoint == "generate_stream":
        body["stream"] = True
    events = {}
    for model in ("lightspec", "lightspec_batched"):
        status, text = http_post(server, f"/v2/models/{model}/{endpoint}", body)
        assert status == 200, text
        replies = sse_events(text) if endpoint == "generate_stream" else [json.loads(text)]
        events[model] = [(e["text_output"], e["output_ids"], e.get("finish_reason")) for e in replies]
    assert events["lightspec_batched"] == events["lightspec"]
    assert events["lightspec"][-1][2] == "stop"


def test_headers_the_server_forwards_reach_neither_model_as_sampling_keys(tmp_path, smoke_model, reference):
    """tritonserver forwards the headers its pattern matches as request parameters; with the same
    pattern as ``header_forward_pattern`` both models serve the request (they refused the key)."""
    pattern = "^x-tenant"
    overrides = {"model_dir": str(smoke_model / "target"), "num_kv_blocks": "64", "block_size": "16",
                 "speculation": "none", "header_forward_pattern": pattern}  # fmt: skip
    repo = write_model_repository(tmp_path / "repo", overrides)
    args = [f"--grpc-header-forward-pattern={pattern}", f"--http-header-forward-pattern={pattern}"]
    with TritonServer(repo, cache_dir=tmp_path / "cache", model_control_mode="explicit",
                      load_models=["lightspec", "lightspec_batched"], extra_args=args) as srv:  # fmt: skip
        tenant = {"x-tenant-id": "acme"}
        plain, err = grpc_stream(
            srv.grpc_url, "lightspec", grpc_inputs(text_input=PROMPT, max_tokens=8), headers=tenant
        )
        assert err is None, err
        assert text_of(plain) == PROMPT + greedy(reference, 8)  # not streamed: the prompt leads
        batched, err = grpc_stream(srv.grpc_url, "lightspec_batched",
                                   batched_inputs(text_input=PROMPT, max_tokens=8), headers=tenant)  # fmt: skip
        assert err is None, err
        assert text_of(batched) == text_of(plain)
        req = urllib.request.Request(f"http://{srv.http_url}/v2/models/lightspec/generate", headers=tenant,
                                     data=json.dumps({"text_input": PROMPT, "max_tokens": 8}).encode())  # fmt: skip
        with urllib.request.urlopen(req, timeout=120) as r:
            assert json.loads(r.read())["text_output"] == PROMPT + greedy(reference, 8)


def test_batched_front_refuses_a_misspelt_parameter_by_name(server):
    body = {"text_input": PROMPT, "max_tokens": 4, "temprature": 0.5}
    status, text = http_post(server, "/v2/models/lightspec_batched/generate", body)
    assert status == 400 and "temprature: unknown key" in text, text


# ---- HTTP strictness -----------------------------------------------------------------------------------


def test_unknown_http_key_is_400_naming_it(server):
    status, body = http_post(
        server, "/v2/models/lightspec/generate", {"text_input": PROMPT, "max_tokens": 4, "temprature": 0.5}
    )
    assert status == 400 and "temprature: unknown key" in body, body


def test_vllm_keys_are_accepted_as_http_parameters(server, reference):
    status, body = http_post(
        server,
        "/v2/models/lightspec/generate",
        {"text_input": PROMPT, "max_tokens": 6, "n": 1, "exclude_input_in_output": True},
    )
    assert status == 200, body
    assert json.loads(body)["text_output"] == greedy(reference, 6)


def test_generate_stream_streams_with_stream_true_as_input_or_parameter(server, reference):
    want = greedy(reference, 10)
    for body in ({"text_input": PROMPT, "max_tokens": 10, "stream": True},
                 {"text_input": PROMPT, "max_tokens": 10, "parameters": {"stream": True}}):  # fmt: skip
        status, text = http_post(server, "/v2/models/lightspec/generate_stream", body)
        assert status == 200, text
        events = sse_events(text)
        assert len(events) > 1 and "".join(e["text_output"] for e in events) == want, body


def test_generate_stream_without_stream_sends_the_whole_completion_once(server, reference):
    # Triton 2.51 tells a model nothing about which endpoint a request came through (its request
    # parameters are the same), and /generate refuses a second response: so the default stays
    # non-streaming, as in the vLLM backend (docs/clients.md).
    status, body = http_post(
        server,
        "/v2/models/lightspec/generate_stream",
        {"text_input": PROMPT, "max_tokens": 10, "exclude_input_in_output": True},
    )
    assert status == 200, body
    (event,) = sse_events(body)
    assert event["text_output"] == greedy(reference, 10) and isinstance(event["output_ids"], list)


def test_output_ids_of_one_token_events_are_json_numbers(server, reference):
    # Triton's generate endpoints write every one-element tensor as a JSON scalar (checked on
    # 2.51 for shapes [1] and [1, 1]); a client reading output_ids must accept a number too.
    status, body = http_post(
        server,
        "/v2/models/lightspec/generate_stream",
        {"text_input": PROMPT, "max_tokens": 6, "stream": True, "num_draft_tokens": 0},
    )
    assert status == 200, body
    events = sse_events(body)
    assert len(events) == 6 and all(isinstance(e["output_ids"], int) for e in events), events
    ids = [e["output_ids"] for e in events]
    assert reference.tokenizer.decode(ids) == greedy(reference, 6)


# ---- metrics -------------------------------------------------------------------------------------------


def test_rejected_request_counts_as_a_failure(server):
    before = sample(scrape(server), "lightspec:request_failure_total", model_name="lightspec")
    status, _ = http_post(server, "/v2/models/lightspec/generate", {"text_input": PROMPT, "max_tokens": 0})
    assert status == 400
    # the 400 goes out before the metrics thread publishes the count: wait for it, then check it
    count = lambda: sample(scrape(server), "lightspec:request_failure_total", model_name="lightspec")
    after = wait_for(lambda: (c := count()) > before and c) or count()
    assert after == before + 1


def vllm_metrics_hold(text: str, **labels) -> None:
    """The metrics the request below must have left, under vLLM's names (AssertionError if not)."""
    assert sample(text, "vllm:request_success_total", finished_reason="length", **labels) >= 1
    assert sample(text, "vllm:generation_tokens_total", **labels) >= 16
    assert sample(text, "vllm:prompt_tokens_total", **labels) > 0
    assert sample(text, "vllm:spec_decode_num_drafts_total", **labels) > 0
    assert sample(text, "vllm:spec_decode_num_draft_tokens_total", **labels) >= sample(
        text, "vllm:spec_decode_num_accepted_tokens_total", **labels
    )
    assert sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0", **labels) >= 0
    for hist in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_queue_time_seconds", "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_prompt_tokens", "request_generation_tokens"):  # fmt: skip
        assert sample(text, f"vllm:{hist}_count", **labels) >= 1, hist
    assert sample(text, "vllm:num_requests_running", **labels) == 0
    assert sample(text, "vllm:num_requests_waiting", **labels) == 0
    assert sample(text, "vllm:kv_cache_usage_perc", **labels) == 0
    assert sample(text, "lightspec:draft_tokens_per_step_count", **labels) > 0


def test_metrics_are_exported_under_vllm_names(server):
    labels = {"model_name": "lightspec", "engine": "0"}
    status, _ = http_post(server, "/v2/models/lightspec/generate", {"text_input": PROMPT, "max_tokens": 16})
    assert status == 200

    def holds(text: str) -> bool:
        try:
            vllm_metrics_hold(text, **labels)
        except AssertionError:
            return False
        return True

    # the response goes out before the metrics thread publishes the request's statistics and the
    # idle engine's gauges, one IPC each: wait until a scrape shows all of them, then check that one
    text = wait_for(lambda: (t := scrape(server)) and holds(t) and t) or scrape(server)
    vllm_metrics_hold(text, **labels)
    for old in ("num_requests_running", "kv_cache_usage_ratio", "time_to_first_token_seconds_count",
                "request_success_total", "generation_tokens_total"):  # fmt: skip
        assert f"lightspec:{old}" not in text
