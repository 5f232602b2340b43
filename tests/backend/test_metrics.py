"""Engine stats -> Triton metric families (through the fake pb_utils)."""

from __future__ import annotations

from lightspec_backend.metrics import MetricsReporter

from tests.fakes import FakeMetricFamily, FakePbUtils

LABELS = {"model": "lightspec", "version": "1"}


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
    assert fam["lightspec:spec_decode_num_draft_tokens_total"].kind == FakeMetricFamily.COUNTER
    assert pb.metric_value("lightspec:spec_decode_num_draft_tokens_total") == 15
    assert pb.metric_value("lightspec:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
    assert pb.metric_value("lightspec:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert fam["lightspec:num_requests_running"].kind == FakeMetricFamily.GAUGE
    assert pb.metric_value("lightspec:num_requests_running") == 0
    assert pb.metric_value("lightspec:kv_cache_usage_ratio") == 0.25
    assert all(m.labels["model"] == "lightspec" for f in fam.values() for m in f.metrics)


def test_counter_never_decreases():
    pb = FakePbUtils()
    r = MetricsReporter(pb, LABELS)
    r.publish({"generation_tokens_total": 7}, [])
    r.publish({"generation_tokens_total": 3}, [])  # a restarted engine must not make Triton's counter go down
    assert pb.metric_value("lightspec:generation_tokens_total") == 7


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
    assert pb.families["lightspec:draft_tokens_per_step"].metrics[0].buckets[0] == 0


def test_non_numeric_snapshot_values_are_skipped():
    pb = FakePbUtils()
    MetricsReporter(pb, LABELS).publish({"name": "x", "flag": True}, [])
    assert pb.families == {}
