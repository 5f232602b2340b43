"""``python tools/bench_engine.py``: the in-process side-by-side (what the GPU check runs)."""

from __future__ import annotations

import json

import pytest

from tools import bench_engine


def test_code_prompts_are_distinct_held_out_windows():
    prompts = bench_engine.code_prompts(120, chars=300)
    assert len(prompts) == 120 and len(set(prompts)) == 120
    assert all(len(p) == 300 for p in prompts)


def test_side_by_side_rows_compare_each_config_with_none_on_the_same_prompts(tmp_path, capsys):
    out = tmp_path / "rows.json"
    rows = bench_engine.main(["--batches", "1", "3", "--configs", "static:2", "dynamic", "--max-tokens", "12",
                              "--rounds", "1", "--json", str(out)])  # fmt: skip
    assert [(r["batch"], r["config"]) for r in rows] == [
        (b, c) for b in (1, 3) for c in ("none", "static:2", "dynamic")
    ]
    assert all(r["outputs_equal_none"] for r in rows)  # greedy speculation is lossless
    assert all(r["tokens"] == r["batch"] * 12 and r["throughput_tok_s"] > 0 for r in rows)
    assert all(r["ratio_vs_none"] == 1.0 for r in rows if r["config"] == "none")
    assert json.loads(out.read_text())["rows"] == rows
    assert "| cpu | 3 | dynamic |" in capsys.readouterr().out


@pytest.mark.peer
def test_peer_rows_run_vllm_in_process_on_the_same_prompts_with_the_same_tokens(peer_python, capsys):
    """vLLM's LLM.generate (its CPU build, in the peer environment) beside LightSpec: the embedded
    model, since vLLM's CPU attention has no kernel for the smoke model's head size."""
    rows = bench_engine.main(["--batches", "1", "2", "--configs", "none", "--max-tokens", "8", "--rounds", "1",
                              "--peer", "vllm", "--peer-python", str(peer_python), "--peer-configs", "none"])  # fmt: skip
    assert [(r["engine"], r["batch"]) for r in rows] == [("lightspec", 1), ("lightspec", 2), ("vllm", 1), ("vllm", 2)]
    assert all(r["outputs_equal_none"] and r["tokens"] == 8 * r["batch"] for r in rows), rows
    assert all(r["ratio_vs_vllm_none"] > 0 for r in rows)
    assert all(r["ratio_vs_vllm_none"] == 1.0 for r in rows if r["engine"] == "vllm")
    assert "| vllm | cpu | 2 | none |" in capsys.readouterr().out
