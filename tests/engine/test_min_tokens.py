"""min_tokens: the end tokens and stop strings cannot end a request early, and speculation stays
exact under the masked distribution (greedy output equals the masked-argmax reference)."""

from __future__ import annotations

import pytest
import torch

from lightspec_core import EngineConfig, LLMEngine, SamplingParams

PROMPT = "def parse_args(argv):\n    "
MIN_TOKENS = 14


def masked_argmax_reference(target_dir, prompt_ids: list[int], ends: set[int], min_tokens: int, max_tokens: int):
    """transformers' model, one full forward per token, end tokens at -inf below min_tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        for i in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            if i < min_tokens:
                logits[list(ends)] = float("-inf")
            tok = int(logits.argmax())
            ids.append(tok)
            out.append(tok)
            if i >= min_tokens and tok in ends:
                break
    return out


@pytest.fixture(scope="module")
def setup(default_model):
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation="none", policy="off"))
    try:
        plain = eng.generate([PROMPT], SamplingParams(max_tokens=40, ignore_eos=True))[0].output_token_ids
        prompt_ids = eng.tok.encode(PROMPT)
        eos = set(eng.model_config.eos_token_ids)
    finally:
        eng.close()
    end_id = plain[2]  # the unmasked greedy output would end at its third token
    ends = eos | {end_id}
    ref = masked_argmax_reference(default_model / "target", prompt_ids, ends, MIN_TOKENS, 40)
    assert len(ref) > MIN_TOKENS and not ends & set(ref[:MIN_TOKENS])
    return default_model, end_id, ref


@pytest.mark.parametrize(("method", "policy"), [("none", "off"), ("mtp", "static:3"), ("ngram", "dynamic"),
                                                ("draft", "static:4"), ("mtp", "dynamic")])  # fmt: skip
def test_greedy_min_tokens_equals_masked_argmax_reference(setup, method, policy):
    root, end_id, ref = setup
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), speculation=method, policy=policy))
    try:
        (out,) = eng.generate([PROMPT], SamplingParams(max_tokens=40, end_id=end_id, min_tokens=MIN_TOKENS))
        short = eng.generate([PROMPT], SamplingParams(max_tokens=40, end_id=end_id))[0]
        drafted = eng.stats.counters["spec_decode_num_draft_tokens_total"]
    finally:
        eng.close()
    assert out.output_token_ids == ref
    assert short.output_token_ids == ref[:2] + [end_id] or short.finish_reason == "stop"  # without: ends early
    assert len(short.output_token_ids) <= 3
    if method != "none":
        assert drafted > 0, "no draft was proposed: the test proves nothing about verification"


def test_stop_strings_do_not_match_before_min_tokens(default_model):
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation="ngram", policy="static:3"))
    try:
        free = eng.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True))[0]
        stop = free.text[:3]  # the very start of the completion
        early = eng.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop]))[0]
        late = eng.generate([PROMPT], SamplingParams(max_tokens=30, ignore_eos=True, stop=[stop], min_tokens=20))[0]
    finally:
        eng.close()
    assert early.text == "" and early.finish_reason == "stop"
    assert len(late.output_token_ids) >= 20 and late.output_token_ids[:20] == free.output_token_ids[:20]


def test_a_stop_string_completed_before_min_tokens_never_ends_the_request(default_model):
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation="none"))
    try:
        free = eng.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True))[0]
        stop = eng.tok.decode(free.output_token_ids[:2])  # completed by the second token
        assert stop and free.text.count(stop) == 1, "the stop string recurs: the check proves nothing"
        out = eng.generate([PROMPT], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop], min_tokens=3))[0]
    finally:
        eng.close()
    assert out.finish_reason == "length" and out.output_token_ids == free.output_token_ids


def test_sampled_requests_never_end_before_min_tokens(default_model):
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation="mtp", policy="static:3"))
    try:
        greedy = eng.generate([PROMPT], SamplingParams(max_tokens=8, ignore_eos=True))[0].output_token_ids
        end_id = greedy[0]  # likely under sampling too
        base = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, end_id=end_id) for s in range(12)]
        free = eng.generate([PROMPT] * 12, base)
        held = eng.generate([PROMPT] * 12, [SamplingParams(**{**p.__dict__, "min_tokens": 10}) for p in base])
    finally:
        eng.close()
    assert sum(len(o.output_token_ids) < 10 for o in free) >= 3, "end_id is too rare: the check proves nothing"
    for o in held:
        assert len(o.output_token_ids) > 10 and end_id not in o.output_token_ids[:10]
