"""``lightspec bench --peer vllm`` end to end: a real tritonserver and a real vLLM server (its CPU
build, in the environment the bench makes), the same prompts to both, the same tokens back. The
embedded model, not the smoke one: vLLM's CPU attention has no kernel for the smoke model's head
size (16)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from lightspec_backend import bench


@pytest.mark.peer
@pytest.mark.triton
def test_peer_bench_runs_both_servers_and_their_greedy_tokens_agree(peer_python, default_model, tmp_path, monkeypatch,
                                                                     capsys):  # fmt: skip
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "peer.json"
    argv = ["--peer", "vllm", "--peer-python", str(peer_python), "--peer-configs", "none",
            "--model-dir", str(default_model / "target"), "--configs", "none", "--concurrency", "1", "2",
            "--requests", "2", "--max-tokens", "16", "--num-prompts", "2", "--warmup", "1",
            "--set", "num_threads=1", "--set", "num_kv_blocks=64", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    pid = int(re.search(r"vLLM \(none\) pid (\d+) ready", printed).group(1))
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    runs = json.loads(out.read_text())["runs"]
    assert [(r["server"], r["protocol"], r["concurrency"]) for r in runs] == [
        ("lightspec", "grpc", 1), ("lightspec", "http", 1), ("lightspec", "grpc", 2), ("lightspec", "http", 2),
        ("vllm", "http", 1), ("vllm", "http", 2)]  # fmt: skip
    for r in runs:
        assert (r["errors"], r["output_tokens"], r["compared"], r["mismatches"]) == (0, 32, 2, 0), r
    assert "token identity: 0 of 12 requests differ from LightSpec none" in printed
    assert re.search(r"lightspec none http\s+c=2\s+[\d.]+\s+[\d.]+x\s+[\d.]+x\s+none", printed), printed
