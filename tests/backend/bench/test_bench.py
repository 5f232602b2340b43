"""``lightspec bench``: configurations, prompts, metric arithmetic, the report, and one short sweep
against a real tritonserver (smoke model)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from lightspec_backend import bench, cli
from lightspec_backend.params import check_stage_configs, parse_backend_config, read_config_parameters

RUN_KEYS = {
    "config": str, "method": str, "concurrency": int, "requests": int, "output_tokens": int, "duration_s": float,
    "throughput_tok_s": float, "mean_latency_s": float, "p50_latency_s": float, "p99_latency_s": float,
    "mean_ttft_s": float, "mean_itl_s": float, "mean_acceptance_length": float, "scheduler_p99_ms": float,
}  # fmt: skip


# ---- configurations and repository -----------------------------------------------------------------------
def test_configs_cross_methods_and_run_the_none_baseline_once():
    runs = bench.parse_configs(["none", "static:2", "dynamic@2"], ["mtp", "ngram"])
    assert [(c.config, c.method, c.model_name) for c in runs] == [
        ("none", "none", "lightspec_none"),
        ("static:2", "mtp", "lightspec_mtp_static_2"),
        ("static:2", "ngram", "lightspec_ngram_static_2"),
        ("dynamic@2", "mtp", "lightspec_mtp_dynamic_d2"),
        ("dynamic@2", "ngram", "lightspec_ngram_dynamic_d2"),
    ]
    assert runs[3].pipeline_depth == 2
    assert bench.stages_for(runs) == ["lightspec_target"]  # default: MTP heads inside the orchestrator
    assert bench.stages_for(runs, {"mtp_model": "lightspec_mtp"}) == ["lightspec_target", "lightspec_mtp"]
    assert bench.RunConfig("static:8", "mtp", "static:8").parameters(4)["max_draft_tokens"] == "8"
    stop = bench.parse_configs(["dynamic", "dynamic+stop"], ["mtp"])
    assert [c.model_name for c in stop] == ["lightspec_mtp_dynamic", "lightspec_mtp_dynamic_stop"]
    assert "confidence_stop" not in stop[0].parameters(4) and stop[1].parameters(4)["confidence_stop"] == "on"
    where = bench.parse_configs(["static:4+local", "static:4+fused", "dynamic+stop+fused"], ["mtp"])
    assert [c.model_name for c in where] == ["lightspec_mtp_static_4_local", "lightspec_mtp_static_4_fused",
                                             "lightspec_mtp_dynamic_stop_fused"]
    assert [c.parameters(4)["mtp_model"] for c in where] == ["local", "fused", "fused"]
    assert where[2].confidence_stop
    assert bench.stages_for(where, {"mtp_model": "lightspec_mtp"}) == ["lightspec_target"]


@pytest.mark.parametrize("bad", [["eagle"], ["static:x"], ["dynamic@3"], ["none", "off"], ["static:2+stop"],
                                 ["dynamic+remote"], ["dynamic+fused+stop"]])
def test_bad_configs_are_refused_with_the_spec_named(bad):
    with pytest.raises(SystemExit, match="--configs"):
        bench.parse_configs(bad, ["mtp"])
    with pytest.raises(SystemExit, match="--methods"):
        bench.parse_configs(["dynamic"], ["eagle"])


def test_repository_has_one_orchestrator_per_config_sharing_the_stage_models(tmp_path):
    configs = bench.parse_configs(["none", "static:2", "dynamic", "dynamic+stop"], ["mtp", "draft"])
    repo = bench.write_bench_repository(tmp_path / "repo", configs, {"num_kv_blocks": "96", "model_dir": "/m/t"}, 4)
    for c in configs:
        cfg = parse_backend_config(read_config_parameters(repo / c.model_name / "config.pbtxt"), base_dir=repo)
        assert (cfg.engine.speculation, cfg.engine.policy) == (c.method, c.policy)
        assert cfg.engine.confidence_stop == c.confidence_stop
        assert cfg.engine.num_kv_blocks == 96
        assert check_stage_configs(cfg, repo) == []  # same KV geometry and checkpoints as the stages
    target = read_config_parameters(repo / "lightspec_target" / "config.pbtxt")
    assert target["num_kv_blocks"] == "96"
    assert target["mtp_heads"] == "on"  # the default: mtp_model fused, the target stage proposes drafts
    assert all(parse_backend_config(read_config_parameters(repo / c.model_name / "config.pbtxt"),
                                    base_dir=repo).engine.fused_mtp == (c.method == "mtp") for c in configs)
    local = bench.write_bench_repository(tmp_path / "local", configs[:1], {"mtp_model": "local"}, 4)
    assert read_config_parameters(local / "lightspec_target" / "config.pbtxt").get("mtp_heads", "off") == "off"
    # a fused configuration: the shared target stage loads the heads, the others keep theirs
    configs = bench.parse_configs(["static:4+local", "static:4+fused"], ["mtp"])
    repo = bench.write_bench_repository(tmp_path / "fused", configs, {"mtp_model": "local"}, 4)
    assert read_config_parameters(repo / "lightspec_target" / "config.pbtxt")["mtp_heads"] == "on"
    for c, fused in zip(configs, (False, True)):
        cfg = parse_backend_config(read_config_parameters(repo / c.model_name / "config.pbtxt"), base_dir=repo)
        assert cfg.engine.fused_mtp == fused and check_stage_configs(cfg, repo) == []


# ---- prompts ------------------------------------------------------------------------------------------------
def test_mixed_workload_alternates_code_and_shuffled_prompts_deterministically():
    prompts = bench.default_prompts(6, None, max_prompt_tokens=60, workload="mixed", seed=3)
    assert [p.kind for p in prompts] == ["code", "shuffled"] * 3
    assert [p.temperature for p in prompts] == [None, 1.0] * 3  # the shuffled half is sampled
    plan = bench.BenchPlan([], [], prompts, max_tokens=8, requests=None, temperature=0.3)
    assert [r.temperature for r in plan.requests_for(4)] == [0.3, 1.0, 0.3, 1.0]
    assert prompts == bench.default_prompts(6, None, max_prompt_tokens=60, workload="mixed", seed=3)
    for p in prompts:
        assert 0 < len(p.text) <= 3 * 60  # trimmed (3 characters per token without a tokenizer)
        if p.kind == "code":
            assert p.text.rstrip().endswith(":") and "def " in p.text.splitlines()[-1]
        else:
            assert "\n" not in p.text
    code = bench.default_prompts(4, None, max_prompt_tokens=60, workload="code", seed=3)
    assert {p.kind for p in code} == {"code"}
    # a mixed run is long enough that its slow half's tail does not decide the throughput
    plan.requests_rule = bench.requests_rule(False, "mixed")
    assert plan.num_requests(bench.Load(concurrency=16)) == 128
    assert bench.requests_rule(False, "code") == (16, 2) and bench.requests_rule(True, "mixed") == (16, 4)


def test_shuffled_text_keeps_the_words_and_loses_the_order():
    text = " ".join(f"w{i}" for i in range(50))
    out = bench.shuffle_words(text, random.Random(0))
    assert sorted(out.split()) == sorted(text.split()) and out != text


def test_prompts_file_needs_a_prompt_field(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "def f(x):"}\n\n{"prompt": "import os", "kind": "code"}\n')
    assert [(p.text, p.kind) for p in bench.read_prompts(good)] == [("def f(x):", "file"), ("import os", "code")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        bench.read_prompts(bad)
    temps = tmp_path / "t.jsonl"
    temps.write_text('{"prompt": "a", "temperature": 0.7}\n{"prompt": "b"}\n')
    assert [p.temperature for p in bench.read_prompts(temps)] == [0.7, None]
    temps.write_text('{"prompt": "a", "temperature": "hot"}\n')
    with pytest.raises(SystemExit, match="t.jsonl:1.*temperature"):
        bench.read_prompts(temps)


# ---- metrics arithmetic -------------------------------------------------------------------------------------
def _exposition(model: str, steps: int, accepted: int, k_sum: float, k_count: int, sched: list[int],
                cpu: list[int] | None = None) -> str:
    labels = f'model="{model}",version="1"'
    lines = [
        "# TYPE lightspec:spec_decode_num_steps_total counter",
        f"lightspec:spec_decode_num_steps_total{{{labels}}} {steps}",
        f"lightspec:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        'lightspec:spec_decode_num_accepted_tokens_total{model="other",version="1"} 999',
        f"lightspec:draft_tokens_per_step_sum{{{labels}}} {k_sum}",
        f"lightspec:draft_tokens_per_step_count{{{labels}}} {k_count}",
        f"lightspec:num_preemptions_total{{{labels}}} 0",
    ]
    for le, n in zip(["0.0001", "0.001", "+Inf"], sched):
        lines.append(f'lightspec:scheduler_decision_seconds_bucket{{{labels},le="{le}"}} {n}')
    for le, n in zip(["0.0001", "0.001", "+Inf"], cpu or []):
        lines.append(f'lightspec:scheduler_decision_cpu_seconds_bucket{{{labels},le="{le}"}} {n}')
    return "\n".join(lines) + "\n"


def test_server_stats_are_differences_between_two_scrapes():
    before = bench.parse_metrics(_exposition("m", 10, 5, 20.0, 10, [10, 10, 10], [10, 10, 10]))
    after = bench.parse_metrics(_exposition("m", 30, 35, 80.0, 30, [10, 110, 110], [110, 110, 110]))
    s = bench.server_stats(before, after, "m")
    assert s["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)  # counts the bonus token
    assert s["mean_draft_tokens_per_step"] == pytest.approx(60 / 20)
    # all 100 new decisions fall in (0.1 ms, 1 ms]: p50 interpolates to the middle of that bucket
    assert s["scheduler_p50_ms"] == pytest.approx(0.1 + 0.9 * 0.5)
    assert s["scheduler_p99_ms"] == pytest.approx(0.1 + 0.9 * 0.99)
    # the same decisions' CPU time all fell at or under 0.1 ms (their wall time waited on the GIL)
    assert s["scheduler_cpu_p99_ms"] == pytest.approx(0.1 * 0.99)
    assert bench.server_stats(None, after, "m")["mean_acceptance_length"] is None


def test_histogram_quantile_follows_prometheus():
    buckets = [(0.001, 50.0), (0.01, 90.0), (float("inf"), 100.0)]
    assert bench.histogram_quantile(0.5, buckets) == pytest.approx(0.001)
    assert bench.histogram_quantile(0.7, buckets) == pytest.approx(0.001 + 0.009 * 0.5)
    assert bench.histogram_quantile(0.99, buckets) == pytest.approx(0.01)  # +Inf bucket: largest finite bound
    assert bench.histogram_quantile(0.5, []) is None


def test_client_stats_from_records():
    recs = [
        bench.Record("code", t_send=0.0, t_first=0.1, t_last=0.5, t_end=0.5, tokens=5, responses=3, drafted=8,
                     accepted=4),
        bench.Record("code", t_send=0.0, t_first=0.3, t_last=0.3, t_end=0.3, tokens=1, responses=1),
        bench.Record("code", t_send=0.0, t_end=0.2, error="boom"),
    ]  # fmt: skip
    s = bench.client_stats(recs, duration=1.0)
    assert (s["requests"], s["errors"], s["output_tokens"]) == (3, 1, 6)
    assert s["throughput_tok_s"] == 6.0
    assert s["mean_latency_s"] == pytest.approx(0.4) and s["mean_ttft_s"] == pytest.approx(0.2)
    assert s["mean_itl_s"] == pytest.approx(0.4 / 4)
    assert s["acceptance_rate"] == 0.5 and s["tokens_per_step"] == pytest.approx(4 / 2)


def test_ratio_table_compares_with_none_at_the_same_load():
    def run(config, method, c, tps, lat):
        return {
            "config": config,
            "method": method,
            "concurrency": c,
            "rate": None,
            "throughput_tok_s": tps,
            "mean_latency_s": lat,
            "p99_latency_s": lat,
            "mean_ttft_s": 0.01,
            "mean_itl_s": 0.002,
            "mean_acceptance_length": 2.0,
            "mean_draft_tokens_per_step": 1.5,
            "scheduler_p99_ms": 0.05,
        }

    runs = [run("none", "none", 1, 100, 1.0), run("dynamic", "mtp", 1, 150, 0.5), run("none", "none", 4, 200, 2.0),
            run("dynamic", "mtp", 4, 100, 4.0)]  # fmt: skip
    rows = {(r["method"], r["concurrency"]): r for r in bench.ratio_rows(runs)}
    assert rows[("mtp", 1)]["throughput_ratio"] == 1.5 and rows[("mtp", 1)]["latency_ratio"] == 0.5
    assert rows[("mtp", 4)]["throughput_ratio"] == 0.5 and rows[("mtp", 4)]["latency_ratio"] == 2.0
    table = bench.format_table(runs)
    assert re.search(r"dynamic\s+mtp\s+c=1\s+150\.0\s+1\.50x\s+0\.500\s+0\.50x", table), table


def test_repeats_keep_the_median_throughput_run_per_configuration_and_load():
    def run(model, c, tps, rnd):
        return {"model": model, "concurrency": c, "rate": None, "throughput_tok_s": tps, "repeat": rnd}

    runs = [run("a", 1, 10.0, 0), run("b", 1, 5.0, 0), run("a", 1, 30.0, 1), run("b", 1, 6.0, 1),
            run("a", 1, 20.0, 2), run("b", 1, 1.0, 2)]  # fmt: skip
    merged = bench.median_runs(runs)
    assert [(r["model"], r["throughput_tok_s"], r["repeat"]) for r in merged] == [("a", 20.0, 2), ("b", 5.0, 0)]
    assert merged[0]["throughput_repeats"] == [10.0, 30.0, 20.0]


def test_sweep_runs_each_load_back_to_back_in_serpentine_order():
    configs, loads = ["none", "s1", "s4", "dyn"], [1, 4, 16]
    r0 = bench.sweep_order(configs, loads, 0)
    r1 = bench.sweep_order(configs, loads, 1)
    for seq in (r0, r1):  # every run once per round, one load at a time
        assert sorted(seq) == sorted((c, lv) for c in configs for lv in loads)
        assert [lv for _, lv in seq] == [1] * 4 + [4] * 4 + [16] * 4
    assert [c for c, _ in r0] == configs + configs[::-1] + configs
    assert [c for c, _ in r1] == configs[::-1] + configs + configs[::-1]  # the next round starts the other way
    # consecutive loads share their boundary configuration: no model switch there
    assert all(r0[4 * i + 3][0] == r0[4 * i + 4][0] for i in range(2))
    assert bench.sweep_order(configs, loads, 1, "config") == [(c, lv) for c in configs for lv in loads]
    with pytest.raises(ValueError, match="order='random'"):
        bench.sweep_order(configs, loads, 0, "random")


def test_dynamic_is_compared_with_the_best_static_depth_per_level_round_by_round_and_on_average():
    def run(config, method, c, repeats):
        ranked = sorted(repeats)
        return {"config": config, "method": method, "concurrency": c, "rate": None,
                "throughput_tok_s": ranked[(len(ranked) - 1) // 2], "throughput_repeats": repeats}

    runs = [run("none", "none", 1, [100, 80, 90]), run("none", "none", 8, [400, 400, 400]),
            run("static:1", "mtp", 1, [150, 120, 130]), run("static:4", "mtp", 1, [200, 100, 170]),
            run("static:1", "mtp", 8, [700, 600, 640]), run("static:4", "mtp", 8, [500, 500, 520]),
            run("dynamic", "mtp", 1, [180, 110, 160]), run("dynamic", "mtp", 8, [720, 560, 600])]  # fmt: skip
    rows = bench.dynamic_vs_static(runs)
    by_load = {r["load"]: r for r in rows}
    # c=1: static:4 has the best median (170 > 130); dynamic's median 160
    assert by_load[1]["best_static"] == "static:4" and by_load[1]["ratio"] == pytest.approx(160 / 170)
    assert by_load[1]["rounds"] == pytest.approx([180 / 200, 110 / 100, 160 / 170])
    assert by_load[1]["dynamic_x_none"] == pytest.approx(160 / 90)
    # c=8: static:1 is the best there
    assert by_load[8]["best_static"] == "static:1" and by_load[8]["ratio"] == pytest.approx(600 / 640)
    # over the levels: static:1 averages (130/90 + 640/400) / 2 = 1.522x none, static:4 (170/90 + 500/400) / 2
    # = 1.569x: static:4 is the best on average, and dynamic's (160/90 + 600/400) / 2 = 1.639x is 1.04x it
    mean = by_load[None]
    assert mean["best_static"] == "static:4"
    assert mean["ratio"] == pytest.approx((160 / 90 + 600 / 400) / (170 / 90 + 500 / 400))
    printed = bench.format_comparison(rows)
    assert re.search(r"mtp\s+c=1\s+static:4\s+0\.94x\s+\[0\.90 1\.10 0\.94\]\s+dynamic 1\.78x none", printed), printed
    assert bench.dynamic_vs_static([r for r in runs if r["config"] != "dynamic"]) == []


# ---- one short sweep through a real server --------------------------------------------------------------------
@pytest.mark.triton
def test_bench_sweep_against_a_real_server_writes_json_table_and_plot(smoke_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path / "cache"))
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    argv = ["bench", "--model-dir", str(smoke_model / "target"), "--configs", "none", "dynamic",
            "--concurrency", "1", "2", "--requests", "2", "--max-tokens", "8", "--num-prompts", "4",
            "--workload", "mixed", "--warmup", "1", "--set", "num_threads=1", "--set", "num_kv_blocks=64",
            "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    pid = int(re.search(r"tritonserver pid (\d+)", printed).group(1))
    assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()

    # they ran load by load, serpentine (none, dynamic at c=1; dynamic, none at c=2) ...
    ran = re.findall(r"^\s+(\w+)\s+(\S+)\s+(c=\d+)\s+[\d.]+ tok/s", printed, flags=re.M)
    assert ran == [("none", "none", "c=1"), ("mtp", "dynamic", "c=1"), ("mtp", "dynamic", "c=2"),
                   ("none", "none", "c=2")], printed  # fmt: skip
    assert len(re.findall(r": ready in", printed)) == 3  # one switch saved at the c=1/c=2 boundary
    # ... and come back configuration by configuration
    runs = json.loads(out.read_text())["runs"]
    assert [(r["config"], r["method"], r["concurrency"]) for r in runs] == [
        ("none", "none", 1), ("none", "none", 2), ("dynamic", "mtp", 1), ("dynamic", "mtp", 2)]  # fmt: skip
    for r in runs:
        for key, kind in RUN_KEYS.items():
            assert isinstance(r[key], kind) or (kind is float and isinstance(r[key], int)), (key, r[key])
        assert (r["requests"], r["errors"], r["output_tokens"]) == (2, 0, 16)
        assert r["mean_ttft_s"] <= r["mean_latency_s"] <= r["p99_latency_s"] + 1e-9
        assert r["mean_acceptance_length"] >= 1.0 and r["scheduler_p99_ms"] >= 0
        assert set(r["by_kind"]) == {"code", "shuffled"}
    assert runs[0]["mean_acceptance_length"] == 1.0 and runs[0]["mean_draft_tokens_per_step"] == 0.0

    assert re.search(r"none\s+none\s+c=1\s+[\d.]+\s+1\.00x\s+[\d.]+\s+1\.00x", printed), printed
    assert re.search(r"dynamic\s+mtp\s+c=2\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+[\d.]+x", printed), printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_server_stats_split_a_step_into_stage_calls():
    """Mean target and propose stage latency per call and the engine's step count, as differences."""
    def expo(steps, tgt_sum, tgt_n, mtp_sum, mtp_n):
        lab = 'model="m",version="1"'
        return "\n".join([
            f"lightspec:engine_steps_total{{{lab}}} {steps}",
            f'lightspec:stage_latency_seconds_sum{{{lab},stage="target"}} {tgt_sum}',
            f'lightspec:stage_latency_seconds_count{{{lab},stage="target"}} {tgt_n}',
            f'lightspec:stage_latency_seconds_sum{{{lab},stage="mtp"}} {mtp_sum}',
            f'lightspec:stage_latency_seconds_count{{{lab},stage="mtp"}} {mtp_n}',
            f'lightspec:stage_latency_seconds_sum{{model="other",stage="target"}} 99',
            f'lightspec:stage_latency_seconds_count{{model="other",stage="target"}} 1',
        ]) + "\n"
    before = bench.parse_metrics(expo(5, 0.010, 5, 0.004, 4))
    after = bench.parse_metrics(expo(105, 0.310, 105, 0.104, 54))
    s = bench.server_stats(before, after, "m")
    assert s["engine_steps"] == 100
    assert s["target_stage_ms"] == pytest.approx(3.0)
    assert s["propose_stage_ms"] == pytest.approx(2.0)
    none = bench.server_stats(before, before, "m")  # no calls between the scrapes: no mean
    assert none["target_stage_ms"] is None and none["propose_stage_ms"] is None
    assert s["target_compute_ms"] is None and s["policy_draft_cost_ms"] is None  # not in these scrapes


def test_server_stats_take_the_target_stage_compute_from_triton_and_the_policy_gauge():
    """Triton's own compute time per execution of the target stage (its nv_inference counters, a
    difference between scrapes) and the dynamic policy's draft price (a gauge: its value after)."""
    def expo(execs, us, cost):
        return "\n".join([
            f'nv_inference_exec_count{{model="{bench.TARGET_STAGE}",version="1"}} {execs}',
            f'nv_inference_compute_infer_duration_us{{model="{bench.TARGET_STAGE}",version="1"}} {us}',
            f'nv_inference_exec_count{{model="m",version="1"}} 7',
            f'nv_inference_compute_infer_duration_us{{model="m",version="1"}} 9999',
            f'lightspec:policy_draft_cost_seconds{{model="m",version="1"}} {cost}',
        ]) + "\n"
    s = bench.server_stats(bench.parse_metrics(expo(10, 50_000, 0.001)), bench.parse_metrics(expo(110, 750_000, 0.0003)), "m")
    assert s["target_compute_ms"] == pytest.approx(7.0)
    assert s["policy_draft_cost_ms"] == pytest.approx(0.3)
