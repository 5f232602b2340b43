"""The training script's continue-the-heads mode, on the smoke family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tools.train_default import main


def test_heads_from_trains_only_the_heads_and_reports_before_and_after(smoke_model, tmp_path):
    out = tmp_path / "more"
    report = main(["--out", str(out), "--smoke", "--heads-from", str(smoke_model), "--seed", "0"])
    for part in (
        "target/model.safetensors",
        "draft/model.safetensors",
        "target/tokenizer.json",
        "mtp/draft_vocab.json",
    ):
        assert (out / part).read_bytes() == (smoke_model / part).read_bytes(), part
    assert (out / "mtp/mtp.safetensors").read_bytes() != (smoke_model / "mtp/mtp.safetensors").read_bytes()
    before = json.loads((smoke_model / "train_report.json").read_text())
    saved = json.loads((out / "train_report.json").read_text())
    assert saved == report
    # the "before" figures are the source family's own evaluation, recomputed
    assert report["mtp_head_greedy_acceptance_before_continued"] == before["mtp_head_greedy_acceptance"]
    assert report["mtp_steps"] == before["mtp_steps"] + report["mtp_continued"]["steps"] > before["mtp_steps"]
    assert report["target_val_loss"] == before["target_val_loss"]


def test_greedy_data_trains_on_the_targets_continuations_and_reports_the_chain(smoke_model, tmp_path):
    out = tmp_path / "greedy"
    report = main(["--out", str(out), "--smoke", "--heads-from", str(smoke_model), "--seed", "0",
                   "--greedy-data", "12", "--greedy-share", "0.5"])  # fmt: skip
    run = report["mtp_continued"]
    assert run["greedy_continuations"] == 12 and run["greedy_share"] == 0.5
    k = len(report["mtp_head_greedy_acceptance"])
    for side in ("before", "after"):
        assert len(run[side]["mtp_head_greedy_continuation_agreement"]) == k
        assert 0.0 <= run[side]["mtp_chain_accepted"] <= k
    # the heads changed, the rest of the family did not
    assert (out / "mtp/mtp.safetensors").read_bytes() != (smoke_model / "mtp/mtp.safetensors").read_bytes()
    assert (out / "target/model.safetensors").read_bytes() == (smoke_model / "target/model.safetensors").read_bytes()
    # a second continuation keeps the first one's record
    # (the same seed, so the same held-out continuations judge the saved heads)
    again = main(["--out", str(tmp_path / "again"), "--smoke", "--heads-from", str(out), "--seed", "0"])
    assert again["mtp_continued_earlier"][-1]["greedy_continuations"] == 12
    assert again["mtp_continued"]["greedy_continuations"] == 0
    assert again["mtp_continued"]["before"] == run["after"]


def test_greedy_windows_are_the_targets_greedy_continuations(smoke_model):
    from lightspec_core.models.llama import LlamaModel
    from tools.train_default import greedy_windows, load_corpus

    _, valid = load_corpus(smoke_model / "target", 4)
    windows = greedy_windows(smoke_model / "target", valid, 3, 10, 12, seed=0)
    assert windows.shape == (3, 22)
    target = LlamaModel.load(smoke_model / "target")
    with torch.no_grad():  # an independent path: the training forward over the whole window
        greedy = target.lm_head(target.forward_train(windows)).argmax(-1)
    assert torch.equal(greedy[:, 9:21], windows[:, 10:])


def test_chain_acceptance_counts_what_serving_heads_would_accept(smoke_model):
    """The metric against the serving path: MTPRunner's greedy chain from every position of a
    continuation, its drafts compared with the continuation's next tokens."""
    from lightspec_core.models.llama import LlamaModel
    from lightspec_core.models.mtp_heads import MTPHeads
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner
    from tools.train_default import chain_acceptance, greedy_windows, load_corpus

    _, valid = load_corpus(smoke_model / "target", 4)
    prompt, gen = 8, 16
    windows = greedy_windows(smoke_model / "target", valid, 4, prompt, gen, seed=1)
    target, mtp = LlamaModel.load(smoke_model / "target"), MTPHeads.load(smoke_model / "mtp")
    got = chain_acceptance(target, mtp, windows, prompt)
    runner = MTPRunner(smoke_model / "target", smoke_model / "mtp")
    k = mtp.config.num_heads
    with torch.no_grad():
        hid = target.forward_train(windows)
    total, count, agree = 0, 0, [0] * k
    for w in range(len(windows)):
        for t in range(prompt - 1, windows.shape[1] - 1 - k):
            res = runner.execute(
                MTPCall(
                    hidden=hid[w, t : t + 1].numpy(),
                    last_ids=windows[w, t + 1 : t + 2].numpy(),
                    num_tokens=np.array([k], np.int32),
                    temperature=np.zeros(1, np.float32),
                    top_k=np.zeros(1, np.int32),
                    top_p=np.ones(1, np.float32),
                    uniforms=np.zeros((1, k), np.float32),
                    return_probs=np.array([False]),
                )
            )
            want = windows[w, t + 2 : t + 2 + k].numpy()
            hits = res.draft_ids[0] == want
            agree = [a + int(h) for a, h in zip(agree, hits)]
            total += int(np.cumprod(hits).sum())
            count += 1
    assert got["mtp_chain_accepted"] == round(total / count, 4)
    # head 1 sees the same inputs on both paths; later heads are teacher-forced in the metric, so
    # only their leading run (the chain) must agree
    assert got["mtp_head_greedy_continuation_agreement"][0] == round(agree[0] / count, 4)


def test_greedy_data_needs_a_trained_family(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--smoke", "--greedy-data", "4"])
    assert "--greedy-data: only with --heads-from" in capsys.readouterr().err
