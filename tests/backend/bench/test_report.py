"""``lightspec_backend.bench.report``: the printed table and comparison, the JSON, the plot."""

from __future__ import annotations

import json
import re

from lightspec_backend.bench.report import format_comparison, format_table, plot, write_json


def _run(config, method, c, tps, lat, rate=None):
    return {
        "config": config,
        "method": method,
        "concurrency": c,
        "rate": rate,
        "throughput_tok_s": tps,
        "mean_latency_s": lat,
        "p99_latency_s": lat,
        "mean_ttft_s": 0.01,
        "mean_itl_s": 0.002,
        "mean_acceptance_length": 2.0,
        "mean_draft_tokens_per_step": 1.5,
        "scheduler_p99_ms": 0.05,
    }


def test_ratio_table_compares_with_none_at_the_same_load():
    runs = [_run("none", "none", 1, 100, 1.0), _run("dynamic", "mtp", 1, 150, 0.5), _run("none", "none", 4, 200, 2.0),
            _run("dynamic", "mtp", 4, 100, 4.0)]  # fmt: skip
    table = format_table(runs)
    assert re.search(r"dynamic\s+mtp\s+c=1\s+150\.0\s+1\.50x\s+0\.500\s+0\.50x", table), table
    assert re.search(r"dynamic\s+mtp\s+c=4\s+100\.0\s+0\.50x\s+4\.000\s+2\.00x", table), table


def test_table_lists_closed_loop_levels_before_rates_and_marks_errors():
    runs = [_run("dynamic", "mtp", None, 50, 1.0, rate=2.0), {**_run("none", "none", 4, 200, 2.0), "errors": 3},
            _run("none", "none", 1, 100, 1.0)]  # fmt: skip
    rows = format_table(runs).splitlines()[2:]
    assert [r.split()[2] for r in rows] == ["c=1", "c=4", "2/s"]
    assert rows[1].endswith("[3 errors]") and rows[2].split()[4] == "-"  # no none at that rate: no ratio


def test_comparison_prints_each_level_round_by_round_and_the_mean_of_levels():
    rows = [
        {"method": "mtp", "load": 1, "best_static": "static:4", "ratio": 160 / 170,
         "rounds": [180 / 200, 110 / 100, 160 / 170], "dynamic_x_none": 160 / 90},
        {"method": "mtp", "load": None, "best_static": "static:4", "ratio": 1.04, "rounds": [],
         "dynamic_x_none": 1.639},
    ]  # fmt: skip
    printed = format_comparison(rows)
    assert re.search(r"mtp\s+c=1\s+static:4\s+0\.94x\s+\[0\.90 1\.10 0\.94\]\s+dynamic 1\.78x none", printed), printed
    assert re.search(r"mtp\s+mean of levels\s+static:4\s+1\.04x\s+dynamic 1\.64x none$", printed), printed


def test_json_holds_the_runs_the_comparison_and_the_meta(tmp_path):
    out = tmp_path / "bench.json"
    runs = [_run("none", "none", 1, 100, 1.0)]
    write_json(out, runs, [], {"prompts": 4})
    assert json.loads(out.read_text()) == {"runs": runs, "comparison": [], "meta": {"prompts": 4}}


def test_plot_draws_concurrency_and_rate_axes(tmp_path):
    png = tmp_path / "bench.png"
    runs = [_run("none", "none", 1, 100, 1.0), _run("dynamic", "mtp", 1, 150, 0.5), _run("none", "none", 4, 200, 2.0),
            _run("dynamic", "mtp", 4, 100, 4.0), _run("dynamic", "ngram", None, 50, 1.0, rate=2.0)]  # fmt: skip
    plot(runs, png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_peer_table_ratios_and_plot_name_server_configuration_and_client(tmp_path):
    from lightspec_backend.bench.report import format_peer_ratios, format_peer_table, plot_peer
    from lightspec_backend.bench.stats import peer_ratios

    runs = [
        {**_run("none", "none", 1, 100, 1.0), "server": "lightspec", "protocol": "grpc", "mismatches": 0},
        {**_run("dynamic", "mtp", 1, 300, 0.5), "server": "lightspec", "protocol": "http", "mismatches": 2},
        {**_run("none", "none", 1, 200, 1.0), "server": "vllm", "protocol": "http", "mismatches": 0},
        {**_run("none", "none", 16, 800, 2.0), "server": "vllm", "protocol": "http", "mismatches": 0},
        {**_run("none", "none", 16, 400, 2.0), "server": "lightspec", "protocol": "grpc", "mismatches": 0},
    ]
    table = format_peer_table(runs).splitlines()
    assert [line.split()[0] for line in table[2:]] == ["lightspec", "lightspec", "vllm", "lightspec", "vllm"]
    assert re.match(r"lightspec mtp dynamic http\s+c=1\s+300\.0\s.*\s2$", table[3]), table[3]
    ratios = format_peer_ratios(peer_ratios(runs)).splitlines()
    assert re.match(r"lightspec mtp dynamic http\s+c=1\s+300\.0\s+1\.50x\s+1\.50x\s+none\s+0\.50x$", ratios[2])
    assert re.match(r"lightspec none grpc\s+c=16\s+400\.0\s+0\.50x\s+0\.50x\s+none\s+1\.00x$", ratios[3])
    plot_peer(runs, tmp_path / "peer.png")
    assert (tmp_path / "peer.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
