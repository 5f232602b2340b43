"""End to end through a real tritonserver (the nvidia-pytriton wheel's 2.51 binary, or one on PATH)
started by the project's launcher on free ports, with the smoke model, over gRPC and HTTP."""

from __future__ import annotations

import json
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend import cli
from lightspec_backend.client import grpc_inputs, is_final
from lightspec_backend.launcher import TritonServer
from lightspec_backend.metrics import exported_name
from lightspec_backend.repository import write_model_repository
from tritonclient.utils import InferenceServerException

from lightspec_core import EngineConfig, LLMEngine, SamplingParams

pytestmark = pytest.mark.triton

MODELS = ["lightspec", "lightspec_target", "lightspec_mtp", "lightspec_draft"]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def overrides(smoke_model) -> dict[str, str]:
    # Stage models over BLS and MTP as a stage of its own here (the default runs every stage in
    # the orchestrator's child process), so the BLS path to every stage is exercised; the
    # checked-in repository's tests cover the default.
    return {
        "model_dir": str(smoke_model / "target"),
        "num_kv_blocks": "64",
        "block_size": "16",
        "num_threads": "1",
        "mtp": "lightspec_mtp",
        "stages": "triton",
    }


@pytest.fixture(scope="module")
def server(tmp_path_factory, overrides):
    root = tmp_path_factory.mktemp("triton")
    repo = write_model_repository(root / "repo", overrides)
    # The target stage loads the MTP heads too, so that a variant can run with mtp: fused.
    fused = write_model_repository(root / "fused", {**overrides, "mtp": "fused"})
    (repo / "lightspec_target" / "config.pbtxt").write_text((fused / "lightspec_target" / "config.pbtxt").read_text())
    # Not loaded at start: used to check that bad parameters fail the model load.
    bad = write_model_repository(root / "bad", {**overrides, "speculation": "eagle"})
    (repo / "lightspec_alt").mkdir()
    (repo / "lightspec_alt" / "1").mkdir()
    text = (bad / "lightspec" / "config.pbtxt").read_text().replace('name: "lightspec"', 'name: "lightspec_alt"')
    (repo / "lightspec_alt" / "config.pbtxt").write_text(text)
    srv = TritonServer(repo, cache_dir=root / "cache", model_control_mode="explicit", load_models=MODELS)
    srv.start(timeout_s=600)
    yield srv
    stop_cleanly(srv)


def stop_cleanly(srv) -> None:
    """Stop a test's server and check it went: the process gone, no traceback in its log."""
    pid = srv.pid
    assert srv.stop(timeout_s=60) is not None
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    assert "Traceback" not in srv.log_text(), srv.log_tail(80)


@pytest.fixture(scope="module")
def reference(overrides):
    """The in-process engine with the same configuration, for greedy reference outputs."""
    engine = LLMEngine(EngineConfig(model_dir=overrides["model_dir"], num_kv_blocks=64, block_size=16))
    yield engine
    engine.close()


def greedy(reference: LLMEngine, prompt: str, max_tokens: int, **params) -> str:
    return reference.generate([prompt], SamplingParams(max_tokens=max_tokens, **params))[0].text


def grpc_generate(
    url: str, timeout: float = 120.0, model: str = "lightspec", outputs: list[str] | None = None, **tensors
):
    """One request over a gRPC stream: (data results, error or None). ``outputs``: the output names
    to ask for (default: none named, so all)."""
    return grpc_stream(url, model, grpc_inputs(**tensors), timeout, outputs)


