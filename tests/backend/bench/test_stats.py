"""``lightspec_backend.bench.stats``: quantiles, client-side numbers, medians over rounds, ratios."""

from __future__ import annotations

import pytest
from lightspec_backend.bench.client import Record
from lightspec_backend.bench.runner import cpu_times, steal_share
from lightspec_backend.bench.stats import (
    client_stats,
    dynamic_vs_static,
    histogram_quantile,
    kind_stats,
    median_runs,
    ratio_rows,
    run_caveats,
    underloaded,
)


def test_histogram_quantile_follows_prometheus():
    buckets = [(0.001, 50.0), (0.01, 90.0), (float("inf"), 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.001)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.001 + 0.009 * 0.5)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.01)  # +Inf bucket: largest finite bound
    assert histogram_quantile(0.5, []) is None


def _records() -> list[Record]:
    return [
        Record("code", t_send=0.0, t_first=0.1, t_last=0.5, t_end=0.5, tokens=5, responses=3, drafted=8, accepted=4),
        Record("code", t_send=0.0, t_first=0.3, t_last=0.3, t_end=0.3, tokens=1, responses=1),
        Record("code", t_send=0.0, t_end=0.2, error="boom"),
    ]


def test_client_stats_from_records():
    s = client_stats(_records(), duration=1.0)
    assert (s["requests"], s["errors"], s["output_tokens"]) == (3, 1, 6)
    assert s["throughput_tok_s"] == 6.0
    assert s["mean_latency_s"] == pytest.approx(0.4) and s["mean_ttft_s"] == pytest.approx(0.2)
    assert s["mean_itl_s"] == pytest.approx(0.4 / 4)
    assert s["acceptance_rate"] == 0.5 and s["tokens_per_step"] == pytest.approx(4 / 2)
    assert s["mean_in_flight"] == pytest.approx(0.8)  # two successful requests of 0.4 s in 1 s
    failed = client_stats(_records()[2:], duration=1.0)  # no successful request: no latencies
    assert failed["mean_latency_s"] is None and failed["mean_itl_s"] is None and failed["mean_in_flight"] is None


def test_runs_that_held_fewer_requests_than_their_level_are_named():
    runs = [
        {"server": "lightspec", "model": "lightspec_none", "protocol": "grpc", "concurrency": 64, "requests": 128,
         "mean_in_flight": 63.1},
        {"server": "vllm", "config": "none", "protocol": "http", "concurrency": 64, "requests": 128,
         "mean_in_flight": 21.8},
        {"model": "lightspec_none", "concurrency": 16, "requests": 8, "mean_in_flight": 7.5},  # level > requests
        {"model": "lightspec_none", "concurrency": None, "rate": 2.0, "mean_in_flight": 0.3},  # open loop
    ]  # fmt: skip
    assert underloaded(runs) == [runs[1]]
    low = "note: fewer requests in flight than the level (latency x throughput / tokens): vllm none http c=64: 21.8 in flight"
    assert run_caveats(runs) == [low]
    assert run_caveats(runs[:1]) == []
    runs[0]["cpu_steal_share"], runs[1]["cpu_steal_share"] = 0.28, 0.02
    assert (
        run_caveats(runs)[1]
        == "note: CPU time taken by other machines on the host during: lightspec_none grpc c=64: 28 %"
    )
    runs[1]["errors"] = 3  # failed requests come first: a run with them measured fewer clients
    assert (
        run_caveats(runs)[0]
        == "note: requests failed in: vllm none http c=64: 3 of 128 (their ratios are not the level's)"
    )
    assert len(run_caveats(runs)) == 3


def test_steal_share_is_the_steal_field_of_the_cpu_times_between_two_readings():
    before = [100, 0, 10, 800, 0, 0, 0, 0, 0, 0]
    after = [300, 0, 30, 1000, 0, 0, 0, 70, 0, 0]  # 200 user, 20 system, 200 idle, 70 steal
    assert steal_share(before, after) == pytest.approx(70 / 490)
    assert steal_share(None, after) is None and steal_share(before, before) is None
    assert len(cpu_times()) >= 8  # this machine has /proc/stat


