"""The orchestrator's threads with a real engine (smoke model) and fake Triton requests: every request
gets exactly one FINAL response, bad input is INVALID_ARG, cancellation frees the engine, shutdown
answers whatever is still in flight."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
from lightspec_backend.bls import StageUnavailable
from lightspec_backend.client import input_array
from lightspec_backend.control import ControlDir
from lightspec_backend.metrics import MetricsReporter
from lightspec_backend.orchestrator import Orchestrator, take_turns

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from tests.fakes import FakePbUtils, FakeRequest, FakeSender


def request(**tensors) -> FakeRequest:
    return FakeRequest({k: input_array(k, v) for k, v in tensors.items()})


@pytest.fixture
def engine(smoke_model):
    e = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=64, block_size=16))
    yield e
    e.close()


@pytest.fixture
def served(engine):
    pb = FakePbUtils()
    orch = Orchestrator(
        engine,
        pb,
        MetricsReporter(pb, {"model": "lightspec", "version": "1"}),
        cancel_poll_s=0.01,
        metrics_interval_s=0.01,
    )
    yield orch, pb
    orch.shutdown(timeout_s=10)


def finals(req: FakeRequest) -> list:
    return [r for r, flags in req.sender.sent if flags & 1]


def test_stream_equals_non_stream_equals_engine(served, smoke_model):
    orch, _ = served
    prompt = "def fib(n):"
    stream = request(text_input=prompt, max_tokens=10, stream=True)
    whole = request(text_input=prompt, max_tokens=10, exclude_input_in_output=True)
    orch.submit(stream)
    orch.submit(whole)
    assert stream.sender.wait_final() and whole.sender.wait_final()
    reference = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=64))
    (want,) = reference.generate([prompt], SamplingParams(max_tokens=10))
    reference.close()
    assert len(whole.sender.sent) == 1
    assert stream.sender.text() == whole.sender.text() == want.text
    ids = np.concatenate([d["output_ids"] for d in stream.sender.data()]).tolist()
    assert ids == want.output_token_ids
    assert stream.sender.data()[-1]["finish_reason"][0] == b"length"


def test_add_special_tokens_reaches_the_engine(served, engine, monkeypatch):
    orch, _ = served
    seen = {}
    add = engine.add_request

    def recording(request_id, prompt, params, **kwargs):
        seen[prompt] = {k: v for k, v in kwargs.items() if k != "arrived_at"}
        add(request_id, prompt, params, **kwargs)

    monkeypatch.setattr(engine, "add_request", recording)
    bos, bare = (
        request(text_input="def a():", max_tokens=2),
        request(text_input="def b():", max_tokens=2, add_special_tokens=False),
    )
    for r in (bos, bare):
        orch.submit(r)
        assert r.sender.wait_final()
    assert seen == {"def a():": {"add_special_tokens": True}, "def b():": {"add_special_tokens": False}}


def test_response_threads_share_the_requests_and_keep_each_ones_order(engine, smoke_model):
    orch = Orchestrator(engine, FakePbUtils(), response_threads=3, cancel_poll_s=0.01)
    prompts = [f"def g{i}(x):" for i in range(12)]
    reqs = [request(text_input=p, max_tokens=8, stream=True) for p in prompts]
    try:
        for r in reqs:
            orch.submit(r)
        assert all(r.sender.wait_final() for r in reqs)
    finally:
        orch.shutdown(timeout_s=10)
    reference = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=64))
    want = reference.generate(prompts, SamplingParams(max_tokens=8))
    reference.close()
    for r, w in zip(reqs, want):
        assert len(finals(r)) == 1 and len(r.sender.threads) == 1  # one thread a request: in order
        assert np.concatenate([d["output_ids"] for d in r.sender.data()]).tolist() == w.output_token_ids
    assert len(set().union(*(r.sender.threads for r in reqs))) == 3


def test_non_streaming_text_starts_with_the_prompt_by_default(served):
    orch, _ = served
    r = request(text_input="x = ", max_tokens=3)
    orch.submit(r)
    assert r.sender.wait_final()
    assert r.sender.text().startswith("x = ")


def test_concurrent_requests_each_get_exactly_one_final(served):
    orch, _ = served
    reqs = [request(text_input=f"def f{i}(x):", max_tokens=6 + i % 4, stream=i % 2 == 0) for i in range(16)]
    for r in reqs:
        orch.submit(r)
    for r in reqs:
        assert r.sender.wait_final(60)
    time.sleep(0.1)
    for r in reqs:
        assert len(finals(r)) == 1 and r.sender.sends_after_final == 0
        assert r.sender.is_cancelled_after_final == 0
        assert not r.sender.final.has_error()
    assert orch.num_in_flight() == 0


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ({"max_tokens": 4}, "text_input"),
        ({"text_input": "a", "top_p": 2.0}, "top_p"),
        ({"text_input": b"\xff"}, "invalid UTF-8"),
        ({"text_input": "a", "max_tokens": 100_000}, "max_tokens"),
    ],
)
def test_invalid_input_is_invalid_arg(served, tensors, fragment):
    orch, pb = served
    r = request(**tensors)
    orch.submit(r)
    assert r.sender.wait_final(10)
    ((resp, _flags),) = r.sender.sent
    assert resp.error().code() == pb.TritonError.INVALID_ARG and fragment in resp.error().message()


def test_a_fault_while_parsing_still_answers_the_request_and_counts_it(served, monkeypatch):
    """An exception other than a parser's ValueError escaped submit: Triton answered with the
    traceback, and the failure was not counted."""
    from lightspec_backend import orchestrator

    orch, pb = served

    def fail(*args, **kwargs):
        raise OverflowError("int too large to convert to float")

    monkeypatch.setattr(orchestrator, "parse_request", fail)
    before = orch.engine.stats.snapshot()["request_failure_total"]
    r = request(text_input="a")
    orch.submit(r)
    assert r.sender.wait_final(10)
    err = r.sender.final.error()
    assert err.code() == pb.TritonError.INTERNAL and "OverflowError" in err.message()
    assert orch.engine.stats.snapshot()["request_failure_total"] == before + 1


def test_prompt_too_long_is_invalid_arg_from_the_engine(served, engine):
    orch, pb = served
    r = request(input_ids=[5] * (engine.max_model_len + 1), max_tokens=1)
    orch.submit(r)
    assert r.sender.wait_final(10)
    err = r.sender.final.error()
    assert err.code() == pb.TritonError.INVALID_ARG and err.message().startswith("input_ids: ")


def test_an_end_id_beyond_the_vocabulary_is_refused_and_its_batch_mates_finish(served, engine):
    orch, pb = served
    good = [request(text_input=f"def f{i}(x):", max_tokens=8, min_tokens=4) for i in range(3)]
    bad = request(text_input="def g():", max_tokens=8, min_tokens=4, end_id=engine.model_config.vocab_size)
    for r in [*good[:2], bad, good[2]]:
        orch.submit(r)
    assert all(r.sender.wait_final(30) for r in [*good, bad])
    err = bad.sender.final.error()
    assert err.code() == pb.TritonError.INVALID_ARG and err.message().startswith("end_id=")
    assert not any(r.sender.final.has_error() for r in good)


class BrokenSender(FakeSender):
    """A client connection that breaks at the second response."""

    def send(self, response=None, flags: int = 0) -> None:
        if len(self.sent) == 1 and not flags & 1:
            self.sent.append((None, 0))  # a slot, so the next send succeeds
            raise RuntimeError("the connection is gone")
        super().send(response, flags)


def test_a_failed_send_ends_the_request_with_a_final_error_and_stops_its_generation(served, engine):
    orch, pb = served
    r = request(text_input="def f(x):", max_tokens=900, ignore_eos=True, stream=True)
    r.sender = BrokenSender()
    orch.submit(r)
    assert r.sender.wait_final(30)
    err = r.sender.final.error()
    assert err.code() == pb.TritonError.INTERNAL and "sending a response failed" in err.message()
    deadline = time.monotonic() + 30
    while engine.has_unfinished() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.stats.snapshot()["request_success_total"]["abort"] == 1  # aborted, not run to 900 tokens
    after = request(text_input="def g():", max_tokens=4)
    orch.submit(after)
    assert after.sender.wait_final(30) and not after.sender.final.has_error()


def test_take_turns_covers_every_request_within_its_share_of_polls():
    items, turn, seen = list(range(10)), 0, []
    for _ in range(4):
        due, turn = take_turns(items, turn, 3)
        assert len(due) == 3
        seen += due
    assert set(seen[:10]) == set(items) and seen[10:] == [0, 1]
    assert take_turns(items[:2], 7, 3)[0] == [1, 0]  # fewer than n: each once
    assert take_turns([], 5, 3) == ([], 0)


def test_a_cancel_among_more_requests_than_the_poll_checks_is_found(engine):
    """Two checks a poll for six requests in flight: the cancelled one, last in turn, is found."""
    pb = FakePbUtils()
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01, cancel_checks_per_s=200)
    assert orch.cancel_checks_per_poll == 2
    reqs = [request(text_input=f"x{i} = ", max_tokens=400, stream=True, ignore_eos=True) for i in range(6)]
    try:
        for r in reqs:
            orch.submit(r)
        deadline = time.time() + 30
        while not all(r.sender.sent for r in reqs) and time.time() < deadline:
            time.sleep(0.005)
        reqs[-1].sender.cancel()
        assert reqs[-1].sender.wait_final(30)
        assert reqs[-1].sender.final.as_dict()["finish_reason"][0] == b"cancelled"
        assert not any(r.sender.final for r in reqs[:-1])  # the others still run
    finally:
        orch.shutdown(timeout_s=30)


def test_cancel_frees_the_request_and_zeroes_gauges(served, engine):
    orch, pb = served
    r = request(text_input="def f(x):", max_tokens=900, stream=True, ignore_eos=True)
    orch.submit(r)
    deadline = time.time() + 30
    while not r.sender.sent and time.time() < deadline:
        time.sleep(0.005)
    r.sender.cancel()
    assert r.sender.wait_final(30)
    last = r.sender.final.as_dict()
    assert last["finish_reason"][0] == b"cancelled"
    time.sleep(0.2)
    assert not engine.has_unfinished()
    assert pb.metric_value("vllm:num_requests_running") == 0
    assert pb.metric_value("vllm:kv_cache_usage_perc") == 0
    assert pb.metric_value("vllm:generation_tokens_total") > 0


def fail_second_step(engine, monkeypatch, error: Exception) -> None:
    """The engine's second step raises ``error``; every other step runs as usual."""
    real_step = engine.step
    calls = {"n": 0}

    def step(on_launched=None):
        calls["n"] += 1
        if calls["n"] == 2:
            raise error
        return real_step(on_launched)

    monkeypatch.setattr(engine, "step", step)


