"""BLS executor and stage models, end to end through the fake pb_utils: the engine driven over
'BLS' produces exactly what the in-process engine produces, and stage failures surface as errors."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
from lightspec_backend.bls import BLSExecutor, StageError, StageUnavailable, is_unavailable
from lightspec_backend.client import input_array
from lightspec_backend.orchestrator import Orchestrator
from lightspec_backend.params import Role
from lightspec_backend.stage import StageModel

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.config import SpecMethod, resolve_dirs
from lightspec_core.spec.calibrate import ProfileSpec
from lightspec_core.stages.contract import ModelCall
from lightspec_core.stages.mtp import MTPRunner
from lightspec_core.stages.target import ModelRunner
from tests.fakes import FakePbUtils, FakeRequest

BLOCKS, BLOCK = 64, 16
PROMPTS = ["def fib(n):", "import os\nimport sys\n", "class A:\n    def"]


def stage_pb(cfg: EngineConfig) -> FakePbUtils:
    """A fake server with the three stage models registered under their default names (the target
    stage with the MTP heads when the engine fuses them)."""
    target, mtp, draft = resolve_dirs(cfg)
    pb = FakePbUtils()
    heads = MTPRunner(target, mtp) if cfg.fused_mtp else None
    pb.models["lightspec_target"] = StageModel(Role.TARGET, ModelRunner(target, BLOCKS, BLOCK, heads=heads), pb)
    pb.models["lightspec_mtp"] = StageModel(Role.MTP, MTPRunner(target, mtp), pb)
    pb.models["lightspec_draft"] = StageModel(Role.DRAFT, ModelRunner(draft, BLOCKS, BLOCK), pb)
    return pb


def config(smoke_model, speculation: str, mtp: str = "lightspec_mtp") -> EngineConfig:
    return EngineConfig(
        model_dir=str(smoke_model / "target"), speculation=speculation, num_kv_blocks=BLOCKS, block_size=BLOCK, mtp=mtp
    )


@pytest.mark.parametrize(
    ("speculation", "mtp"), [("mtp", "lightspec_mtp"), ("mtp", "fused"), ("draft", "fused"), ("none", "fused")]
)
def test_engine_over_bls_matches_in_process_engine(smoke_model, speculation, mtp):
    """Through BLS (the stage profile fetched from the stage, which took it) as in process; the
    seeded sampled request's drafts are drawn with the noise the MTP call carries."""
    cfg = config(smoke_model, speculation, mtp)
    pb = stage_pb(cfg)
    stages = {"target": "lightspec_target", "mtp": "lightspec_mtp", "draft": "lightspec_draft"}
    remote = LLMEngine(cfg, executor=BLSExecutor(stages, pb))
    local = LLMEngine(cfg)
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.9, seed=3)] * 2
    try:
        got = remote.generate(PROMPTS + PROMPTS[:1], params)
        want = local.generate(PROMPTS + PROMPTS[:1], params)
    finally:
        remote.close()
        local.close()
    assert remote.cost.calibrated == local.cost.calibrated == (speculation != "none")
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert all(o.finish_reason in ("length", "stop") for o in got)


def test_stage_error_response_raises_stage_error():
    pb = FakePbUtils()
    ex = BLSExecutor({"target": "missing_model"}, pb)
    call = ModelCall(
        np.zeros(1, np.int64),
        np.zeros(1, np.int64),
        np.ones(1, np.int32),
        np.zeros((1, 1), np.int32),
        np.zeros(1, np.int64),
        np.array([False]),
        np.array([False]),
    )
    with pytest.raises(StageError, match="missing_model"):
        ex.submit("target", call).result(timeout=10)
    ex.close()


def test_unknown_stage_is_rejected():
    ex = BLSExecutor({"target": "t"}, FakePbUtils())
    with pytest.raises(ValueError, match="stage 'mtp'"):
        ex.submit("mtp", object())
    ex.close()


def test_stage_model_answers_missing_tensor_with_invalid_arg(smoke_model):
    pb = FakePbUtils()
    stage = StageModel(Role.TARGET, ModelRunner(smoke_model / "target", 4, 16), pb)
    (resp,) = stage.execute([FakeRequest({"input_ids": np.zeros(1, np.int64)})])
    assert resp.has_error() and resp.error().code() == pb.TritonError.INVALID_ARG
    assert "positions" in resp.error().message()