def test_kind_stats_split_the_successful_requests_by_prompt_kind():
    recs = [*_records(), Record("shuffled", t_send=0.0, t_first=0.2, t_last=0.8, t_end=0.8, tokens=3, responses=3)]
    kinds = kind_stats(recs)
    assert set(kinds) == {"code", "shuffled"}
    assert kinds["code"]["requests"] == 2 and kinds["code"]["acceptance_rate"] == 0.5
    assert kinds["shuffled"]["acceptance_rate"] is None and kinds["shuffled"]["tokens_per_step"] == 1.0


def test_ratios_compare_with_none_at_the_same_load():
    def run(method, c, tps, lat):
        return {"method": method, "concurrency": c, "rate": None, "throughput_tok_s": tps, "mean_latency_s": lat}

    runs = [run("none", 1, 100, 1.0), run("mtp", 1, 150, 0.5), run("none", 4, 200, 2.0), run("mtp", 4, 100, 4.0),
            {**run("mtp", None, 90, 1.0), "rate": 2.0}]  # fmt: skip
    rows = {(r["method"], r["concurrency"]): r for r in ratio_rows(runs)}
    assert rows[("mtp", 1)]["throughput_ratio"] == 1.5 and rows[("mtp", 1)]["latency_ratio"] == 0.5
    assert rows[("mtp", 4)]["throughput_ratio"] == 0.5 and rows[("mtp", 4)]["latency_ratio"] == 2.0
    assert rows[("mtp", None)]["throughput_ratio"] is None  # no none run at that rate


def test_repeats_keep_the_median_throughput_run_per_configuration_and_load():
    def run(model, c, tps, rnd):
        return {"model": model, "concurrency": c, "rate": None, "throughput_tok_s": tps, "repeat": rnd}

    runs = [run("a", 1, 10.0, 0), run("b", 1, 5.0, 0), run("a", 1, 30.0, 1), run("b", 1, 6.0, 1),
            run("a", 1, 20.0, 2), run("b", 1, 1.0, 2)]  # fmt: skip
    merged = median_runs(runs)
    assert [(r["model"], r["throughput_tok_s"], r["repeat"]) for r in merged] == [("a", 20.0, 2), ("b", 5.0, 0)]
    assert merged[0]["throughput_repeats"] == [10.0, 30.0, 20.0]


def test_repeats_keep_every_rounds_latencies_and_load_but_not_their_token_ids():
    def run(tps, latency, rnd):
        return {"model": "a", "concurrency": 4, "rate": None, "throughput_tok_s": tps, "repeat": rnd,
                "started_at": 100.0 * rnd, "mean_latency_s": latency, "p99_latency_s": 2 * latency,
                "cpu_steal_share": 0.01 * rnd, "mismatches": rnd, "outputs": [{"prompt": "p", "ids": [rnd]}],
                "engine_steps": 50 + rnd}  # fmt: skip

    (merged,) = median_runs([run(10.0, 1.5, 0), run(30.0, 0.5, 1), run(20.0, 0.8, 2)])
    assert merged["repeat"] == 2 and merged["outputs"] == [{"prompt": "p", "ids": [2]}]
    rounds = merged["round_runs"]
    assert [r["repeat"] for r in rounds] == [0, 1, 2]  # round order, not throughput order
    assert [r["mean_latency_s"] for r in rounds] == [1.5, 0.5, 0.8]
    assert [r["p99_latency_s"] for r in rounds] == [3.0, 1.0, 1.6]
    assert [r["started_at"] for r in rounds] == [0.0, 100.0, 200.0]
    assert [r["mismatches"] for r in rounds] == [0, 1, 2]
    assert all("outputs" not in r and "engine_steps" not in r for r in rounds)


