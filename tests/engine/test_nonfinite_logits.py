"""Logits that are not finite (a broken checkpoint, an overflow in float16): a request whose target
logits are NaN or inf ends with an error at that output position, after the tokens it would have
had anyway, and the requests beside it are served token for token as without it. A proposer's
logits that are not finite only cost its drafts: the output stays exact."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightspec_core import EngineConfig, LLMEngine, SamplingParams

VICTIM = "def parse_args(argv):\n    parser = argparse.ArgumentParser(description=__doc__)\n    parser."
OTHERS = ["x = 1", "import os\n", "def f(a):"]  # short: they never reach the victim's poisoned position
AT = 5  # the victim's output position whose logits are poisoned
ERROR = f"the target model's logits are not finite (NaN or inf) at output position {AT}"
MAX_TOKENS = 12

GREEDY = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)  # rows come back as top-1 ids and the stage's word
GREEDY_LOGITS = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=MAX_TOKENS)  # rows come as logits
SAMPLED = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.8, seed=7)
OTHER_PARAMS = [GREEDY, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=3), GREEDY_LOGITS]


def poisoned(forward, rows, value):
    """``forward`` (a stage runner's ``_forward``) whose logits rows chosen by ``rows`` (positions of
    the token each sample row predicts -> bool mask) are overwritten by ``value(row logits)``."""

    def run(input_ids, positions, query_lens, block_tables, sample_indices):
        hidden, logits = forward(input_ids, positions, query_lens, block_tables, sample_indices)
        hit = rows(np.asarray(positions)[np.asarray(sample_indices)] + 1)
        if hit.any():
            with torch.inference_mode():
                logits = logits.clone()
                sel = torch.from_numpy(np.flatnonzero(hit))
                logits[sel] = value(logits[sel])
        return hidden, logits

    return run


def one_nan(rows: torch.Tensor) -> torch.Tensor:
    return rows.index_fill(1, torch.tensor([7]), math.nan)


def one_inf(rows: torch.Tensor) -> torch.Tensor:
    return rows.index_fill(1, torch.tensor([7]), math.inf)


def all_minus_inf(rows: torch.Tensor) -> torch.Tensor:
    return torch.full_like(rows, -math.inf)


def all_but_the_max_minus_inf(rows: torch.Tensor) -> torch.Tensor:
    """Masked as a vocabulary mask would: every token but the most likely at -inf."""
    return rows.masked_fill(rows < rows.amax(-1, keepdim=True), -math.inf)


def nan_logits(head):
    """An MTP head whose logits are all NaN."""

    def run(state, tok):
        state, logits = head(state, tok)
        return state, torch.full_like(logits, math.nan)

    return run


def serve(root, method: str, victim_params: SamplingParams, value=None):
    """(victim's output, the others' outputs, stats) of one batch; with ``value``, the target's
    logits that predict the victim's output token ``AT`` are poisoned with it."""
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(root / "target"),
            speculation=method,
            policy="off" if method == "none" else "static:3",
            profile_stages=False,
        )
    )
    try:
        victim = eng.tok.encode(VICTIM)
        assert len(victim) > max(len(eng.tok.encode(p)) for p in OTHERS) + MAX_TOKENS + 3
        if value is not None:
            runner = eng.executor.runners["target"]
            runner._forward = poisoned(runner._forward, lambda pos: pos == len(victim) + AT, value)
        outs = eng.generate([victim] + [eng.tok.encode(p) for p in OTHERS], [victim_params] + OTHER_PARAMS)
        assert eng.blocks.usage() == 0.0, "blocks leaked"
        return outs[0], outs[1:], eng.stats.snapshot()
    finally:
        eng.close()


@pytest.mark.parametrize("method", ["none", "ngram", "mtp", "draft"])
@pytest.mark.parametrize("victim_params", [GREEDY, GREEDY_LOGITS, SAMPLED], ids=["greedy", "greedy-logits", "sampled"])
def test_a_request_whose_target_logits_are_nan_fails_there_and_the_others_are_served_exactly(
    default_model, method, victim_params
):
    clean, clean_others, _ = serve(default_model, method, victim_params)
    out, others, stats = serve(default_model, method, victim_params, one_nan)
    assert (out.finish_reason, out.error) == ("error", ERROR)
    assert out.output_token_ids == clean.output_token_ids[:AT]  # what it would have had: as without drafts
    assert [o.output_token_ids for o in others] == [o.output_token_ids for o in clean_others]
    assert [o.finish_reason for o in others] == ["length"] * len(OTHERS)
    assert stats["request_failure_total"] == 1
    if method != "none":
        assert sum(o.num_draft_tokens for o in [out, *others]) > 0, "no draft proposed: the test proves nothing"


@pytest.mark.parametrize(
    ("value", "fails"),
    [(one_inf, True), (all_minus_inf, True), (all_but_the_max_minus_inf, False)],
    ids=["+inf", "no-finite-logit", "masked"],
)
@pytest.mark.parametrize("params", [GREEDY, GREEDY_LOGITS], ids=["top1", "logits"])
def test_inf_or_no_finite_logit_fails_the_request_but_minus_inf_beside_a_finite_logit_does_not(
    default_model, value, fails, params
):
    clean, clean_others, _ = serve(default_model, "ngram", params)
    out, others, _ = serve(default_model, "ngram", params, value)
    if fails:
        assert (out.finish_reason, out.error) == ("error", ERROR)
        assert out.output_token_ids == clean.output_token_ids[:AT]
    else:  # a masked vocabulary is no fault: the argmax stays where it was
        assert (out.finish_reason, out.output_token_ids) == ("length", clean.output_token_ids)
    assert [o.output_token_ids for o in others] == [o.output_token_ids for o in clean_others]


