"""Engine stats -> Triton metric families (through the fake pb_utils)."""

from __future__ import annotations

import pytest
from lightspec_backend.metrics import MetricsReporter

from tests.fakes import FakeMetric, FakeMetricFamily, FakePbUtils

LABELS = {"model_name": "lightspec", "engine": "0"}


def snapshot(**kw):
    base = {
        "spec_decode_num_draft_tokens_total": 10,
        "spec_decode_num_accepted_tokens_per_pos_total": [4, 2],
        "num_requests_running": 3,
        "kv_cache_usage_ratio": 0.25,
        "mean_acceptance_length": 1.6,
    }
    return {**base, **kw}


def test_counters_gauges_and_positions():
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    r.publish(snapshot(), [])
    r.publish(
        snapshot(
            spec_decode_num_draft_tokens_total=15,
            num_requests_running=0,
            spec_decode_num_accepted_tokens_per_pos_total=[5, 2],
        ),
        [],
    )
    fam = pb.families
    assert fam["vllm:spec_decode_num_draft_tokens_total"].kind == FakeMetricFamily.COUNTER
    assert pb.metric_value("vllm:spec_decode_num_draft_tokens_total") == 15
    assert pb.metric_value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
    assert pb.metric_value("vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert fam["vllm:num_requests_running"].kind == FakeMetricFamily.GAUGE
    assert pb.metric_value("vllm:num_requests_running") == 0
    assert pb.metric_value("vllm:kv_cache_usage_perc") == 0.25
    assert fam["lightspec:mean_acceptance_length"].kind == FakeMetricFamily.GAUGE  # vLLM has no such gauge
    assert all(m.labels["model_name"] == "lightspec" for f in fam.values() for m in f.metrics)


def test_counter_never_decreases():
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    r.publish({"generation_tokens_total": 7}, [])
    r.publish({"generation_tokens_total": 3}, [])  # a restarted engine must not make Triton's counter go down
    assert pb.metric_value("vllm:generation_tokens_total") == 7


def test_observations_become_histograms_with_labels():
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    r.publish(
        {},
        [
            ("stage_latency_seconds", 0.01, {"stage": "target"}),
            ("stage_latency_seconds", 0.02, {"stage": "mtp"}),
            ("draft_tokens_per_step", 3, {}),
            ("stage_latency_seconds", 0.03, {"stage": "target"}),
        ],
    )
    fam = pb.families["lightspec:stage_latency_seconds"]
    assert fam.kind == FakeMetricFamily.HISTOGRAM
    assert pb.metric_value("lightspec:stage_latency_seconds", stage="target") == 2
    assert pb.metric_value("lightspec:stage_latency_seconds", stage="mtp") == 1
    assert pb.metric_value("lightspec:draft_tokens_per_step_count") == 1


def bucket_values(pb, family: str) -> dict[str, float]:
    return {m.labels["le"]: m.value for m in pb.families[family].metrics}


def test_per_token_histograms_are_binned_into_counter_series_once_per_publish(monkeypatch):
    """Prometheus' histogram series, built here: cumulative ``le`` buckets, ``_sum``, ``_count``,
    one increment per bucket that changed, however many observations a publish carries."""
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    r.publish({}, [("inter_token_latency_seconds", v, {}) for v in (0.004, 0.01, 0.03, 0.03, 100.0)])
    r.publish({}, [("inter_token_latency_seconds", 0.06, {}), ("draft_tokens_per_step", 2, {})])
    assert "vllm:inter_token_latency_seconds" not in pb.families
    buckets = bucket_values(pb, "vllm:inter_token_latency_seconds_bucket")
    assert (buckets["0.01"], buckets["0.025"], buckets["0.05"], buckets["0.075"], buckets["80"]) == (2, 2, 4, 5, 5)
    assert buckets["+Inf"] == 6 and len(buckets) == 20  # vLLM's 19 bounds and +Inf
    assert pb.metric_value("vllm:inter_token_latency_seconds_count") == 6
    assert pb.metric_value("vllm:inter_token_latency_seconds_sum") == pytest.approx(100.134)
    assert pb.families["vllm:inter_token_latency_seconds_count"].kind == FakeMetricFamily.COUNTER
    k = bucket_values(pb, "lightspec:draft_tokens_per_step_bucket")
    assert (k["1"], k["2"], k["+Inf"]) == (0, 1, 1)
    increments: list[float] = []
    real = FakeMetric.increment
    monkeypatch.setattr(FakeMetric, "increment", lambda m, v: (increments.append(v), real(m, v)))
    r.publish({}, [("inter_token_latency_seconds", 0.02, {}) for _ in range(1000)])
    assert bucket_values(pb, "vllm:inter_token_latency_seconds_bucket")["0.025"] == 1002
    assert len(increments) == 19 + 2  # the buckets from 0.025 up (18 bounds and +Inf), _sum, _count: not 1000


def test_non_numeric_snapshot_values_are_skipped():
    pb = FakePbUtils()
    MetricsReporter(pb, LABELS).publish({"name": "x", "flag": True}, [])
    assert pb.families == {}


def test_vllm_names_for_vllm_quantities_and_no_old_duplicates():
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS, max_model_len=100)
    r.publish(
        {"request_success_total": {"stop": 2, "length": 1, "abort": 0}, "request_failure_total": 3,
         "spec_decode_num_steps_total": 4, "prompt_tokens_total": 9},
        [("inter_token_latency_seconds", 0.02, {}), ("request_generation_tokens", 7, {}),
         ("time_to_first_token_seconds", 0.1, {})],
    )  # fmt: skip
    assert pb.metric_value("vllm:request_success_total", finished_reason="stop") == 2
    assert pb.metric_value("vllm:request_success_total", finished_reason="length") == 1
    assert pb.metric_value("lightspec:request_failure_total") == 3
    assert pb.metric_value("vllm:spec_decode_num_drafts_total") == 4
    assert pb.metric_value("vllm:prompt_tokens_total") == 9
    assert pb.families["vllm:inter_token_latency_seconds_bucket"].kind == FakeMetricFamily.COUNTER
    # vLLM's buckets: 1-2-5 up to the context length for token counts, its TTFT list for latency
    assert pb.families["vllm:request_generation_tokens"].metrics[0].buckets == [1, 2, 5, 10, 20, 50, 100]
    assert pb.families["vllm:time_to_first_token_seconds"].metrics[0].buckets[:3] == [0.001, 0.005, 0.01]
    assert not [
        n
        for n in pb.families
        if n.startswith("lightspec:")
        and n[len("lightspec:") :]
        in ("spec_decode_num_steps_total", "request_success_total", "kv_cache_usage_ratio", "num_requests_running")
    ]


