"""BLS executor and stage models, end to end through the fake pb_utils: the engine driven over
'BLS' produces exactly what the in-process engine produces, and stage failures surface as errors."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from lightspec_backend.bls import BLSExecutor, StageError, StageUnavailable, is_unavailable
from lightspec_backend.params import Role
from lightspec_backend.stage import StageModel

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.config import resolve_dirs
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
    """Through BLS (the stage profile fetched from the stage, which took it) as in process."""
    cfg = config(smoke_model, speculation, mtp)
    pb = stage_pb(cfg)
    stages = {"target": "lightspec_target", "mtp": "lightspec_mtp", "draft": "lightspec_draft"}
    remote = LLMEngine(cfg, executor=BLSExecutor(stages, pb))
    local = LLMEngine(cfg)
    params = SamplingParams(max_tokens=12)
    try:
        got = remote.generate(PROMPTS, params)
        want = local.generate(PROMPTS, params)
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
    from lightspec_backend.params import StageThreads

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
