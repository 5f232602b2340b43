"""Self-distillation: the heads' chain, the loss over the draft vocabulary, the target's continuations."""

from __future__ import annotations

import pytest
import torch

from lightspec_core.models.llama import LlamaModel
from lightspec_core.models.mtp_heads import MTPHeads
from lightspec_core.training.distill import cosine_lr, distill_loss, greedy_windows, mtp_chain_logits
from lightspec_core.training.loop import DistillConfig, HeadTrainer


@pytest.fixture(scope="module")
def family(smoke_model):
    return LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")


def test_the_draft_vocabulary_chain_is_the_full_chains_columns(family, smoke_text):
    target, mtp = family
    x = smoke_text[:40].long().view(2, 20)
    vocab = torch.tensor([3, 7, 100, 200, 511])
    with torch.no_grad():
        hid = target.forward_train(x)
        full = mtp_chain_logits(mtp, target, hid, x)
        sub = mtp_chain_logits(mtp, target, hid, x, vocab)
    assert [lg.shape for lg in full] == [(2, 20 - i, 512) for i in range(1, 5)]
    for f, s in zip(full, sub):
        torch.testing.assert_close(s, f[..., vocab])


def test_the_loss_over_a_vocabulary_of_every_id_is_the_full_loss(family, smoke_text):
    target, mtp = family
    x = smoke_text[:64].long().view(2, 32)
    with torch.no_grad():
        full, every = distill_loss(mtp, target, x), distill_loss(mtp, target, x, torch.arange(512))
    torch.testing.assert_close(every, full)


def test_training_steps_lower_the_distillation_loss(smoke_model, smoke_text):
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    x = smoke_text[:256].long().view(8, 32)
    with torch.no_grad():
        before = distill_loss(mtp, target, x).item()
    trainer = HeadTrainer(mtp, target, smoke_text[:256], DistillConfig(batch=8, seq=32, lr=3e-3))
    for _ in range(15):
        trainer.step(0.5)
    with torch.no_grad():
        assert distill_loss(mtp, target, x).item() < before
    assert not any(p.requires_grad for p in target.parameters())


def test_cosine_schedule_warms_up_then_decays_to_a_tenth():
    assert cosine_lr(0.0, 1.0) == 0.0
    assert cosine_lr(0.03, 1.0) == pytest.approx(1.0)
    assert 1.0 > cosine_lr(0.5, 1.0) > cosine_lr(0.8, 1.0) > 0.1
    assert cosine_lr(1.0, 1.0) == pytest.approx(0.1)


def test_greedy_windows_are_the_targets_greedy_continuations(smoke_model, smoke_text):
    windows = greedy_windows(smoke_model / "target", smoke_text, 3, 10, 12, seed=0)
    assert windows.shape == (3, 22)
    target = LlamaModel.load(smoke_model / "target")
    with torch.no_grad():  # an independent path: the training forward over the whole window
        greedy = target.lm_head(target.forward_train(windows)).argmax(-1)
    assert torch.equal(greedy[:, 9:21], windows[:, 10:])


def test_greedy_windows_stop_at_their_time_limit_after_one_batch(smoke_model, smoke_text):
    windows = greedy_windows(smoke_model / "target", smoke_text, 70, 4, 4, seed=0, seconds=0.0)
    assert windows.shape == (64, 8)  # the first batch of 64 prompts, then the limit