def grpc_stream(
    url: str,
    model: str,
    inputs: list,
    timeout: float = 120.0,
    outputs: list[str] | None = None,
    parameters: dict | None = None,
    headers: dict | None = None,
):
    """``grpc_generate`` for ready-made ``InferInput``s (any shapes); ``parameters``: the request's
    parameters (gRPC sends them typed, a float as a double); ``headers``: the stream's metadata."""
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)), headers=headers)
    out = []
    wanted = [grpcclient.InferRequestedOutput(n) for n in outputs] if outputs else None
    try:
        client.async_stream_infer(
            model, inputs, outputs=wanted, parameters=parameters, enable_empty_final_response=True
        )
        while True:
            result, error = results.get(timeout=timeout)
            if error is not None:
                return out, error
            if result.get_response().outputs:
                out.append(result)
            if is_final(result):
                return out, None
    finally:
        client.stop_stream()
        client.close()


def texts(results) -> list[str]:
    return [r.as_numpy("text_output")[0].decode() for r in results]


def http_post(server: TritonServer, path: str, body: dict, timeout: float = 120.0):
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(server: TritonServer) -> dict[str, float]:
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        body = r.read().decode()
    out = {}
    for line in body.splitlines():
        if line.startswith(("lightspec:", "vllm:")):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(values: dict[str, float], name: str, **labels) -> float:
    """Sum of the samples of the engine statistic ``name`` (exported under vLLM's name where vLLM
    has the quantity); ``model=`` selects the ``model_name`` label."""
    suffix = next((s for s in ("_count", "_bucket", "_sum") if name.endswith(s) and name != s), "")
    full = exported_name(name.removesuffix(suffix) if suffix else name) + suffix
    if "model" in labels:
        labels["model_name"] = labels.pop("model")
    pattern = re.compile(rf"^{re.escape(full)}\{{(.*)\}}$")
    total, found = 0.0, False
    for key, v in values.items():
        m = pattern.match(key)
        if m and all(f'{k}="{val}"' in m.group(1) for k, val in labels.items()):
            total, found = total + v, True
    assert found, f"metric {full} {labels} not exported"
    return total


# ---- generation ---------------------------------------------------------------------------------


def test_grpc_stream_equals_non_stream_and_in_process_engine(server, reference):
    want = greedy(reference, PROMPT, 16)
    streamed, err = grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=16, stream=True)
    assert err is None
    assert len(streamed) > 1
    whole, err = grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=16, exclude_input_in_output=True)
    assert err is None and len(whole) == 1
    assert "".join(texts(streamed)) == texts(whole)[0] == want
    ids = np.concatenate([r.as_numpy("output_ids") for r in streamed]).tolist()
    assert ids == whole[0].as_numpy("output_ids").tolist()
    assert streamed[-1].as_numpy("finish_reason")[0] == b"length"
    assert all(r.as_numpy("finish_reason")[0] == b"" for r in streamed[:-1])


def test_non_stream_includes_the_prompt_by_default_and_counts_tokens(server, reference):
    (result,), err = grpc_generate(
        server.grpc_url, text_input=PROMPT, max_tokens=8, return_num_input_tokens=True, return_num_output_tokens=True
    )
    assert err is None
    assert result.as_numpy("text_output")[0].decode() == PROMPT + greedy(reference, PROMPT, 8)
    assert result.as_numpy("num_output_tokens")[0] == 8
    assert result.as_numpy("num_input_tokens")[0] == len(reference.tokenizer.encode(PROMPT).ids)
    drafted, accepted = result.as_numpy("total_draft_tokens")[0], result.as_numpy("total_accepted_draft_tokens")[0]
    rate = result.as_numpy("acceptance_rate")[0]
    assert 0 <= accepted <= drafted and rate == pytest.approx(accepted / drafted if drafted else 0.0)


def test_a_stream_gets_only_the_outputs_it_names(server, reference):
    results, err = grpc_generate(
        server.grpc_url, text_input=PROMPT, max_tokens=8, stream=True, outputs=["output_ids", "finish_reason"]
    )
    assert err is None and len(results) >= 2
    for r in results:
        assert sorted(o.name for o in r.get_response().outputs) == ["finish_reason", "output_ids"]
    ids = [int(t) for r in results for t in r.as_numpy("output_ids")]
    assert reference.tokenizer.decode(ids) == greedy(reference, PROMPT, 8)
    assert results[-1].as_numpy("finish_reason")[0] == b"length"


