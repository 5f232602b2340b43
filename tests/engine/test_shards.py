"""EngineShards: several engine processes answer as one engine does, split the requests and the
threads between them, and report their statistics as one."""

from __future__ import annotations

import os
import signal

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.engine.shards import EngineShards, merge_snapshots
from tests.engine.test_process import PROMPTS, drive, steps_until_done


@pytest.fixture(scope="module")
def shards(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", policy="dynamic")
    engine = EngineShards(cfg, 2, threads=2)
    yield engine, cfg
    engine.close()


def test_greedy_outputs_equal_one_engine_and_both_shards_serve(shards):
    engine, cfg = shards
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompts = PROMPTS * 2
    engine.add_request("0", prompts[0], params)
    assert engine._threads == [2, 2]  # alone at work: every thread
    got = {"0": []}
    for i, p in enumerate(prompts[1:], 1):
        engine.add_request(str(i), p, params)
        got[str(i)] = []
    assert engine._threads == [1, 1]  # both at work: one thread each
    while engine.has_unfinished():
        for d in engine.step():
            got[d.request_id].extend(d.new_token_ids)
    local = LLMEngine(cfg)
    try:
        want = local.generate(prompts, params)
    finally:
        local.close()
    assert [got[str(i)] for i in range(len(prompts))] == [o.output_token_ids for o in want]
    per_shard = [s.stats.snapshot()["request_success_total"]["length"] for s in engine.shards]
    assert all(n > 0 for n in per_shard) and sum(per_shard) == len(prompts)
    merged = engine.stats.snapshot()
    assert merged["request_success_total"]["length"] == sum(per_shard)
    assert merged["generation_tokens_total"] == sum(
        s.stats.snapshot()["generation_tokens_total"] for s in engine.shards
    )
    assert merged["spec_decode_num_draft_tokens_total"] > 0
    assert len(set(engine.pids)) == 2


def test_an_abort_reaches_the_shard_that_holds_the_request(shards):
    engine, _ = shards
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    got = drive(engine, {"keep": (PROMPTS[0], params), "drop": (PROMPTS[1], params)}, abort="drop")
    assert got["drop"][1][-1].finish_reason == "cancelled" and len(got["drop"][0]) < 64
    assert got["keep"][1][-1].finish_reason == "length" and len(got["keep"][0]) == 64


def test_a_bad_prompt_is_refused_naming_the_field_and_counted_once(shards):
    engine, _ = shards
    before = engine.stats.snapshot()["request_failure_total"]
    with pytest.raises(ValueError, match="prompt: empty prompt"):
        engine.add_request("empty", "", SamplingParams())
    assert engine.stats.snapshot()["request_failure_total"] == before + 1
    assert not engine.has_unfinished()
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        EngineShards(EngineConfig(), 0, threads=1)


def test_merged_statistics_sum_counts_average_ratios_and_recompute_the_acceptance_length():
    a = {
        "generation_tokens_total": 10,
        "request_success_total": {"stop": 1, "length": 2},
        "spec_decode_num_accepted_tokens_per_pos_total": [3, 1],
        "kv_cache_usage_ratio": 0.2,
        "spec_decode_num_steps_total": 4,
        "spec_decode_num_accepted_tokens_total": 4,
        "mean_acceptance_length": 2.0,
    }
    b = {
        "generation_tokens_total": 5,
        "request_success_total": {"stop": 0, "length": 1},
        "spec_decode_num_accepted_tokens_per_pos_total": [2, 2],
        "kv_cache_usage_ratio": 0.6,
        "spec_decode_num_steps_total": 1,
        "spec_decode_num_accepted_tokens_total": 3,
        "mean_acceptance_length": 4.0,
    }
    m = merge_snapshots([a, b])
    assert m["generation_tokens_total"] == 15
    assert m["request_success_total"] == {"stop": 1, "length": 3}
    assert m["spec_decode_num_accepted_tokens_per_pos_total"] == [5, 3]
    assert m["kv_cache_usage_ratio"] == pytest.approx(0.4)
    assert m["mean_acceptance_length"] == pytest.approx(1 + 7 / 5)
    # each engine's policy prices a draft token for its own batch: two engines' prices are not a sum
    prices = merge_snapshots(
        [
            {"policy_draft_cost_seconds": 0.002, "policy_step_overhead_seconds": 0.001},
            {"policy_draft_cost_seconds": 0.004, "policy_step_overhead_seconds": 0.003},
        ]
    )
    assert prices == pytest.approx({"policy_draft_cost_seconds": 0.003, "policy_step_overhead_seconds": 0.002})


def test_a_shard_whose_step_fails_fails_its_own_requests_and_the_other_shard_serves(smoke_model, failing_children):
    engine = EngineShards(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none"), 2, threads=2)
    try:
        engine.add_request("ok", PROMPTS[0], SamplingParams(max_tokens=48, ignore_eos=True))
        engine.add_request("fail", PROMPTS[1], SamplingParams(max_tokens=4))  # the other shard: fewer in flight
        assert engine._shard_of["ok"] is not engine._shard_of["fail"]
        finals = {d.request_id: d for d in steps_until_done(engine) if d.finished}
        assert finals["fail"].finish_reason == "error" and "the target stage failed" in finals["fail"].error
        assert finals["ok"].finish_reason == "length" and finals["ok"].error is None
        engine.add_request("after", PROMPTS[2], SamplingParams(max_tokens=4))
        assert [d.finish_reason for d in steps_until_done(engine) if d.finished] == ["length"]
    finally:
        engine.close()


def test_requests_go_to_a_live_shard_when_the_other_one_died(smoke_model):
    engine = EngineShards(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none"), 2, threads=2)
    try:
        dead = engine.shards[0]
        os.kill(dead.pid, signal.SIGKILL)
        dead._proc.wait(10)
        for i in range(3):
            engine.add_request(f"r{i}", PROMPTS[i], SamplingParams(max_tokens=4))
        finals = [d for d in steps_until_done(engine) if d.finished]
        assert sorted(d.finish_reason for d in finals) == ["length"] * 3, [d.error for d in finals]
    finally:
        engine.close()
