"""Sampled speculative output follows the target distribution (chi-square, fixed seeds).

For a fixed prompt, max_tokens=3: token 1 comes from the prefill, token 2 is the first token that
speculation can touch (one draft verified by rejection sampling or by the race), token 3 is the bonus. The joint
distribution of (token 1, token 2) over many requests is compared with the exact one
computed from the target model with the same temperature / top-k transform.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.models.llama import LlamaModel
from lightspec_core.spec.sampling import probs_from_logits

pytestmark = pytest.mark.slow  # thousands of seeded requests; runs in CI like every test

PROMPT = "for x in range(10):\n    for y in range(x):\n        print(x, y)\n    for"


def exact_joint(model: LlamaModel, prompt_ids: list[int], temperature: float, top_k: int) -> np.ndarray:
    v = model.config.vocab_size

    def probs(batch: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            logits = model.lm_head(model.forward_train(batch)[:, -1])
        n = logits.shape[0]
        return probs_from_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.ones(n))

    p1 = probs(torch.tensor([prompt_ids]))[0]
    cand = torch.nonzero(p1 > 1e-4).flatten()  # first tokens worth a row; the rest share one cell
    ext = torch.cat([torch.tensor(prompt_ids).repeat(len(cand), 1), cand.unsqueeze(1)], 1)
    p2 = probs(ext)  # [C, V]
    joint = torch.zeros(v, v, dtype=torch.float64)
    joint[cand] = p1[cand].double().unsqueeze(1) * p2.double()
    return joint.numpy(), cand.numpy(), float(p1.double().sum() - p1[cand].double().sum())


@pytest.mark.parametrize("method", ["mtp", "ngram", "draft"])
@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (1.0, 5)])
@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_speculative_sampling_matches_target_distribution(default_model, method, temperature, top_k, seeded):
    """Seeded requests are verified by the race with their keyed noise (verify_coupled), the others
    by rejection sampling with their generator (seeded from the engine seed and the request id)."""
    target = LlamaModel.load(default_model / "target")
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(default_model / "target"),
            speculation=method,
            policy="static:2",
            max_num_seqs=128,
            max_num_batched_tokens=4096,
        )
    )
    prompt_ids = eng.tok.encode(PROMPT)
    n = 3000
    # Greedy requests share the batches (every 10th request): only the sampled rows' logits come
    # back from the target, and the greedy ones must still follow the target's argmax.
    params = []
    for i in range(n):
        if i % 10 == 0:
            params.append(SamplingParams(max_tokens=3, ignore_eos=True))
        seed = i if seeded else None
        params.append(SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=seed, ignore_eos=True))
    every = eng.generate([prompt_ids] * len(params), params)
    outs = [o for o, p in zip(every, params) if not p.greedy]
    greedy = [o.output_token_ids for o, p in zip(every, params) if p.greedy]
    with torch.no_grad():
        t1 = int(target.lm_head(target.forward_train(torch.tensor([prompt_ids]))[0, -1]).argmax())
        t2 = int(target.lm_head(target.forward_train(torch.tensor([prompt_ids + [t1]]))[0, -1]).argmax())
    assert len(outs) == n and len(greedy) == n // 10
    assert all(g[:2] == [t1, t2] for g in greedy)
    assert sum(o.num_draft_tokens for o in outs) >= 100, "speculation must touch token 2"
    assert sum(o.num_accepted_tokens for o in outs) >= 20, "some drafts must be accepted"
    joint, rows, rest = exact_joint(target, prompt_ids, temperature, top_k)
    v = joint.shape[0]
    counts = np.zeros((v, v))
    for o in outs:
        counts[o.output_token_ids[0], o.output_token_ids[1]] += 1
    known = np.zeros(v, bool)
    known[rows] = True
    if top_k:
        assert counts[known][joint[known] == 0].sum() == 0, "sampled a pair outside the target's top-k"
    # chi-square over the joint cells with enough expected mass; everything else in one cell
    expected = joint[known].flatten() * n
    observed = counts[known].flatten()
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum() + counts[~known].sum())
    exp = np.append(expected[big], expected[~big].sum() + rest * n)
    assert big.sum() >= 5, "too few populated cells for a meaningful test"
    assert chisquare(obs, exp * obs.sum() / exp.sum()).pvalue > 1e-3


def test_float32_extremes_of_temperature_and_top_p_have_greedys_limit_or_are_refused():
    """The stages carry temperature and top_p as float32: a value float32 rounds to 0 must mean
    greedy's limit everywhere (it made the MTP proposer index probabilities it never asked for, and
    top_p NaN rows), and a temperature beyond float32 (inf there) is refused."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.0]])
    onehot = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    tiny = torch.tensor([1e-46], dtype=torch.float32)  # 0 in float32
    one = torch.tensor([1.0])
    assert torch.equal(probs_from_logits(logits, one, torch.tensor([0]), tiny), onehot)
    assert SamplingParams(temperature=1e-46).greedy and not SamplingParams(temperature=1e-44).greedy
    with pytest.raises(ValueError, match=r"^temperature=1e\+39: must be a finite number >= 0 and <= 3\.402823e\+38"):
        SamplingParams(temperature=1e39)


@pytest.mark.parametrize("speculation", ["mtp", "none"])
def test_a_temperature_or_top_p_that_is_zero_in_float32_decodes_greedily_beside_others(default_model, speculation):
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation=speculation, policy="static:2"))
    try:
        greedy = SamplingParams(max_tokens=12, ignore_eos=True)
        tiny_t = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1e-46, seed=1)
        tiny_p = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, top_p=1e-46, seed=1)
        outs = eng.generate(["def f(x):"] * 3, [greedy, tiny_t, tiny_p])
    finally:
        eng.close()
    assert [o.finish_reason for o in outs] == ["length"] * 3
    assert outs[1].output_token_ids == outs[0].output_token_ids == outs[2].output_token_ids
