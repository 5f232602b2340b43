"""``lightspec_backend.bench.scrape``: the server's numbers as differences between two scrapes."""

from __future__ import annotations

import pytest
from lightspec_backend.bench.configs import TARGET_STAGE
from lightspec_backend.bench.scrape import finished_requests, parse_metrics, server_stats


def _exposition(model: str, steps: int, accepted: int, k_sum: float, k_count: int, sched: list[int],
                cpu: list[int] | None = None) -> str:  # fmt: skip
    labels = f'model_name="{model}",engine="0"'
    lines = [
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {steps}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        'vllm:spec_decode_num_accepted_tokens_total{model_name="other",engine="0"} 999',
        f"lightspec:draft_tokens_per_step_sum{{{labels}}} {k_sum}",
        f"lightspec:draft_tokens_per_step_count{{{labels}}} {k_count}",
        f"vllm:num_preemptions_total{{{labels}}} 0",
    ]
    for le, n in zip(["0.0001", "0.001", "+Inf"], sched):
        lines.append(f'lightspec:scheduler_decision_seconds_bucket{{{labels},le="{le}"}} {n}')
    for le, n in zip(["0.0001", "0.001", "+Inf"], cpu or []):
        lines.append(f'lightspec:scheduler_decision_cpu_seconds_bucket{{{labels},le="{le}"}} {n}')
    return "\n".join(lines) + "\n"


def test_parse_metrics_keys_samples_by_name_and_labels():
    ms = parse_metrics('# HELP x a counter\nx{model="m",le="+Inf"} 3\ny 1.5\nz{model="m"} NaN-ish\n')
    assert ms[("x", frozenset({("model", "m"), ("le", "+Inf")}))] == 3.0
    assert ms[("y", frozenset())] == 1.5
    assert len(ms) == 2  # a value that is no number is skipped


def test_server_stats_are_differences_between_two_scrapes():
    before = parse_metrics(_exposition("m", 10, 5, 20.0, 10, [10, 10, 10], [10, 10, 10]))
    after = parse_metrics(_exposition("m", 30, 35, 80.0, 30, [10, 110, 110], [110, 110, 110]))
    s = server_stats(before, after, "m")
    assert s["mean_acceptance_length"] == pytest.approx(1 + 30 / 20)  # counts the bonus token
    assert s["mean_draft_tokens_per_step"] == pytest.approx(60 / 20)
    # all 100 new decisions fall in (0.1 ms, 1 ms]: p50 interpolates to the middle of that bucket
    assert s["scheduler_p50_ms"] == pytest.approx(0.1 + 0.9 * 0.5)
    assert s["scheduler_p99_ms"] == pytest.approx(0.1 + 0.9 * 0.99)
    # the same decisions' CPU time all fell at or under 0.1 ms (their wall time waited on the GIL)
    assert s["scheduler_cpu_p99_ms"] == pytest.approx(0.1 * 0.99)
    assert server_stats(None, after, "m")["mean_acceptance_length"] is None


def test_server_stats_split_a_step_into_stage_calls():
    """Mean target and propose stage latency per call and the engine's step count, as differences."""

    def expo(steps, tgt_sum, tgt_n, mtp_sum, mtp_n):
        lab = 'model_name="m",engine="0"'
        return "\n".join([
            f"lightspec:engine_steps_total{{{lab}}} {steps}",
            f'lightspec:stage_latency_seconds_sum{{{lab},stage="target"}} {tgt_sum}',
            f'lightspec:stage_latency_seconds_count{{{lab},stage="target"}} {tgt_n}',
            f'lightspec:stage_latency_seconds_sum{{{lab},stage="mtp"}} {mtp_sum}',
            f'lightspec:stage_latency_seconds_count{{{lab},stage="mtp"}} {mtp_n}',
            'lightspec:stage_latency_seconds_sum{model_name="other",stage="target"} 99',
            'lightspec:stage_latency_seconds_count{model_name="other",stage="target"} 1',
        ]) + "\n"  # fmt: skip

    before = parse_metrics(expo(5, 0.010, 5, 0.004, 4))
    after = parse_metrics(expo(105, 0.310, 105, 0.104, 54))
    s = server_stats(before, after, "m")
    assert s["engine_steps"] == 100
    assert s["target_stage_ms"] == pytest.approx(3.0)
    assert s["propose_stage_ms"] == pytest.approx(2.0)
    none = server_stats(before, before, "m")  # no calls between the scrapes: no mean
    assert none["target_stage_ms"] is None and none["propose_stage_ms"] is None
    assert s["target_compute_ms"] is None and s["policy_draft_cost_ms"] is None  # not in these scrapes


