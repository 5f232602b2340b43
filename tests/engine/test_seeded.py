"""A request with a seed samples the same output whatever the speculation, its batch and the pool."""

from __future__ import annotations

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from tests.engine.test_engine import heldout_prompts, run

SEEDED = [SamplingParams(max_tokens=40, temperature=0.8, top_k=k, seed=1000 + i, ignore_eos=True) for i, k in
          enumerate([0, 0, 20, 0])]  # fmt: skip


@pytest.fixture(scope="module")
def seeded_setup(default_model):
    prompts = heldout_prompts(4)
    alone, _ = run(default_model, prompts, SEEDED, speculation="none", policy="off")
    return default_model, prompts, [o.output_token_ids for o in alone]


@pytest.mark.parametrize(
    "kw",
    [
        {"speculation": "ngram", "policy": "dynamic"},
        {"speculation": "draft", "policy": "static:3"},
        {"speculation": "mtp", "policy": "dynamic"},
        {"speculation": "mtp", "policy": "static:2", "mtp": "fused", "pipeline_depth": 2},
        {"speculation": "mtp", "policy": "static:3", "num_kv_blocks": 24, "block_size": 8},
    ],
    ids=["ngram", "draft", "mtp", "mtp-fused-depth-2", "mtp-tiny-pool"],
)
def test_a_seeded_request_samples_as_without_speculation_beside_other_requests(seeded_setup, kw):
    """Its tokens come from noise keyed by seed and position (verify_coupled): neither the drafts it
    verified, nor greedy, unseeded or other seeded requests sharing its steps, nor a preemption and
    recompute change them. Requests of another seed still sample something else."""
    root, prompts, alone = seeded_setup
    crowd = [
        SamplingParams(max_tokens=30, ignore_eos=True),  # greedy
        SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),  # sampled, unseeded
    ]
    outs, eng = run(root, prompts + prompts[:2], SEEDED + crowd, **kw)
    assert [o.output_token_ids for o in outs[:4]] == alone
    assert sum(o.num_accepted_tokens for o in outs[:4]) > 0, "no draft of a seeded request was accepted"
    if "num_kv_blocks" in kw:
        assert eng.scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"
    reseeded = [SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True)] * 4
    other, _ = run(root, prompts, reseeded, **kw)
    assert [o.output_token_ids for o in other] != alone


def test_an_unseeded_request_on_the_mtp_stage_draws_as_without_a_seeded_neighbour(default_model):
    """A seeded request's call to the MTP stage carries noise (MTPCall.noise); the other sampled rows
    of that call still draw their drafts by their own uniforms, so they do not change with it."""
    prompts = heldout_prompts(2)
    unseeded = SamplingParams(max_tokens=30, temperature=0.9, ignore_eos=True)
    cfg = EngineConfig(model_dir=str(default_model / "target"), speculation="mtp", policy="static:3")
    outs = []
    for neighbour in (None, SEEDED[0]):
        eng = LLMEngine(cfg)
        try:
            ids = [eng.tok.encode(p) for p in prompts[: 1 + (neighbour is not None)]]
            # the same request id: the unseeded request's generator is seeded from it
            eng.add_request("unseeded", ids[0], unseeded)
            if neighbour is not None:
                eng.add_request("seeded", ids[1], neighbour)
            got = {}
            while eng.has_unfinished():
                for d in eng.step():
                    got.setdefault(d.request_id, []).extend(d.new_token_ids)
            outs.append(got["unseeded"])
        finally:
            eng.close()
    assert outs[0] == outs[1]
