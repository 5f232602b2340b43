"""EngineProcess: the engine in a child process answers as the engine does in this one, refuses bad
prompts here, and a child that dies ends its requests, and later ones, with an error."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.engine.process import EngineProcess

PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(root):", "class Stack:\n    def push(self, x):"]


def drive(engine, requests: dict[str, tuple[str, SamplingParams]], abort: str | None = None) -> dict:
    """Add ``requests``, step until they end (aborting ``abort`` after the first step): rid -> (ids, deltas)."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out = {rid: ([], []) for rid in requests}
    steps = 0
    while engine.has_unfinished():
        for d in engine.step():
            out[d.request_id][0].extend(d.new_token_ids)
            out[d.request_id][1].append(d)
        steps += 1
        if steps == 1 and abort is not None:
            engine.abort(abort)
    return out


def steps_until_done(engine, timeout_s: float = 60.0) -> list:
    """Every delta until the engine has nothing unfinished; fails the test if it never gets there."""
    out: list = []

    def run():
        while engine.has_unfinished():
            out.extend(engine.step())

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout_s)
    assert not t.is_alive(), f"still waiting for unfinished requests after {timeout_s} s"
    return out


@pytest.fixture(scope="module")
def child(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", policy="dynamic")
    engine = EngineProcess(cfg, stats_interval_s=0.0)
    yield engine, cfg
    engine.close()


def test_greedy_outputs_equal_the_engine_in_this_process(child):
    engine, cfg = child
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    got = drive(engine, {str(i): (p, params) for i, p in enumerate(PROMPTS)})
    local = LLMEngine(cfg)
    try:
        want = local.generate(PROMPTS, params)
    finally:
        local.close()
    assert [got[str(i)][0] for i in range(len(PROMPTS))] == [o.output_token_ids for o in want]
    finals = [d for _, ds in got.values() for d in ds if d.finished]
    assert len(finals) == len(PROMPTS) and {d.finish_reason for d in finals} == {"length"}
    snapshot = engine.stats.snapshot()  # reported by the child with its last step
    assert snapshot["generation_tokens_total"] >= 24 * len(PROMPTS)
    assert snapshot["spec_decode_num_draft_tokens_total"] > 0
    names = {name for name, _, _ in engine.stats.drain_observations()}
    assert {"time_to_first_token_seconds", "e2e_request_latency_seconds"} <= names


def test_a_bad_prompt_is_refused_here_naming_the_field_and_counted(child):
    engine, _ = child
    before = engine.stats.snapshot()["request_failure_total"]
    with pytest.raises(ValueError, match=r"max_tokens=100000: prompt \(\d+ tokens\) \+ max_tokens exceeds"):
        engine.add_request("too-long", "def f():", SamplingParams(max_tokens=100_000))
    with pytest.raises(ValueError, match="prompt: empty prompt"):
        engine.add_request("empty", "", SamplingParams())
    assert engine.stats.snapshot()["request_failure_total"] == before + 2
    assert not engine.has_unfinished()


def test_latencies_count_from_when_the_server_took_the_request_not_when_the_child_read_it(child):
    engine, _ = child
    engine.stats.drain_observations()
    arrived = time.perf_counter() - 5.0  # taken 5 s ago (the same clock in every process)
    engine.add_request("waited", "def f():", SamplingParams(max_tokens=2, ignore_eos=True), arrived_at=arrived)
    steps_until_done(engine)
    got = {}
    for name, value, _ in engine.stats.drain_observations():
        got.setdefault(name, value)
    assert 5.0 <= got["time_to_first_token_seconds"] < 5.0 + 30
    assert got["request_queue_time_seconds"] >= 5.0 and got["e2e_request_latency_seconds"] >= 5.0


def test_an_aborted_request_ends_cancelled_and_the_others_finish(child):
    engine, _ = child
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    got = drive(engine, {"keep": (PROMPTS[0], params), "drop": (PROMPTS[1], params)}, abort="drop")
    assert got["drop"][1][-1].finish_reason == "cancelled" and len(got["drop"][0]) < 64
    assert got["keep"][1][-1].finish_reason == "length" and len(got["keep"][0]) == 64


def test_a_failed_step_forgets_every_request_even_one_aborted_just_before(smoke_model, failing_children):
    """The step that fails has taken an abort and built its final; the failure loses it. The
    caller fails and aborts what is in flight: none of it may be waited for after that."""
    engine = EngineProcess(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none"))
    try:
        engine.add_request("x", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
        engine.step()
        engine.abort("x")
        engine.add_request("fail", PROMPTS[1], SamplingParams(max_tokens=4))
        with pytest.raises(RuntimeError, match="the target stage failed"):
            while True:
                engine.step()
        for rid in ("x", "fail"):  # as the orchestrator does after a failed step
            engine.abort(rid)
        engine.add_request("after", PROMPTS[2], SamplingParams(max_tokens=4))
        finals = {d.request_id: d for d in steps_until_done(engine) if d.finished}
        assert finals["after"].finish_reason == "length"
        stats = engine.stats.snapshot()  # "x" was cancelled by its client; "fail" failed
        assert stats["request_failure_total"] == 1 and stats["request_success_total"]["abort"] == 1
    finally:
        engine.close()


def test_a_child_that_dies_fails_its_requests_and_every_later_one(smoke_model):
    exits: list[str] = []
    engine = EngineProcess(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none"),
                           on_exit=exits.append)  # fmt: skip
    try:
        engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=500, ignore_eos=True))
        engine.step()
        os.kill(engine.pid, signal.SIGKILL)
        finals = []
        while engine.has_unfinished():  # the deltas it sent before it died come first
            finals += [d for d in engine.step() if d.finished]
        assert exits == ["the engine process is unavailable: it exited (code -9)"]
        [failed] = finals
        assert (failed.request_id, failed.finish_reason, failed.error) == ("a", "error", exits[0])
        engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=4))
        [later] = engine.step()
        assert later.request_id == "b" and later.finish_reason == "error" and "exited" in later.error
        assert not engine.has_unfinished() and len(exits) == 1
    finally:
        engine.close()