def test_stage_failure_finishes_requests_with_error(smoke_model):
    cfg = config(smoke_model, "none")
    pb = FakePbUtils()

    class Broken:
        def execute(self, requests):
            return [pb.InferenceResponse(error=pb.TritonError("out of memory", pb.TritonError.INTERNAL))]

    pb.models["lightspec_target"] = Broken()
    engine = LLMEngine(cfg, executor=BLSExecutor({"target": "lightspec_target"}, pb))
    (out,) = engine.generate(["x = 1"], SamplingParams(max_tokens=4))
    engine.close()
    assert out.finish_reason == "error" and "out of memory" in out.error


def test_stage_model_sets_torch_threads_by_call_size(smoke_model):
    """Small calls run on the small thread count, large ones on the large; the count is only set when
    it changes (``torch.set_num_threads`` is not free)."""
    from lightspec_backend.stage import StageThreads

    target, _, _ = resolve_dirs(config(smoke_model, "none"))
    pb = FakePbUtils()
    calls = []
    pb.models["t"] = StageModel(
        Role.TARGET,
        ModelRunner(target, BLOCKS, BLOCK),
        pb,
        threads=StageThreads(small=1, large=3, large_call_tokens=8),
        set_threads=calls.append,
    )
    ex = BLSExecutor({"target": "t"}, pb)

    def step(n):
        res = ex.submit(
            "target",
            ModelCall(
                np.arange(3, 3 + n, dtype=np.int64),
                np.arange(n, dtype=np.int64),
                np.array([n], np.int32),
                np.arange(2, dtype=np.int32).reshape(1, 2),
                np.array([n - 1], np.int64),
                np.array([False]),
                np.array([False]),
            ),
        ).result()
        assert res.top1_ids.shape == (1,)

    for n in (4, 5, 8, 20, 3):
        step(n)
    ex.close()
    assert calls == [1, 3, 1]


def test_bls_futures_carry_the_time_the_stage_answered(smoke_model):
    """The future of a BLS call is stamped (``t_done``) in the calling thread when the call returned,
    before its result is visible, so the engine's measure of the stage ends there."""
    import time

    target, _, _ = resolve_dirs(config(smoke_model, "none"))
    pb = FakePbUtils()
    pb.models["t"] = StageModel(Role.TARGET, ModelRunner(target, BLOCKS, BLOCK), pb)
    ex = BLSExecutor({"target": "t"}, pb)
    t0 = time.perf_counter()
    fut = ex.submit(
        "target",
        ModelCall(
            np.arange(3, 7, dtype=np.int64),
            np.arange(4, dtype=np.int64),
            np.array([4], np.int32),
            np.arange(2, dtype=np.int32).reshape(1, 2),
            np.array([3], np.int64),
            np.array([False]),
            np.array([False]),
        ),
    )
    assert fut.result().top1_ids.shape == (1,)
    assert t0 < fut.t_done <= time.perf_counter()
    ex.close()


def _one_token_call() -> ModelCall:
    one, zero = np.ones(1, np.int32), np.zeros(1, np.int64)
    return ModelCall(zero, zero, one, np.zeros((1, 1), np.int32), zero, np.array([False]), np.array([False]))


def test_dead_stage_stub_raises_stage_unavailable_and_reports_the_fault():
    pb = FakePbUtils()
    message = "Stub process 'lightspec_target_0_0' is not healthy."

    class DeadStub:
        def execute(self, requests):
            return [pb.InferenceResponse(error=pb.TritonError(message, pb.TritonError.INTERNAL))]

    pb.models["lightspec_target"] = DeadStub()
    faults = []
    ex = BLSExecutor({"target": "lightspec_target"}, pb, on_fault=lambda model, msg: faults.append((model, msg)))
    with pytest.raises(StageUnavailable) as e:
        ex.submit("target", _one_token_call()).result(timeout=10)
    ex.close()
    assert is_unavailable(str(e.value)) and "lightspec_target" in str(e.value) and message in str(e.value)
    assert faults == [("lightspec_target", str(e.value))]


