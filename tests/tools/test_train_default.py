"""The training script's continue-the-heads mode, on the smoke family (the pieces it shares with
``lightspec train-heads`` are tested in tests/training/)."""

from __future__ import annotations

import json

import pytest

from tools import train_default
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


def test_greedy_data_needs_a_trained_family(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "x"), "--smoke", "--greedy-data", "4"])
    assert "--greedy-data: only with --heads-from" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["family", "heads-from"])
def test_the_heads_loss_is_over_the_draft_vocabulary_they_are_served_with(smoke_model, tmp_path, monkeypatch, mode):
    """As ``lightspec train-heads``: the heads learn over the ids they will propose from."""
    vocabs = []

    class Recording(train_default.HeadTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            vocabs.append(self.vocab)

    monkeypatch.setattr(train_default, "HeadTrainer", Recording)
    extra = ["--heads-from", str(smoke_model)] if mode == "heads-from" else []
    main(["--out", str(tmp_path / "out"), "--smoke", "--seed", "0", *extra])
    served = json.loads((tmp_path / "out" / "mtp" / "draft_vocab.json").read_text())["token_ids"]
    assert len(vocabs) == 1 and vocabs[0] is not None, vocabs
    assert vocabs[0].tolist() == served and len(served) == 256
