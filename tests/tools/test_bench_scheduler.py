"""``python tools/bench_scheduler.py``: the decision-time micro-benchmark, in a few steps."""

from __future__ import annotations

from tools import bench_scheduler


def test_decisions_are_timed_and_the_static_policy_drafts_its_k(capsys):
    rows = bench_scheduler.main(["--requests", "4", "--steps", "200", "--policy", "static"])
    assert [r["requests"] for r in rows] == [4]
    r = rows[0]
    assert 0 <= r["cpu_p50_ms"] and 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["drafts_per_request"] > 3.5  # static:4, every request 4 once the prompts are in
    assert "   static" in capsys.readouterr().out


def test_the_dynamic_policy_drafts_for_some_requests():
    r = bench_scheduler.measure(8, 60, policy="dynamic", floors=True)
    assert r["policy"] == "dynamic" and 0 < r["drafts_per_request"] <= 4
