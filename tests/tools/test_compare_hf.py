"""The Hugging Face side-by-side: every system's greedy output equals ``transformers``' own."""

from __future__ import annotations

import json

from tools import compare_hf as bench_hf


def test_first_difference_counts_length_differences():
    assert bench_hf.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench_hf.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench_hf.first_difference([1, 2], [1, 2, 3]) == 2


def test_report_lists_mismatches_and_pair_ratios():
    results = {
        "hf": bench_hf.SystemResult("hf", [[1, 2, 3], [4, 5]], seconds=1.0),
        "hf_assisted": bench_hf.SystemResult("hf_assisted", [[1, 2, 3], [4, 5]], seconds=2.0),
        "lightspec_draft": bench_hf.SystemResult("lightspec_draft", [[1, 2, 3], [4, 6]], seconds=0.5),
    }
    table, doc = bench_hf.report(results)
    assert doc["systems"]["lightspec_draft"]["mismatches"] == [{"prompt": 1, "position": 1, "got": [6], "want": [5]}]
    assert doc["systems"]["hf_assisted"]["mismatches"] == []
    assert doc["pairs"] == [{"lightspec": "lightspec_draft", "hf": "hf_assisted", "tokens_per_s_ratio": 4.0}]
    assert "1/2 (prompt 1 at token 1)" in table and "lightspec_draft / hf_assisted: 4.00x" in table


def test_all_systems_match_transformers_greedy_on_the_smoke_model(smoke_model, tmp_path, capsys):
    out = tmp_path / "hf.json"
    argv = ["bench", "--hf", "--model-dir", str(smoke_model / "target"), "--num-prompts", "2", "--max-tokens", "6",
            "--prompt-tokens", "40", "--strict", "--json", str(out)]  # fmt: skip
    assert cli.main(argv) == 0, capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert set(doc["systems"]) == set(bench_hf.HF_SYSTEMS + bench_hf.LIGHTSPEC_SYSTEMS)
    for name, s in doc["systems"].items():
        assert s["mismatches"] == [], name
        assert s["tokens"] > 0 and s["tokens_per_s"] > 0
    assert {(p["lightspec"], p["hf"]) for p in doc["pairs"]} == set(bench_hf.PAIRS)
