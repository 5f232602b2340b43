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
            "--set", "num_threads=1", "--set", "num_kv_blocks=64", "--repeats", "2", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    pid = int(re.search(r"vLLM \(none\) pid (\d+) ready", printed).group(1))
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    runs = json.loads(out.read_text())["runs"]  # each run the median of its two rounds
    assert [(r["server"], r["protocol"], r["concurrency"]) for r in runs] == [
        ("lightspec", "grpc", 1), ("lightspec", "http", 1), ("lightspec", "grpc", 2), ("lightspec", "http", 2),
        ("vllm", "http", 1), ("vllm", "http", 2)]  # fmt: skip
    for r in runs:  # the median, and every round's figures beside it
        assert (r["errors"], r["output_tokens"], r["compared"], r["mismatches"]) == (0, 32, 2, 0), r
        assert [x["repeat"] for x in r["round_runs"]] == [0, 1], r
        assert all((x["compared"], x["mismatches"], x["errors"]) == (2, 0, 0) for x in r["round_runs"]), r
        assert r["throughput_tok_s"] in [x["throughput_tok_s"] for x in r["round_runs"]]
    assert "token identity: 0 of 24 requests differ from LightSpec none" in printed
    grpc, http = runs[0]["round_runs"], runs[1]["round_runs"]  # c=1: gRPC first in round 1, HTTP in round 2
    assert grpc[0]["started_at"] < http[0]["started_at"] and http[1]["started_at"] < grpc[1]["started_at"]
    # as they ran: level by level, serpentine, LightSpec's two clients swapping places from round to round
    ran = re.findall(r"^round (\d)|^\s+(lightspec|vllm)\s+(grpc|http)\s+none\s+none\s+(c=\d)\s+[\d.]+ tok/s",
                     printed, flags=re.MULTILINE)  # fmt: skip
    assert [m[0] or " ".join(m[1:]) for m in ran] == [
        "1", "lightspec grpc c=1", "lightspec http c=1", "vllm http c=1",
        "vllm http c=2", "lightspec grpc c=2", "lightspec http c=2",
        "2", "vllm http c=1", "lightspec http c=1", "lightspec grpc c=1",
        "lightspec http c=2", "lightspec grpc c=2", "vllm http c=2"], printed  # fmt: skip
    assert re.search(r"lightspec none http\s+c=2\s+[\d.]+\s+[\d.]+x\s+[\d.]+x\s+none", printed), printed


# ---- the sweep's order and the rounds' report, without servers -------------------------------------------------
def _configs():
    from lightspec_backend.bench.configs import parse_configs
    from lightspec_backend.bench.peer import peer_configs
    from lightspec_backend.bench.runner import Load

    ours = parse_configs(["none", "dynamic"], ["ngram", "mtp"])
    return ours, peer_configs(["draft", "ngram", "none"], Path("draft")), [Load(1), Load(16)]


def test_each_lightspec_configuration_runs_next_to_vllms_of_its_method_and_levels_alternate_direction():
    from lightspec_backend.bench.peer_run import interleaved
    from lightspec_backend.bench.runner import sweep_order

    ours, peers, loads = _configs()
    items = interleaved(ours, peers)
    names = [c.model_name if kind == "lightspec" else f"vllm {c.config}" for kind, c in items]
    assert names == ["lightspec_none", "vllm none", "lightspec_ngram_dynamic", "vllm ngram", "lightspec_mtp_dynamic",
                     "vllm draft"]  # fmt: skip
    order = sweep_order(items, loads, 0)
    assert [item for item, _ in order[:6]] == items and [item for item, _ in order[6:]] == items[::-1]
    assert [item for item, _ in sweep_order(items, loads, 1)[:6]] == items[::-1]  # the next round starts reversed