def test_stream_interval_coalesces_a_stream_into_fewer_responses(server, reference):
    every, err = grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=24, stream=True, ignore_eos=True)
    assert err is None
    coalesced, err = grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=24, stream=True, ignore_eos=True,
                                   stream_interval=6)  # fmt: skip
    assert err is None
    sizes = [len(r.as_numpy("output_ids").reshape(-1)) for r in coalesced]
    assert all(n >= 6 for n in sizes[1:-1]), sizes
    assert len(coalesced) < len(every) and sum(sizes) == 24
    assert "".join(texts(coalesced)) == "".join(texts(every)) == greedy(reference, PROMPT, 24, ignore_eos=True)


def test_input_ids_prompt(server, reference):
    ids = reference.tokenizer.encode(PROMPT).ids
    (result,), err = grpc_generate(server.grpc_url, input_ids=ids, max_tokens=6, exclude_input_in_output=True)
    assert err is None and result.as_numpy("text_output")[0].decode() == greedy(reference, PROMPT, 6)


def test_http_generate_returns_one_response(server, reference):
    status, body = http_post(
        server,
        "/v2/models/lightspec/generate",
        {"text_input": PROMPT, "max_tokens": 12, "exclude_input_in_output": True},
    )
    assert status == 200, body
    out = json.loads(body)
    assert out["text_output"] == greedy(reference, PROMPT, 12) and out["finish_reason"] == "length"
    # a body key that names an input is that input: the embedded tokenizer adds no BOS either way
    bare = {"text_input": PROMPT, "max_tokens": 12, "add_special_tokens": False, "return_num_input_tokens": True}
    status, body = http_post(server, "/v2/models/lightspec/generate", bare)
    assert status == 200, body
    assert json.loads(body)["num_input_tokens"] == len(reference.tokenizer.encode(PROMPT).ids)


def test_http_generate_stream_sends_server_sent_events(server, reference):
    status, body = http_post(
        server, "/v2/models/lightspec/generate_stream", {"text_input": PROMPT, "max_tokens": 12, "stream": True}
    )
    assert status == 200, body
    events = [json.loads(line[len("data: ") :]) for line in body.splitlines() if line.startswith("data: ")]
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == greedy(reference, PROMPT, 12)
    assert events[-1]["finish_reason"] == "length"


def test_sixteen_concurrent_streams_complete(server):
    outcomes: dict[int, tuple] = {}

    def run(i: int) -> None:
        outcomes[i] = grpc_generate(
            server.grpc_url,
            text_input=f"def f{i}(x):\n    return",
            max_tokens=8 + i % 5,
            stream=True,
            exclude_input_in_output=True,
        )

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert sorted(outcomes) == list(range(16))
    for i, (results, err) in outcomes.items():
        assert err is None, (i, err)
        ids = np.concatenate([r.as_numpy("output_ids") for r in results])
        reason = results[-1].as_numpy("finish_reason")[0]
        assert reason in (b"length", b"stop") and 0 < len(ids) <= 8 + i % 5


# ---- errors ---------------------------------------------------------------------------------------


def raw_input(name: str, arr: np.ndarray, datatype: str):
    t = grpcclient.InferInput(name, list(arr.shape), datatype)
    t.set_data_from_numpy(arr)
    return t


def grpc_error(url: str, inputs: list) -> str:
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer("lightspec", inputs, enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=60)
            if error is not None:
                return error.message()
            assert not result.get_response().outputs, "bad input produced data"
            if is_final(result):
                return ""
    finally:
        client.stop_stream()
        client.close()


def prompt_input():
    return raw_input("text_input", np.array([PROMPT.encode()], dtype=object), "BYTES")