@pytest.mark.parametrize("policy", ["static:3", "dynamic"])  # dynamic: the confidence stop reads NaN confidences
@pytest.mark.parametrize("method", ["mtp", "draft"])
def test_proposer_logits_that_are_not_finite_only_cost_the_drafts(default_model, method, policy):
    """All of the proposer's logits NaN: its greedy drafts are some token, its sampled proposals
    NaN; verification rejects what the target disagrees with and draws from the target alone, so a
    top-k 1 sampled request (the target's argmax) emits the greedy tokens."""
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(default_model / "target"),
            speculation=method,
            policy=policy,
            mtp="local",
            profile_stages=False,
        )
    )  # local: every request drafts on the mtp stage
    try:
        prompts = [eng.tok.encode(p) for p in [VICTIM, *OTHERS]]
        want = [o.output_token_ids for o in eng.generate(prompts, GREEDY)]
        if method == "mtp":
            runner = eng.executor.runners["mtp"]
            runner.folded = [nan_logits(h) for h in runner.folded]
        else:
            runner = eng.executor.runners["draft"]
            runner._forward = poisoned(runner._forward, lambda pos: np.ones(len(pos), bool), lambda r: r * math.nan)
        top1 = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=1.0, top_k=1, seed=5)
        outs = eng.generate(prompts, [GREEDY, top1, GREEDY, top1])
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == want
    assert [o.finish_reason for o in outs] == ["length"] * len(prompts)
    assert sum(o.num_draft_tokens for o in outs[1::2]) > 0, "no sampled draft proposed: the test proves nothing"


@pytest.mark.parametrize("batch", [1, 2], ids=["lone-row", "batch"])
def test_nan_head_confidences_fall_in_the_lowest_bucket_of_the_confidence_stop(default_model, monkeypatch, batch):
    """Heads whose logits are NaN have NaN confidences: the stop reads them as the least confident
    (the first draft only, under a table of 0.5 and a floor of 0.3), where they indexed its table
    out of range and failed the whole MTP call."""
    from lightspec_core.models.mtp_heads import FoldedMTPHead
    from lightspec_core.spec.acceptance import ConfidenceStats
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    def nan_out(method):
        def run(self, state, tok):
            state, logits = method(self, state, tok)
            return state, logits * math.nan

        return run

    monkeypatch.setattr(FoldedMTPHead, "__call__", nan_out(FoldedMTPHead.__call__))
    monkeypatch.setattr(FoldedMTPHead, "one_row", nan_out(FoldedMTPHead.one_row))
    runner = MTPRunner(default_model / "target", default_model / "mtp")
    h, k = runner.target.config.hidden_size, 4
    out = runner.execute(MTPCall(
        hidden=np.ones((batch, h), np.float32), last_ids=np.full(batch, 5), num_tokens=np.full(batch, k, np.int32),
        temperature=np.zeros(batch, np.float32), top_k=np.zeros(batch, np.int32), top_p=np.ones(batch, np.float32),
        uniforms=np.zeros((batch, k), np.float32), return_probs=np.array([False]),
        min_gain=np.full(batch, 0.3, np.float32), calibration=np.full((2, k, 10), 0.5, np.float32)))  # fmt: skip
    assert (out.draft_ids[:, :1] >= 0).all() and (out.draft_ids[:, 1:] == -1).all(), out.draft_ids
    assert ConfidenceStats(k).bucket(math.nan) == 0 and ConfidenceStats(k).bucket(math.inf) == 9


BROKEN = 1234  # a token id of the default model whose input embedding the fixture breaks


@pytest.fixture(scope="module")
def broken_embedding(default_model, tmp_path_factory):
    """The default target untied, with the input embedding of ``BROKEN`` NaN (its LM head row intact)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("broken") / "target"
    shutil.copytree(default_model / "target", d)
    weights = load_file(d / "model.safetensors")
    weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()
    weights["model.embed_tokens.weight"][BROKEN] = math.nan
    save_file(weights, d / "model.safetensors")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    return d


@pytest.mark.parametrize("method", ["none", "mtp"])
def test_the_request_that_gets_a_failed_requests_blocks_is_served_exactly(default_model, broken_embedding, method):
    """A prompt holding ``BROKEN`` fails and leaves NaN keys and values in its blocks; with one
    request at a time in a small pool the next request gets those blocks, and must be served as on
    a fresh engine (with MTP it failed: attention weighs the slots past its context by 0)."""

    def engine():
        return LLMEngine(EngineConfig(model_dir=str(broken_embedding), mtp_dir=str(default_model / "mtp"),
                                      speculation=method, num_kv_blocks=6, block_size=16, max_num_seqs=1,
                                      enable_prefix_caching=False, profile_stages=False))  # fmt: skip

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    eng = engine()
    try:
        failed = eng.generate([[1, 5, 6, 7, BROKEN, *range(8, 23)]], params)[0]
        served = eng.generate([VICTIM], params)[0]
    finally:
        eng.close()
    fresh = engine()
    try:
        want = fresh.generate([VICTIM], params)[0]
    finally:
        fresh.close()
    assert failed.finish_reason == "error" and "not finite" in failed.error
    assert (served.finish_reason, served.output_token_ids) == ("length", want.output_token_ids)
