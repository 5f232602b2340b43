"""``python tools/compare_hf.py``: every system's greedy output equals ``transformers``' own."""

from __future__ import annotations

import json

import pytest

from tools import compare_hf


def test_first_difference_counts_length_differences():
    assert compare_hf.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert compare_hf.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert compare_hf.first_difference([1, 2], [1, 2, 3]) == 2


def test_report_lists_mismatches_and_pair_ratios():
    results = {
        "hf": compare_hf.SystemResult("hf", [[1, 2, 3], [4, 5]], seconds=1.0),
        "hf_assisted": compare_hf.SystemResult("hf_assisted", [[1, 2, 3], [4, 5]], seconds=2.0),
        "lightspec_draft": compare_hf.SystemResult("lightspec_draft", [[1, 2, 3], [4, 6]], seconds=0.5),
    }
    table, doc = compare_hf.report(results)
    assert doc["systems"]["lightspec_draft"]["mismatches"] == [{"prompt": 1, "position": 1, "got": [6], "want": [5]}]
    assert doc["systems"]["hf_assisted"]["mismatches"] == []
    assert doc["pairs"] == [{"lightspec": "lightspec_draft", "hf": "hf_assisted", "tokens_per_s_ratio": 4.0}]
    assert "1/2 (prompt 1 at token 1)" in table and "lightspec_draft / hf_assisted: 4.00x" in table


def test_unknown_systems_are_refused_with_the_name():
    with pytest.raises(SystemExit, match="--systems 'eagle'"):
        compare_hf.main(["--systems", "hf", "eagle"])


def test_all_systems_match_transformers_greedy_on_the_smoke_model(smoke_model, tmp_path, capsys):
    out = tmp_path / "hf.json"
    argv = ["--model-dir", str(smoke_model / "target"), "--num-prompts", "2", "--max-tokens", "6",
            "--prompt-tokens", "40", "--strict", "--json", str(out)]  # fmt: skip
    assert compare_hf.main(argv) == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["systems"]) == set(compare_hf.HF_SYSTEMS + compare_hf.LIGHTSPEC_SYSTEMS)
    for name, s in doc["systems"].items():
        assert s["mismatches"] == [], name
        assert s["tokens"] > 0 and s["tokens_per_s"] > 0
    assert {(p["lightspec"], p["hf"]) for p in doc["pairs"]} == set(compare_hf.PAIRS)
    assert doc["meta"]["argv"] == argv


def test_the_reference_is_the_checkpoints_own_family(smoke_model, tmp_path):
    """A Qwen2 checkpoint's reference keeps its q/k/v biases (a Llama class would drop them)."""
    import shutil

    import numpy as np

    from tests.models.factories import CASES, save_hf_checkpoint

    model_dir = save_hf_checkpoint(tmp_path, CASES["qwen2"][0], {**CASES["qwen2"][1], "vocab_size": 4096})
    shutil.copy(smoke_model / "target" / "tokenizer.json", model_dir / "tokenizer.json")
    prompts = [np.random.default_rng(i).integers(3, 4096, 30).tolist() for i in range(2)]
    res = compare_hf.compare(model_dir, prompts, 8, systems=["hf", "lightspec_none"], log=lambda *a: None)
    assert compare_hf.mismatches(res["lightspec_none"], res["hf"]) == []