BAD_REQUESTS = {
    "missing prompt": (lambda: [raw_input("max_tokens", np.array([4], np.int32), "INT32")], "text_input"),
    "wrong dtype": (lambda: [prompt_input(), raw_input("max_tokens", np.array([4], np.int64), "INT64")], "max_tokens"),
    "wrong shape": (
        lambda: [prompt_input(), raw_input("max_tokens", np.array([4, 4], np.int32), "INT32")],
        "max_tokens",
    ),
    "max_tokens 0": (lambda: grpc_inputs(text_input=PROMPT, max_tokens=0), "max_tokens=0"),
    "max_tokens negative": (lambda: grpc_inputs(text_input=PROMPT, max_tokens=-5), "max_tokens=-5"),
    "max_tokens over context": (lambda: grpc_inputs(text_input=PROMPT, max_tokens=100_000), "max_tokens=100000"),
    "max_tokens + prompt over context": (lambda: grpc_inputs(text_input=PROMPT, max_tokens=1020), "max_tokens=1020"),
    "temperature negative": (lambda: grpc_inputs(text_input=PROMPT, temperature=-1.0), "temperature=-1.0"),
    "top_p zero": (lambda: grpc_inputs(text_input=PROMPT, top_p=0.0), "top_p=0.0"),
    "top_p above one": (lambda: grpc_inputs(text_input=PROMPT, top_p=1.5), "top_p=1.5"),
    "top_k below off": (lambda: grpc_inputs(text_input=PROMPT, top_k=-2), "top_k=-2"),  # -1 is vLLM's off
    "num_draft_tokens negative": (lambda: grpc_inputs(text_input=PROMPT, num_draft_tokens=-1), "num_draft_tokens"),
    "prompt too long": (lambda: grpc_inputs(input_ids=[5] * 1100, max_tokens=1), "input_ids: 1100 tokens"),
    "token id outside vocabulary": (lambda: grpc_inputs(input_ids=[5, 10**6]), "input_ids"),
    "invalid utf-8": (lambda: grpc_inputs(text_input=b"\xff\xfe\xfd"), "text_input: invalid UTF-8"),
    "end_id -1 with ignore_eos false": (
        lambda: grpc_inputs(text_input=PROMPT, end_id=-1, ignore_eos=False),
        "end_id=-1",
    ),
}


def test_bad_inputs_are_rejected_while_a_good_stream_completes(server, reference):
    good: dict = {}
    t = threading.Thread(
        target=lambda: good.update(
            out=grpc_generate(
                server.grpc_url, text_input=PROMPT, max_tokens=60, stream=True, exclude_input_in_output=True
            )
        )
    )
    t.start()
    try:
        for case, (make_inputs, fragment) in BAD_REQUESTS.items():
            message = grpc_error(server.grpc_url, make_inputs())
            assert fragment in message, f"{case}: {message!r}"
    finally:
        t.join(300)
    results, err = good["out"]
    assert err is None and "".join(texts(results)) == greedy(reference, PROMPT, 60)


@pytest.mark.parametrize(
    "body",
    [
        {"max_tokens": 4},
        {"text_input": PROMPT, "max_tokens": 0},
        {"text_input": PROMPT, "temperature": -1},
        {"text_input": PROMPT, "top_p": 2.0},
        {"text_input": PROMPT, "max_tokens": 100_000},
    ],
)
def test_http_bad_input_is_http_400(server, body):
    # (A JSON value of the wrong type, e.g. "max_tokens": "many", is refused by Triton's HTTP
    # frontend itself with HTTP 500 in 2.51, before the model sees it.)
    status, text = http_post(server, "/v2/models/lightspec/generate", body)
    assert status == 400, text