def test_stage_call_past_the_stage_timeout_raises_stage_unavailable():
    pb = FakePbUtils()
    release = threading.Event()

    class Stalled:
        def execute(self, requests):
            release.wait(10)
            return [pb.InferenceResponse(error=pb.TritonError("late", pb.TritonError.INTERNAL))]

    pb.models["lightspec_target"] = Stalled()
    faults = []
    ex = BLSExecutor({"target": "lightspec_target"}, pb, stage_timeout_s=0.2, on_fault=lambda m, msg: faults.append(m))
    t0 = time.monotonic()
    with pytest.raises(StageUnavailable, match=r"no answer in 0.2 s"):
        ex.submit("target", _one_token_call()).result(timeout=10)
    assert time.monotonic() - t0 < 2 and faults == ["lightspec_target"]
    release.set()  # the late answer is dropped, not raised anywhere
    watchdog = ex._watchdog
    ex.close()
    watchdog.join(timeout=2)
    assert not watchdog.is_alive()  # a closed executor leaves no thread behind


def test_stage_error_that_is_not_a_dead_stub_stays_internal():
    assert not is_unavailable("stage failure: stage model 'lightspec_target': out of memory")


# ---- faults of the stages, the profile fetch and the unload ------------------------------------

SPEC = ProfileSpec(SpecMethod.MTP, 3, BLOCK, BLOCKS, 4, 256, 512, 64)
NOT_LOADED = "Request for unknown model: '{}' has no available versions"  # Triton 2.51's text
BLS_CLOSED = "BLS is only supported during the 'execute' function."  # the stub's, outside execute


class Scripted:
    """A stage model that answers each call with the next of ``answers`` (an error message, an
    exception to raise from ``exec()``, a stage model to pass the call to, or ``None``: a
    profile), the last one for ever."""

    def __init__(self, pb, *answers):
        self.pb, self.answers, self.calls = pb, list(answers), 0

    def execute(self, requests):
        answer = self.answers[min(self.calls, len(self.answers) - 1)]
        self.calls += 1
        if isinstance(answer, Exception):
            raise answer
        if isinstance(answer, str):
            return [self.pb.InferenceResponse(error=self.pb.TritonError(answer, self.pb.TritonError.INTERNAL))]
        if answer is not None:
            return answer.execute(requests)
        profile = json.dumps({"fixed": 1e-3, "per_draft": 2e-4, "per_depth": 3e-4}).encode()
        return [self.pb.InferenceResponse([self.pb.Tensor("profile", np.array([profile], dtype=object))])]


def scripted_executor(*answers, **kw):
    pb, faults = FakePbUtils(), []
    pb.models["lightspec_mtp"] = stage = Scripted(pb, *answers)
    ex = BLSExecutor({"mtp": "lightspec_mtp"}, pb, on_fault=lambda model, msg: faults.append(model), **kw)
    return ex, stage, faults


def test_profile_of_a_dead_stage_fails_at_once_and_reports_the_fault_once():
    ex, stage, faults = scripted_executor("Stub process 'lightspec_mtp_0_0' is not healthy.", load_wait_s=5)
    t0 = time.monotonic()
    with pytest.raises(StageUnavailable, match="is not healthy"):
        ex.profile("mtp", SPEC)
    ex.close()
    assert time.monotonic() - t0 < 2 and stage.calls == 1 and faults == ["lightspec_mtp"]


@pytest.mark.parametrize("answer", ["Request for unknown model: 'lightspec_mtp' is not found", "out of memory"])
def test_profile_of_a_missing_or_failing_stage_fails_at_once(answer):
    ex, stage, faults = scripted_executor(answer, load_wait_s=5)
    with pytest.raises(StageError, match=answer) as e:
        ex.profile("mtp", SPEC)
    ex.close()
    assert stage.calls == 1 and faults == [] and not is_unavailable(str(e.value))


def test_profile_waits_while_the_stage_loads_and_this_models_initialize_runs():
    not_loaded = NOT_LOADED.format("lightspec_mtp")
    starting = "Model lightspec_mtp - Error when running inference: Server not ready"  # the server's start-up
    ex, stage, faults = scripted_executor(starting, not_loaded, RuntimeError(BLS_CLOSED), not_loaded, None,
                                          load_wait_s=30)  # fmt: skip
    cost = ex.profile("mtp", SPEC)
    ex.close()
    assert (cost.fixed, cost.per_draft, stage.calls, faults) == (1e-3, 2e-4, 5, [])