def test_server_stats_take_the_target_stage_compute_from_triton_and_the_policy_gauge():
    """Triton's own compute time per execution of the target stage (its nv_inference counters, a
    difference between scrapes) and the dynamic policy's draft price (a gauge: its value after)."""

    def expo(execs, us, cost):
        return "\n".join([
            f'nv_inference_exec_count{{model="{TARGET_STAGE}",version="1"}} {execs}',
            f'nv_inference_compute_infer_duration_us{{model="{TARGET_STAGE}",version="1"}} {us}',
            'nv_inference_exec_count{model="m",version="1"} 7',
            'nv_inference_compute_infer_duration_us{model="m",version="1"} 9999',
            f'lightspec:policy_draft_cost_seconds{{model_name="m",engine="0"}} {cost}',
        ]) + "\n"  # fmt: skip

    s = server_stats(parse_metrics(expo(10, 50_000, 0.001)), parse_metrics(expo(110, 750_000, 0.0003)), "m")
    assert s["target_compute_ms"] == pytest.approx(7.0)
    assert s["policy_draft_cost_ms"] == pytest.approx(0.3)


def test_finished_requests_count_successes_and_failures_of_one_model():
    ms = parse_metrics('vllm:request_success_total{model_name="m",finished_reason="stop"} 5\nlightspec:request_failure_total{model_name="m"} 2\n'
                       'vllm:request_success_total{model_name="other",finished_reason="stop"} 9\n')  # fmt: skip
    assert finished_requests(ms, "m") == 7.0
    assert finished_requests(None, "m") == 0.0


def test_engine_processes_follow_the_backends_rule_for_lightspec_orchestrators_only(monkeypatch):
    from lightspec_backend import params
    from lightspec_backend.bench.scrape import engine_processes

    def config(backend: str = "lightspec", **parameters: str) -> dict:
        return {"backend": backend, "parameters": {k: {"string_value": v} for k, v in parameters.items()}}

    monkeypatch.setattr(params, "available_cpus", lambda: 2)
    assert engine_processes(config(speculation="ngram")) == 2
    assert engine_processes(config(speculation="ngram", stages="local")) == 1  # the engine in the orchestrator
    assert engine_processes(config(speculation="ngram", device="cuda")) == 1
    monkeypatch.setattr(params, "available_cpus", lambda: 1)
    assert engine_processes(config(speculation="ngram")) == 1
    assert engine_processes(None) is None  # no configuration came back
    assert engine_processes(config("python")) is None  # another backend's model
    assert engine_processes(config(role="target")) is None  # a stage model runs no engine of its own
    assert engine_processes(config(policy="sometimes")) is None  # parameters the backend would refuse


def test_the_model_configuration_comes_over_http_from_the_servers_http_address(monkeypatch):
    import io
    import json

    from lightspec_backend.bench import scrape as scrape_mod

    asked = []

    def fake_urlopen(url, timeout=None):
        asked.append(url)
        if "missing" in url:
            raise OSError("HTTP Error 400: Bad Request")
        return io.BytesIO(json.dumps({"name": "m", "backend": "lightspec"}).encode())

    monkeypatch.setattr(scrape_mod.urllib.request, "urlopen", fake_urlopen)
    assert scrape_mod.model_config("host:8000", "m", http=True) == {"name": "m", "backend": "lightspec"}
    assert asked == ["http://host:8000/v2/models/m/config"]
    assert scrape_mod.model_config("http://host:8000", "missing", http=True) is None
