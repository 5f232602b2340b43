"""Self-distillation: the heads' chain, the loss over the draft vocabulary, the target's continuations."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightspec_core.models.llama import LlamaModel
from lightspec_core.models.mtp_heads import MTPHeads
from lightspec_core.training import distill
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


def whole_batch_loss(mtp, target, x, vocab=None):
    """The loss as one expression over the whole batch: the teacher's softmax [B, T, V] and each
    head's log-softmax [B, T - i, V_draft] at once (what :func:`distill_loss` computes in chunks)."""
    with torch.no_grad():
        hid = target.forward_train(x)
        teacher = F.softmax(target.lm_head(hid), -1)
        if vocab is not None:
            teacher = teacher[..., vocab]
    loss = hid.new_zeros(())
    for i, lg in enumerate(mtp_chain_logits(mtp, target, hid, x, vocab), start=1):
        loss = loss - (teacher[:, i:] * F.log_softmax(lg, -1)).sum(-1).mean()
    return loss


def loss_and_grads(loss_fn, mtp, *args, **kwargs):
    mtp.zero_grad(set_to_none=True)
    loss = loss_fn(mtp, *args, **kwargs)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in mtp.parameters()]


@pytest.mark.parametrize("chunk_rows", [1, 7, 64, None])
@pytest.mark.parametrize("vocab", [None, torch.tensor([3, 7, 100, 200, 511, *range(20, 90)])])
def test_the_chunked_loss_and_its_gradients_equal_the_whole_batch_formulation(smoke_model, smoke_text, vocab,
                                                                              chunk_rows):  # fmt: skip
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    for p in target.parameters():
        p.requires_grad_(False)
    x = smoke_text[:64].long().view(2, 32)  # 64 rows: chunks of 1, 7 (the last one short), all at once
    want, want_grads = loss_and_grads(whole_batch_loss, mtp, target, x, vocab)
    got, got_grads = loss_and_grads(distill_loss, mtp, target, x, vocab, chunk_rows=chunk_rows)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert all(g.abs().sum() > 0 for g in want_grads)  # every parameter learns: a zero gradient proves nothing
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_the_loss_keeps_nothing_vocabulary_sized_and_takes_softmaxes_a_chunk_at_a_time(smoke_model, smoke_text,
                                                                                      monkeypatch):  # fmt: skip
    """Memory bounded whatever the batch: what autograd keeps for the backward pass is of the
    hidden size, and a softmax sees at most one chunk of rows (the default chunk made 8 rows here)."""
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    for p in target.parameters():
        p.requires_grad_(False)
    v, k = target.config.vocab_size, mtp.config.num_heads
    monkeypatch.setattr(distill, "CHUNK_ELEMENTS", 8 * (2 * v + 4 * k * v), raising=False)
    seen = []
    for name in ("softmax", "log_softmax"):
        real = getattr(F, name)
        monkeypatch.setattr(F, name, lambda t, *a, _real=real, **kw: seen.append(t.shape) or _real(t, *a, **kw))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss = distill_loss(mtp, target, smoke_text[:128].long().view(4, 32))
    loss.backward()
    assert seen and max(torch.Size(s).numel() for s in seen) <= 8 * k * v, seen
    assert saved and not [s for s in saved if s[-1] == v], saved


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