def test_unknown_speculation_parameter_fails_model_load(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    with pytest.raises(InferenceServerException) as e:
        client.load_model("lightspec_alt")
    assert "speculation='eagle'" in str(e.value)
    assert not client.is_model_ready("lightspec_alt")
    assert client.is_model_ready("lightspec") and client.is_server_live()


def test_bad_policy_in_a_config_override_fails_model_load(server):
    client = grpcclient.InferenceServerClient(server.grpc_url)
    cfg = client.get_model_config("lightspec", as_json=True)["config"]
    cfg["name"] = "lightspec_alt"
    cfg["parameters"]["policy"] = {"string_value": "sometimes"}
    with pytest.raises(InferenceServerException) as e:
        client.load_model("lightspec_alt", config=json.dumps(cfg))
    assert "policy='sometimes'" in str(e.value)


def test_a_draft_stage_whose_model_is_shorter_than_the_context_fails_its_load_naming_draft_dir(
    server, smoke_model, tmp_path
):
    """Refused when it loads, not at the first request that reaches past the draft's positions."""
    import shutil

    short = shutil.copytree(smoke_model / "draft", tmp_path / "draft")
    config = json.loads((short / "config.json").read_text())
    served = json.loads((smoke_model / "target" / "config.json").read_text())["max_position_embeddings"]
    config["max_position_embeddings"] = served // 2
    (short / "config.json").write_text(json.dumps(config))
    client = grpcclient.InferenceServerClient(server.grpc_url)
    cfg = client.get_model_config("lightspec_draft", as_json=True)["config"]
    assert cfg["parameters"]["role"]["string_value"] == "draft"
    cfg["name"] = "lightspec_alt"
    cfg["parameters"]["draft_dir"] = {"string_value": str(short)}
    with pytest.raises(InferenceServerException) as e:
        client.load_model("lightspec_alt", config=json.dumps(cfg))
    assert f"draft_dir={str(short)!r}: the draft model's max_position_embeddings={served // 2}" in str(e.value)
    assert not client.is_model_ready("lightspec_alt") and client.is_model_ready("lightspec_draft")


# ---- cancellation and metrics -------------------------------------------------------------------


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_cancelled_stream_frees_its_request_and_kv_blocks(server):
    before = metrics(server)
    aborts_before = metric(before, "request_success_total", finished_reason="abort")
    client = grpcclient.InferenceServerClient(server.grpc_url)
    received = []
    client.start_stream(callback=lambda result, error: received.append((result, error)))
    client.async_stream_infer(
        "lightspec", grpc_inputs(text_input=PROMPT, max_tokens=1000, ignore_eos=True, stream=True)
    )
    assert wait_for(lambda: metric(metrics(server), "num_requests_running") == 1, timeout=60)
    assert metric(metrics(server), "kv_cache_usage_ratio") > 0
    assert wait_for(lambda: len(received) > 2, timeout=60)
    client.stop_stream(cancel_requests=True)
    client.close()
    # counted as vLLM counts a cancelled request: finished, with finished_reason="abort" (the
    # finished-request counters are published last, after the gauges: wait for the count)
    aborted = lambda: metric(metrics(server), "request_success_total", finished_reason="abort")
    assert wait_for(lambda: aborted() >= aborts_before + 1, timeout=30)
    after = metrics(server)
    assert metric(after, "num_requests_running") == 0
    assert metric(after, "kv_cache_usage_ratio") == 0
    assert metric(after, "request_success_total", finished_reason="abort") == aborts_before + 1
    assert len(received) < 999
    # and the server still serves
    (_result,), err = grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=4)
    assert err is None