@pytest.mark.parametrize("shards", [1, 2])
def test_a_hung_child_is_killed_after_the_stall_timeout_and_fails_its_requests(smoke_model, shards):
    """A child that stops answering (a deadlock; here SIGSTOP) while it holds requests: they end
    UNAVAILABLE-tagged after stall_timeout_s, the fault is reported once, the child is gone; with
    two shards the other one serves on."""
    from lightspec_core.engine.shards import EngineShards

    exits: list[str] = []
    config = EngineConfig(model_dir=str(smoke_model / "target"), speculation="none")
    if shards == 1:
        engine = EngineProcess(config, on_exit=exits.append, stall_timeout_s=2.0)
        hung = engine
    else:
        engine = EngineShards(config, 2, 2, on_exit=exits.append, stall_timeout_s=2.0)
        hung = engine.shards[0]
    try:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        for i in range(2 * shards):
            engine.add_request(f"r{i}", PROMPTS[i % len(PROMPTS)], params)
        engine.step()
        os.kill(hung.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        finals = [d for d in steps_until_done(engine, timeout_s=60) if d.finished]
        message = "the engine process is unavailable: it sent nothing in 2 s (hung: killed)"
        assert exits == [message] and hung._proc.poll() is not None
        failed = [d for d in finals if d.finish_reason == "error"]
        assert failed and all(d.error == message for d in failed) and time.monotonic() - t0 < 30
        assert len(finals) == 2 * shards and (shards == 1 or len(failed) < len(finals))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(hung.pid, signal.SIGCONT)
        engine.close()


def test_a_child_that_cannot_load_raises_its_error_and_reports_no_fault(tmp_path):
    exits: list[str] = []
    with pytest.raises(RuntimeError, match=r"the engine process failed to load: \w+Error: .*missing"):
        EngineProcess(EngineConfig(model_dir=str(tmp_path / "missing")), on_exit=exits.append)
    assert exits == []  # a load's error, not a fault for the supervisor to restart on


def test_a_child_that_dies_idle_is_reported_without_a_request(smoke_model):
    """An idle child is not read from; its exit is still reported at once, so a server restarts
    before a request is given to it. A child stopped by close() is no fault."""
    exits: list[str] = []
    config = EngineConfig(model_dir=str(smoke_model / "target"), speculation="none")
    engine = EngineProcess(config, on_exit=exits.append)
    try:
        os.kill(engine.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not exits and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exits == ["the engine process is unavailable: it exited (code -9)"]
    finally:
        engine.close()
    closed: list[str] = []
    EngineProcess(config, on_exit=closed.append).close()
    time.sleep(0.5)  # time for a wrong report from the watching thread
    assert closed == [] and len(exits) == 1


def test_a_min_tokens_beyond_the_rest_of_the_context_is_refused_here_not_failed_in_the_child(child):
    engine, _ = child
    with pytest.raises(ValueError, match=r"^min_tokens=5000: the context of \d+ tokens leaves \d+ after the prompt"):
        engine.add_request("greedy-min", "def f():", SamplingParams(max_tokens=None, min_tokens=5000))
    assert not engine.has_unfinished()
