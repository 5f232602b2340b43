"""The evaluation against the serving path: what the MTP runner's greedy chain would have accepted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightspec_core.models.llama import LlamaModel
from lightspec_core.models.mtp_heads import MTPHeads
from lightspec_core.training.distill import greedy_windows
from lightspec_core.training.evaluate import agreement, chain_acceptance, head_acceptance


def runner_chains(smoke_model, windows: torch.Tensor, prompt: int, k: int) -> tuple[list[int], int, int]:
    """(head 1's hits, leading hits summed, positions): MTPRunner's greedy chain from every
    position of each continuation, its drafts compared with the continuation's next tokens."""
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    target = LlamaModel.load(smoke_model / "target")
    runner = MTPRunner(smoke_model / "target", smoke_model / "mtp")
    with torch.no_grad():
        hid = target.forward_train(windows)
    total, count, agree = 0, 0, [0] * k
    for w in range(len(windows)):
        for t in range(prompt - 1, windows.shape[1] - 1 - k):
            res = runner.execute(
                MTPCall(hidden=hid[w, t : t + 1].numpy(), last_ids=windows[w, t + 1 : t + 2].numpy(),
                        num_tokens=np.array([k], np.int32), temperature=np.zeros(1, np.float32),
                        top_k=np.zeros(1, np.int32), top_p=np.ones(1, np.float32),
                        uniforms=np.zeros((1, k), np.float32), return_probs=np.array([False]))
            )  # fmt: skip
            hits = res.draft_ids[0] == windows[w, t + 2 : t + 2 + k].numpy()
            agree = [a + int(h) for a, h in zip(agree, hits)]
            total += int(np.cumprod(hits).sum())
            count += 1
    return agree, total, count


def test_chain_acceptance_counts_what_serving_heads_would_accept(smoke_model, smoke_text):
    prompt, gen = 8, 16
    windows = greedy_windows(smoke_model / "target", smoke_text, 4, prompt, gen, seed=1)
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    got = chain_acceptance(target, mtp, windows, prompt)
    agree, total, count = runner_chains(smoke_model, windows, prompt, mtp.config.num_heads)
    assert got["mtp_chain_accepted"] == round(total / count, 4)
    # head 1 sees the same inputs on both paths; later heads are teacher-forced in the metric, so
    # only their leading run (the chain) must agree
    assert got["mtp_head_greedy_continuation_agreement"][0] == round(agree[0] / count, 4)


def test_on_the_targets_continuations_its_greedy_tokens_are_the_windows_tokens(smoke_model, smoke_text):
    """The two label sources agree where they must: the target's greedy tokens computed from the
    hidden states (text) and the continuation's own tokens."""
    windows = greedy_windows(smoke_model / "target", smoke_text, 4, 8, 16, seed=2)
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    assert agreement(target, mtp, windows, 7, labels="target") == agreement(target, mtp, windows, 7)
    heads = head_acceptance(target, mtp, smoke_text[:320].long().view(10, 32))
    assert len(heads) == 4 and all(0.0 <= a <= 1.0 for a in heads)


def test_windows_too_short_for_the_heads_are_an_error_naming_the_length_they_need(smoke_model):
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    windows = torch.zeros((2, 8), dtype=torch.int64)  # 4 heads from position 3 need 3 + 4 + 2 tokens
    with pytest.raises(ValueError, match="windows of 8 tokens are too short to evaluate 4 heads .* need 9"):
        agreement(target, mtp, windows, 3)