def test_time_to_first_token_counts_from_when_the_request_arrived_not_from_the_next_step(served, engine, monkeypatch):
    """vLLM counts from the request's arrival: one that arrives during a step waits for it, and that
    wait is part of what its client sees."""
    orch, pb = served
    real_step, slow = engine.step, 0.4

    def step(on_launched=None):
        def launched():  # the stages compute after the launch, as in a real step
            if on_launched is not None:
                on_launched()
            time.sleep(slow)

        return real_step(launched)

    monkeypatch.setattr(engine, "step", step)
    first = request(text_input="def f(x):", max_tokens=4, ignore_eos=True, stream=True)
    orch.submit(first)
    time.sleep(slow / 2)  # inside the first request's step now
    late = request(text_input="import os", max_tokens=1, stream=True)
    sent = time.perf_counter()
    orch.submit(late)
    assert late.sender.wait_final(30)
    seen = time.perf_counter() - sent
    assert first.sender.wait_final(30)
    family = pb.families["vllm:time_to_first_token_seconds"]
    ttfts = wait_for_observations(family, 2)
    assert seen > slow and max(ttfts) >= seen - 0.05, (seen, ttfts)


def wait_for_observations(family, n: int, timeout_s: float = 10.0) -> list[float]:
    deadline = time.monotonic() + timeout_s
    while True:
        seen = [o for m in family.metrics for o in m.observations]
        if len(seen) >= n or time.monotonic() > deadline:
            return seen
        time.sleep(0.02)