def test_lightspec_metrics_are_exported(server):
    grpc_generate(server.grpc_url, text_input=PROMPT, max_tokens=12, stream=True)
    values = wait_for(lambda: (v := metrics(server)) and metric(v, "num_requests_running") == 0 and v)
    for name in (
        "spec_decode_num_draft_tokens_total",
        "spec_decode_num_accepted_tokens_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_ratio",
        "kv_cache_fragmentation_ratio",
        "generation_tokens_total",
        "prompt_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "mean_acceptance_length",
    ):
        metric(values, name, model="lightspec", engine="0")
    metric(values, "spec_decode_num_accepted_tokens_per_pos_total", position="0")
    for histogram in (
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
        "scheduler_decision_seconds",
        "scheduler_decision_cpu_seconds",
        "draft_tokens_per_step",
    ):
        assert metric(values, f"{histogram}_count") > 0, histogram
        # the real histograms and the binned ones (counter series) alike
        assert metric(values, f"{histogram}_bucket", le="+Inf") == metric(values, f"{histogram}_count"), histogram
    assert metric(values, "stage_latency_seconds_count", stage="target") > 0
    assert metric(values, "generation_tokens_total") >= 12


def load_variant(server: TritonServer, **parameters):
    """Load ``lightspec_alt``: the ``lightspec`` config with some parameters changed. It shares the
    stage models (and so their KV pools) with ``lightspec``: use one of the two at a time."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    cfg = client.get_model_config("lightspec", as_json=True)["config"]
    cfg["name"] = "lightspec_alt"  # a model directory that exists in the repository
    cfg["parameters"].update({k: {"string_value": v} for k, v in parameters.items()})
    client.load_model("lightspec_alt", config=json.dumps(cfg))
    return client


def test_metrics_off_exports_no_families(server):
    client = load_variant(server, metrics="off")
    try:
        assert client.is_model_ready("lightspec_alt")
        assert not [k for k in metrics(server) if 'model="lightspec_alt"' in k]
    finally:
        client.unload_model("lightspec_alt")


def alt_streams_match_the_engine(server, reference, prompts: list[str], max_tokens: int) -> None:
    """Concurrent greedy streams to ``lightspec_alt``, each equal to the in-process engine's text."""
    outs = {}

    def run(p):
        outs[p] = grpc_generate(
            server.grpc_url, model="lightspec_alt", text_input=p, max_tokens=max_tokens, stream=True
        )

    threads = [threading.Thread(target=run, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for p in prompts:
        results, err = outs[p]
        assert err is None and "".join(texts(results)) == greedy(reference, p, max_tokens)


def test_pipeline_depth_two_over_bls_matches_the_engine(server, reference):
    client = load_variant(server, pipeline_depth="2")
    try:
        alt_streams_match_the_engine(server, reference, [f"def g{i}(a, b):" for i in range(4)], 10)
    finally:
        client.unload_model("lightspec_alt")


def test_fused_mtp_over_bls_matches_the_engine(server, reference):
    """``mtp: fused``: the target stage proposes the next drafts with every step; streamed
    greedy output is still the engine's, and the drafts are counted as fused."""
    client = load_variant(server, mtp="fused", policy="static:3")
    try:
        alt_streams_match_the_engine(server, reference, [f"def h{i}(x):" for i in range(3)], 12)
        values = wait_for(
            lambda: (v := metrics(server)) and metric(v, "num_requests_running", model="lightspec_alt") == 0 and v
        )
        drafts = metric(values, "spec_decode_num_draft_tokens_total", model="lightspec_alt")
        assert drafts > 0 and metric(values, "spec_decode_num_fused_drafts_total", model="lightspec_alt") == drafts
    finally:
        client.unload_model("lightspec_alt")


# ---- command line ---------------------------------------------------------------------------------


def test_cli_generate_streams_text_and_prints_stats(server, reference, capsys):
    assert cli.main(["generate", PROMPT, "--url", server.grpc_url, "--max-tokens", "10"]) == 0
    out, err = capsys.readouterr()
    assert out.rstrip("\n") == greedy(reference, PROMPT, 10)
    assert "10 tokens in" in err and "tokens/s" in err and "acceptance rate" in err


def test_cli_generate_reports_invalid_arguments(server, capsys):
    assert cli.main(["generate", PROMPT, "--url", server.grpc_url, "--max-tokens", "0"]) == 1
    assert "max_tokens=0" in capsys.readouterr().err