def test_lightspec_clients_swap_places_from_round_to_round():
    from types import SimpleNamespace

    from lightspec_backend.bench.peer_run import lightspec_clients

    server = SimpleNamespace(grpc_url="127.0.0.1:1", http_url="http://127.0.0.1:2")
    by_round = [[(p, url) for p, url, _ in lightspec_clients(server, rnd)] for rnd in range(3)]
    grpc, http = ("grpc", "127.0.0.1:1"), ("http", "http://127.0.0.1:2")
    assert by_round == [[grpc, http], [http, grpc], [grpc, http]]  # the run after a model switch alternates
    streams = {p: s for p, _, s in lightspec_clients(server, 1)}
    assert streams["grpc"] is None and callable(streams["http"])  # gRPC: the bench's own client; HTTP: SSE


def _run(server, config, method, load, rnd, tok_s, protocol="http"):
    model = "vllm" if server == "vllm" else ("lightspec_none" if method == "none" else f"lightspec_{method}_{config}")
    return {"server": server, "model": model, "config": config, "method": method, "protocol": protocol,
            "concurrency": load, "rate": None, "repeat": rnd, "throughput_tok_s": tok_s, "mean_latency_s": 1.0}  # fmt: skip


def test_runs_are_reported_by_configuration_level_client_and_round_whatever_order_they_ran_in():
    from lightspec_backend.bench.peer_run import report_order

    ours, peers, loads = _configs()
    ran = [_run("vllm", "none", "none", 16, 0, 1), _run("lightspec", "dynamic", "mtp", 1, 0, 1),
           _run("lightspec", "none", "none", 1, 1, 1, "grpc"), _run("lightspec", "none", "none", 1, 0, 1),
           _run("lightspec", "none", "none", 1, 0, 1, "grpc"), _run("vllm", "draft", "draft", 1, 0, 1)]  # fmt: skip
    got = [
        (r["model"], r["config"], r["concurrency"], r["protocol"], r["repeat"])
        for r in report_order(ran, ours, peers, loads)
    ]
    assert got == [("lightspec_none", "none", 1, "grpc", 0), ("lightspec_none", "none", 1, "grpc", 1),
                   ("lightspec_none", "none", 1, "http", 0), ("lightspec_mtp_dynamic", "dynamic", 1, "http", 0),
                   ("vllm", "draft", 1, "http", 0), ("vllm", "none", 16, "http", 0)]  # fmt: skip


def test_rounds_report_the_median_runs_and_each_rounds_own_ratios():
    from lightspec_backend.bench.report import format_peer_ratios
    from lightspec_backend.bench.stats import peer_comparison

    tok = {0: (300, 100, 150), 1: (240, 160, 120), 2: (330, 110, 100)}  # round: LightSpec MTP, vLLM none, ngram
    runs = []
    for rnd, (ours, none, ngram) in tok.items():
        runs += [_run("lightspec", "dynamic", "mtp", 16, rnd, ours), _run("vllm", "none", "none", 16, rnd, none),
                 _run("vllm", "ngram", "ngram", 16, rnd, ngram)]  # fmt: skip
    medians, rows = peer_comparison(runs)
    assert sorted((r["model"], r["config"], r["throughput_tok_s"]) for r in medians) == [
        ("lightspec_mtp_dynamic", "dynamic", 300), ("vllm", "ngram", 120), ("vllm", "none", 110)]  # fmt: skip
    (row,) = rows
    assert row["x_vllm_none"] == pytest.approx(300 / 110) and row["x_vllm_best"] == pytest.approx(300 / 120)
    assert row["x_vllm_none_rounds"] == pytest.approx([3.0, 1.5, 3.0])
    assert row["x_vllm_best_rounds"] == pytest.approx([2.0, 1.5, 3.0])  # each round against its own best
    assert "2.00 1.50 3.00" in format_peer_ratios(rows)
    single, rows = peer_comparison([r for r in runs if r["repeat"] == 0])
    assert len(single) == 3 and "x_vllm_best_rounds" not in rows[0]