def test_step_failure_fails_in_flight_requests_and_keeps_serving(served, engine, monkeypatch):
    orch, pb = served
    fail_second_step(engine, monkeypatch, RuntimeError("boom"))
    first = request(text_input="a = 1", max_tokens=50, ignore_eos=True)
    orch.submit(first)
    assert first.sender.wait_final(30)
    assert first.sender.final.error().code() == pb.TritonError.INTERNAL
    second = request(text_input="b = 2", max_tokens=3)
    orch.submit(second)
    assert second.sender.wait_final(30) and not second.sender.final.has_error()
    stats = engine.stats.snapshot()  # the failed request is a failure, not a client's cancellation
    assert stats["request_failure_total"] == 1 and stats["request_success_total"]["abort"] == 0


def test_shutdown_answers_in_flight_requests(engine):
    pb = FakePbUtils()
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01)
    reqs = [request(text_input=f"x{i}", max_tokens=900, ignore_eos=True, stream=True) for i in range(4)]
    for r in reqs:
        orch.submit(r)
    time.sleep(0.2)
    orch.shutdown(timeout_s=30)
    for r in reqs:
        assert r.sender.wait_final(1)
        assert len(finals(r)) == 1
    late = request(text_input="late")
    orch.submit(late)  # after finalize began: answered, not dropped
    assert late.sender.wait_final(1)
    assert late.sender.final.error().code() == pb.TritonError.UNAVAILABLE


