"""``SamplingParams.return_perf_metrics``: TensorRT-LLM's request perf metrics on every delta."""

from __future__ import annotations

import time

from lightspec_core import EngineConfig, LLMEngine, SamplingParams


def _deltas(eng: LLMEngine, rid: str, prompt: str, params: SamplingParams) -> list:
    eng.add_request(rid, prompt, params)
    out = []
    while eng.has_unfinished():
        out += [d for d in eng.step() if d.request_id == rid]
    return out


def test_perf_metrics_give_kv_blocks_and_monotonic_times(smoke_model):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), block_size=8, speculation="ngram"))
    try:
        prompt = "def add(a, b):\n    return a + b\n\n" * 4
        n_prompt = len(eng.tok.encode(prompt))
        params = SamplingParams(max_tokens=12, ignore_eos=True, return_perf_metrics=True)
        t0 = time.monotonic_ns()
        cold = _deltas(eng, "cold", prompt, params)
        t1 = time.monotonic_ns()
        assert all(d.perf is not None for d in cold)
        new, reused, total, arrival, scheduled, first, last = cold[-1].perf
        blocks = -(-(n_prompt + 12) // 8)
        assert (new, reused, total) == (blocks, 0, blocks)
        # CLOCK_MONOTONIC, TensorRT-LLM's steady clock, in the order a request lives them
        assert t0 <= arrival <= scheduled <= first <= last <= t1
        assert [d.perf[5] for d in cold] == [first] * len(cold)
        assert [d.perf[6] for d in cold] == sorted(d.perf[6] for d in cold)
        # the same prompt again: the prefix cache supplies every full block but the last token's, and
        # as TensorRT-LLM counts them, new and total are the blocks allocated beyond those
        warm = _deltas(eng, "warm", prompt, params)[-1].perf
        assert warm[1] == (n_prompt - 1) // 8 > 0
        assert warm[0] == warm[2] == blocks - warm[1]
        assert all(d.perf is None for d in _deltas(eng, "off", prompt, SamplingParams(max_tokens=4)))
    finally:
        eng.close()