def test_grafana_dashboard_reads_only_exported_metrics():
    import json
    import re
    from pathlib import Path

    from lightspec_backend.metrics import DESCRIPTIONS, HISTOGRAM_BUCKETS, exported_name

    dash = json.loads((Path(__file__).parents[2] / "docs" / "grafana" / "lightspec.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm|lightspec):[a-z0-9_]+)", e)}
    stats = set(DESCRIPTIONS) | set(HISTOGRAM_BUCKETS) | {"request_prompt_tokens", "request_generation_tokens"}
    exported = {exported_name(s) + sfx for s in stats for sfx in ("", "_bucket", "_sum", "_count")}
    assert used and used <= exported, used - exported


def test_finished_request_counters_are_published_after_every_other_metric(monkeypatch):
    """``lightspec bench`` scrapes until the finished-request counter counts its run: that scrape
    must already hold the run's other counters and histogram observations."""
    order = []
    for method in ("increment", "observe", "set"):
        real = getattr(FakeMetric, method)

        def spy(self, v, real=real):
            order.append(self.family.name)
            real(self, v)

        monkeypatch.setattr(FakeMetric, method, spy)
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    snap = {"request_success_total": {"length": 2}, "request_failure_total": 1, **snapshot(engine_steps_total=9)}
    r.publish(snap, [("scheduler_decision_seconds", 0.001, {}), ("inter_token_latency_seconds", 0.02, {})])
    finished = [i for i, name in enumerate(order) if "request_success" in name or "request_failure" in name]
    assert len(finished) == 2 and len(order) > 2
    assert min(finished) == len(order) - 2, order
    assert pb.metric_value("lightspec:scheduler_decision_seconds") == 1