def test_a_request_whose_step_the_unload_failed_is_unavailable_model_unloaded(engine, monkeypatch):
    """Once the unload began, the stub refuses this model's BLS calls: a request whose step failed
    so ends as every other request of the unload does, not with the refusal's text."""
    orch = Orchestrator(engine, (pb := FakePbUtils()), None, cancel_poll_s=0.01)
    refused = (
        "stage failure: stage model 'lightspec_target' unavailable: "
        "BLS is only supported during the 'execute' function."
    )
    step = engine.step

    def step_while_unloading(*args, **kwargs):  # the drain's last step, its target call refused
        deltas = step(*args, **kwargs)
        if orch._stopping.is_set():
            deltas = [dataclasses.replace(d, finish_reason="error", error=refused) if d.finished else d for d in deltas]
        return deltas

    monkeypatch.setattr(engine, "step", step_while_unloading)
    r = request(text_input="x = 1", max_tokens=900, ignore_eos=True, stream=True)
    orch.submit(r)
    deadline = time.monotonic() + 30
    while not r.sender.sent and time.monotonic() < deadline:
        time.sleep(0.01)
    orch.shutdown(timeout_s=30)
    assert r.sender.wait_final(1) and len(finals(r)) == 1
    error = r.sender.final.error()
    assert (error.code(), error.message()) == (
        pb.TritonError.UNAVAILABLE,
        "the model was unloaded before the request finished",
    )


def test_step_failure_of_a_dead_stage_is_unavailable_naming_it(served, engine, monkeypatch):
    orch, pb = served
    fail_second_step(
        engine,
        monkeypatch,
        StageUnavailable("stage model 'lightspec_target' unavailable: Stub process is not healthy."),
    )
    first = request(text_input="a = 1", max_tokens=50, ignore_eos=True)
    orch.submit(first)
    assert first.sender.wait_final(30)
    assert first.sender.final.error().code() == pb.TritonError.UNAVAILABLE
    assert "lightspec_target" in first.sender.final.error().message()


def test_drain_refuses_new_requests_finishes_in_flight_and_marks_drained(engine, tmp_path):
    pb, control = FakePbUtils(), ControlDir(tmp_path)
    control.reset()
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01, control=control)
    try:
        running = request(text_input="x = 1", max_tokens=30, ignore_eos=True, stream=True)
        orch.submit(running)
        control.request_drain(grace_s=60)
        time.sleep(0.1)  # a few watcher polls
        late = request(text_input="late", max_tokens=4)
        orch.submit(late)
        assert late.sender.wait_final(5)
        assert late.sender.final.error().code() == pb.TritonError.UNAVAILABLE
        assert "shutting down" in late.sender.final.error().message()
        assert running.sender.wait_final(60) and not running.sender.final.has_error()
        assert sum(len(d["output_ids"]) for d in running.sender.data()) == 30
        deadline = time.monotonic() + 5
        while not control.is_drained() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert control.is_drained()
    finally:
        orch.shutdown(timeout_s=10)


def test_drain_deadline_cancels_what_is_still_running(engine, tmp_path):
    pb, control = FakePbUtils(), ControlDir(tmp_path)
    control.reset()
    orch = Orchestrator(engine, pb, None, cancel_poll_s=0.01, control=control)
    try:
        reqs = [request(text_input=f"x{i}", max_tokens=900, ignore_eos=True, stream=True) for i in range(3)]
        for r in reqs:
            orch.submit(r)
        time.sleep(0.1)
        t0 = time.monotonic()
        control.request_drain(grace_s=0.3)
        for r in reqs:
            assert r.sender.wait_final(5) and len(finals(r)) == 1
            assert r.sender.final.error().code() == pb.TritonError.CANCELLED
        assert time.monotonic() - t0 < 3
        assert engine.stats.snapshot()["kv_cache_usage_ratio"] == 0
    finally:
        orch.shutdown(timeout_s=10)
