"""The engine with its stage runners on a CUDA GPU (``device="cuda"``, what a ``KIND_GPU`` stage
instance uses). Marked ``gpu`` and skipped where torch sees no CUDA device: the CI machine has none,
so these run only on a GPU machine (``pytest -m gpu``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.stages.contract import MTPCall
from lightspec_core.stages.mtp import MTPRunner
from lightspec_core.stages.target import ModelRunner
from tests.models.factories import CASES, save_hf_checkpoint
from tests.models.test_llama import max_diff_against_transformers
from tools.bench_engine import code_prompts
from tools.bench_runner import step_call

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)"),
]


def generate(root, prompts, params, **kw):
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), device="cuda", **kw))
    try:
        outs = eng.generate(prompts, params)
        assert eng.blocks.usage() == 0.0, "blocks leaked after all requests ended"
        return outs
    finally:
        eng.close()


def test_target_step_on_gpu_matches_cpu(default_model):
    """One packed verification step (8 requests x 5 tokens over 100 cached positions): the same top-1
    tokens and, to float tolerance, the same hidden states on both devices."""
    call = step_call(8, 5, 100, 16, 4096, np.random.default_rng(0))
    target = default_model / "target"
    cpu = ModelRunner(target, num_blocks=8 * 7, block_size=16).execute(call)
    gpu = ModelRunner(target, num_blocks=8 * 7, block_size=16, device="cuda").execute(call)
    assert np.abs(gpu.hidden - cpu.hidden).max() < 1e-3
    assert (gpu.top1_ids == cpu.top1_ids).mean() > 0.99  # a near-tie may flip between devices, not more


@pytest.mark.parametrize("case", CASES)
def test_every_family_on_gpu_equals_transformers_on_gpu(case, tmp_path):
    """The checks of tests/models/test_llama.py (packed prefills, a rolled-back verification, a lone
    decode row over scattered blocks) with the runner and transformers both on the GPU."""
    model_type, overrides, saving = CASES[case]
    model_dir = save_hf_checkpoint(tmp_path / case, model_type, overrides, **saving)
    diff = max_diff_against_transformers(model_dir, device="cuda")
    print(f"{case}: max |logit difference| on cuda {diff:.2e}")
    assert diff < 1e-3  # fp32 on both sides; GPU reduction orders differ from each other, not by more


def test_mtp_heads_on_gpu_match_cpu(default_model):
    b, k = 16, 4
    rng = np.random.default_rng(1)
    call = MTPCall(
        hidden=rng.standard_normal((b, 256)).astype(np.float32),
        last_ids=rng.integers(3, 4096, b),
        num_tokens=np.array([k, 1, 0, 3] * 4, np.int32),
        temperature=np.zeros(b, np.float32),
        top_k=np.zeros(b, np.int32),
        top_p=np.ones(b, np.float32),
        uniforms=np.zeros((b, k), np.float32),
        return_probs=np.array([False]),
    )
    args = (default_model / "target", default_model / "mtp")
    cpu, gpu = MTPRunner(*args).execute(call), MTPRunner(*args, device="cuda").execute(call)
    assert (gpu.draft_ids == cpu.draft_ids).mean() > 0.95
    assert ((gpu.draft_ids >= 0) == (call.num_tokens[:, None] > np.arange(k))).all()


@pytest.mark.parametrize("method", ["mtp", "draft", "ngram"])
def test_greedy_speculation_on_gpu_is_lossless(default_model, method):
    prompts = code_prompts(8)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref = generate(default_model, prompts, params, speculation="none", policy="off")
    for policy in ("static:3", "dynamic"):
        outs = generate(default_model, prompts, params, speculation=method, policy=policy)
        assert [o.output_token_ids for o in outs] == [o.output_token_ids for o in ref], (method, policy)
        if policy.startswith("static"):
            assert sum(o.num_accepted_tokens for o in outs) > 0, "no draft accepted: the test proves nothing"


def test_sampled_speculation_on_gpu_is_reproducible(default_model):
    """Rejection sampling on the GPU: a seeded request gives the same tokens twice, and drafts are
    both accepted and rejected (the test exercises the sampling path, not only argmax)."""
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=7, ignore_eos=True)
    prompts = code_prompts(4)
    a = generate(default_model, prompts, params, speculation="mtp", policy="static:3")
    b = generate(default_model, prompts, params, speculation="mtp", policy="static:3")
    assert [o.output_token_ids for o in a] == [o.output_token_ids for o in b]
    drafted, accepted = sum(o.num_draft_tokens for o in a), sum(o.num_accepted_tokens for o in a)
    assert 0 < accepted < drafted
