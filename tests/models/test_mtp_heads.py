"""MTP heads' checkpoint files (``lightspec_core/models/mtp_heads.py``)."""

from __future__ import annotations

from lightspec_core.models.mtp_heads import MTPConfig, MTPHeads


def test_heads_saved_without_a_draft_vocabulary_over_heads_with_one_load_without_it(tmp_path):
    cfg = MTPConfig(num_heads=2, hidden_size=16, intermediate_size=32)
    MTPHeads(cfg, list(range(100))).save(tmp_path)
    assert len(MTPHeads.load(tmp_path).draft_vocab) == 100
    MTPHeads(cfg, None).save(tmp_path)  # full-vocabulary heads, the same directory
    assert not (tmp_path / "draft_vocab.json").exists()
    assert MTPHeads.load(tmp_path).draft_vocab is None