def test_dynamic_is_compared_with_the_best_static_depth_per_level_round_by_round_and_on_average():
    def run(config, method, c, repeats):
        ranked = sorted(repeats)
        return {"config": config, "method": method, "concurrency": c, "rate": None,
                "throughput_tok_s": ranked[(len(ranked) - 1) // 2], "throughput_repeats": repeats}  # fmt: skip

    runs = [run("none", "none", 1, [100, 80, 90]), run("none", "none", 8, [400, 400, 400]),
            run("static:1", "mtp", 1, [150, 120, 130]), run("static:4", "mtp", 1, [200, 100, 170]),
            run("static:1", "mtp", 8, [700, 600, 640]), run("static:4", "mtp", 8, [500, 500, 520]),
            run("dynamic", "mtp", 1, [180, 110, 160]), run("dynamic", "mtp", 8, [720, 560, 600])]  # fmt: skip
    rows = dynamic_vs_static(runs)
    by_load = {r["load"]: r for r in rows}
    assert list(by_load) == [1, 8, None]  # the levels, then their mean
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
    assert dynamic_vs_static([r for r in runs if r["config"] != "dynamic"]) == []


# ---- the peer bench ----------------------------------------------------------------------------------------------
def _peer_run(server, method, config, c, tps, lat=1.0, protocol="http", outputs=None):
    return {"server": server, "method": method, "config": config, "concurrency": c, "rate": None,
            "protocol": protocol, "throughput_tok_s": tps, "mean_latency_s": lat, "outputs": outputs or []}  # fmt: skip


def test_mismatches_count_requests_whose_tokens_differ_from_lightspec_none():
    from lightspec_backend.bench.stats import mark_mismatches

    ref = [{"prompt": "a", "ids": [1, 2]}, {"prompt": "b", "ids": [3, 4]}]
    runs = [
        _peer_run("lightspec", "none", "none", 1, 10, protocol="grpc", outputs=ref),
        _peer_run("lightspec", "mtp", "dynamic", 1, 10, outputs=[*ref, {"prompt": "a", "ids": [1, 9]}]),
        _peer_run("vllm", "none", "none", 1, 10, outputs=[{"prompt": "b", "ids": [3, 4]}, {"prompt": "z", "ids": []}]),
    ]
    marked = mark_mismatches(runs)
    assert [(r["compared"], r["mismatches"], r["unchecked"]) for r in marked] == [(2, 0, 0), (3, 1, 0), (1, 0, 1)]
    assert all("outputs" not in r for r in marked) and "outputs" in runs[0]  # the input is left as it was


def test_every_level_of_lightspec_none_is_a_reference_and_nothing_compared_is_not_zero_differ():
    """One level's run holds only some of the prompts: a difference on a prompt the first ``none``
    run never sent went unseen, and a bench without ``none`` printed 0 differ having compared nothing."""
    from lightspec_backend.bench.stats import mark_mismatches

    c1 = [{"prompt": "a", "ids": [1, 2]}]
    c16 = [{"prompt": "a", "ids": [1, 2]}, {"prompt": "b", "ids": [3, 4]}]
    runs = [
        _peer_run("lightspec", "none", "none", 1, 10, protocol="grpc", outputs=c1),
        _peer_run("lightspec", "none", "none", 16, 10, protocol="grpc", outputs=c16),
        _peer_run(
            "vllm", "none", "none", 16, 10, outputs=[{"prompt": "a", "ids": [1, 2]}, {"prompt": "b", "ids": [3, 9]}]
        ),
    ]
    assert [(r["compared"], r["mismatches"]) for r in mark_mismatches(runs)] == [(1, 0), (2, 0), (2, 1)]
    alone = mark_mismatches(runs[2:])
    assert (alone[0]["compared"], alone[0]["mismatches"], alone[0]["unchecked"]) == (0, None, 2)


def test_peer_ratios_compare_each_lightspec_run_with_vllm_none_and_vllm_best_at_its_level():
    from lightspec_backend.bench.stats import peer_ratios

    runs = [
        _peer_run("lightspec", "none", "none", 1, 100, protocol="grpc"),
        _peer_run("lightspec", "mtp", "dynamic", 1, 300, lat=0.5),
        _peer_run("lightspec", "mtp", "dynamic", 16, 400, lat=2.0),
        _peer_run("vllm", "none", "none", 1, 200, lat=1.0),
        _peer_run("vllm", "ngram", "ngram", 1, 250),
        _peer_run("vllm", "none", "none", 16, 800, lat=4.0),
        _peer_run("vllm", "draft", "draft", 16, 500),
        _peer_run("lightspec", "none", "none", 64, 900),  # no vLLM run at c=64: no ratio
    ]
    rows = peer_ratios(runs)
    assert [(r["load"], r["label"]) for r in rows] == [
        (1, "lightspec none grpc"), (1, "lightspec mtp dynamic http"), (16, "lightspec mtp dynamic http")]  # fmt: skip
    assert [r["x_vllm_none"] for r in rows] == pytest.approx([0.5, 1.5, 0.5])
    assert [(r["vllm_best"], r["x_vllm_best"]) for r in rows] == [("ngram", 0.4), ("ngram", 1.2), ("none", 0.5)]
    assert [r["latency_x_vllm_none"] for r in rows] == pytest.approx([1.0, 0.5, 0.5])
