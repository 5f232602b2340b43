"""The training script's continue-the-heads mode, on the smoke family."""

from __future__ import annotations

import json

from lightspec_core.train import main


def test_heads_from_trains_only_the_heads_and_reports_before_and_after(smoke_model, tmp_path):
    out = tmp_path / "more"
    report = main(["--out", str(out), "--smoke", "--heads-from", str(smoke_model), "--seed", "0"])
    for part in ("target/model.safetensors", "draft/model.safetensors", "target/tokenizer.json", "mtp/draft_vocab.json"):
        assert (out / part).read_bytes() == (smoke_model / part).read_bytes(), part
    assert (out / "mtp/mtp.safetensors").read_bytes() != (smoke_model / "mtp/mtp.safetensors").read_bytes()
    before = json.loads((smoke_model / "train_report.json").read_text())
    saved = json.loads((out / "train_report.json").read_text())
    assert saved == report
    # the "before" figures are the source family's own evaluation, recomputed
    assert report["mtp_head_greedy_acceptance_before_continued"] == before["mtp_head_greedy_acceptance"]
    assert report["mtp_steps"] == before["mtp_steps"] + report["mtp_continued"]["steps"] > before["mtp_steps"]
    assert report["target_val_loss"] == before["target_val_loss"]