def test_a_stage_not_loaded_within_the_wait_ends_the_requests_unavailable_naming_it(smoke_model):
    """The profile gives up after ``load_wait_s`` (the engine plans with generic costs); the
    requests' calls find the stage still not loaded and end UNAVAILABLE, naming it."""
    cfg = config(smoke_model, "mtp")
    pb = stage_pb(cfg)
    pb.models["lightspec_target"] = never = Scripted(pb, NOT_LOADED.format("lightspec_target"))
    faults = []
    ex = BLSExecutor(
        {"target": "lightspec_target", "mtp": "lightspec_mtp"},
        pb,
        load_wait_s=0.5,
        on_fault=lambda model, msg: faults.append(model),
    )
    engine = LLMEngine(cfg, executor=ex, profile_now=False)
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01)
    r = FakeRequest({"text_input": input_array("text_input", "def f():"), "max_tokens": input_array("max_tokens", 8)})
    t0 = time.monotonic()
    orch.submit(r)
    try:
        assert r.sender.wait_final(30)
    finally:
        orch.shutdown(10)
        engine.close()
    error = r.sender.final.error()
    assert error.code() == pb.TritonError.UNAVAILABLE and "'lightspec_target'" in error.message()
    assert time.monotonic() - t0 < 10 and never.calls < 20 and faults == []


def test_a_dead_proposer_stage_fails_its_step_only_and_reports_the_fault(smoke_model):
    """As a dead target stage: the requests of the step end UNAVAILABLE naming the stage, the
    fault reaches the supervisor, and the requests queued behind are served."""
    cfg = dataclasses.replace(config(smoke_model, "mtp"), policy="static:3", max_num_seqs=1)  # one a step
    pb = stage_pb(cfg)
    pb.models["lightspec_mtp"] = Scripted(
        pb, "Stub process 'lightspec_mtp_0_0' is not healthy.", pb.models["lightspec_mtp"]
    )  # dead once, then restarted
    faults = []
    ex = BLSExecutor(
        {"target": "lightspec_target", "mtp": "lightspec_mtp"}, pb, on_fault=lambda model, msg: faults.append(model)
    )
    engine = LLMEngine(cfg, executor=ex)
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01)
    reqs = [
        FakeRequest(
            {"text_input": input_array("text_input", f"def f{i}():"), "max_tokens": input_array("max_tokens", 8)}
        )
        for i in range(3)
    ]
    for r in reqs:
        orch.submit(r)
    try:
        assert all(r.sender.wait_final(30) for r in reqs)
    finally:
        orch.shutdown(10)
        engine.close()
    error = reqs[0].sender.final.error()
    assert error.code() == pb.TritonError.UNAVAILABLE and "'lightspec_mtp'" in error.message()
    assert [r.sender.final.has_error() for r in reqs[1:]] == [False, False] and faults == ["lightspec_mtp"]


def test_bls_refused_during_the_unload_is_unavailable_and_no_fault():
    """The stub raises from ``exec()`` once this model's finalize began: the stage is fine, this
    model is going away."""
    ex, _, faults = scripted_executor(RuntimeError(BLS_CLOSED))
    with pytest.raises(StageUnavailable, match="only supported during") as e:
        ex.submit("mtp", _one_token_call()).result(timeout=10)
    ex.close()
    assert is_unavailable(str(e.value)) and faults == []


def test_close_returns_while_a_stage_stalls_and_never_sends_calls_that_timed_out():
    pb = FakePbUtils()
    release, calls = threading.Event(), []

    class Stalled:
        def execute(self, requests):
            calls.append(1)
            release.wait(30)
            return [pb.InferenceResponse(error=pb.TritonError("late", pb.TritonError.INTERNAL))]

    pb.models["lightspec_target"] = Stalled()
    ex = BLSExecutor({"target": "lightspec_target"}, pb, stage_timeout_s=0.2)
    timed_out = [ex.submit("target", _one_token_call()) for _ in range(2)]  # the second queues behind
    for f in timed_out:
        with pytest.raises(StageUnavailable, match="no answer"):
            f.result(timeout=10)
    ex.stage_timeout_s = 60
    waiting = ex.submit("target", _one_token_call())  # queued, its deadline far away
    closing = threading.Thread(target=ex.close)
    closing.start()
    closing.join(2)
    try:
        assert not closing.is_alive(), "close() waited for the stalled stage"
        with pytest.raises(StageUnavailable, match="closed"):
            waiting.result(timeout=2)
    finally:
        release.set()
    time.sleep(0.3)  # the worker is free: nothing queued may reach the stage now
    assert len(calls) == 1
