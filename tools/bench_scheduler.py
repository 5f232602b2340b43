"""Micro-benchmark: scheduler + speculation policy decision time per step (no model involved).

python tools/bench_scheduler.py [--requests 32 256] [--steps 2000] [--floors]

Keeps N requests decoding, runs ``Scheduler.schedule()`` (admission, KV checks, per-request k by the
dynamic policy, lookahead reservation) and then a simulated verification that accepts a random
prefix of each request's drafts and rolls back the rest, as the engine does. Prints p50 / p99 of
the decision time, wall clock and the thread's CPU time (on a shared machine the wall p99 is mostly
the moments another process held the core).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from lightspec_core.config import SamplingParams
from lightspec_core.engine.block_manager import BlockManager
from lightspec_core.engine.scheduler import Scheduler
from lightspec_core.engine.sequence import Sequence
from lightspec_core.spec.acceptance import AcceptanceStats
from lightspec_core.spec.cost import CostModel
from lightspec_core.spec.policy import DynamicPolicy, StaticPolicy


def make_policy(policy: str, max_k: int, floors: bool):
    if policy != "dynamic":
        return StaticPolicy(max_k)
    # A cost model like the default model's target served on 2 CPU cores (a 64-request step about
    # 26 ms, a draft 0.1 ms more), so that good requests draft deep and poor ones not at all, as in serving.
    pol = DynamicPolicy(CostModel(verify=(2e-2, 1e-4), propose=(2e-4, 2e-5, 5e-5)))
    pol.floors_wanted = floors  # the confidence stop's floors (confidence_stop: on; off by default)
    return pol


def simulate_update(sched: Scheduler, blocks: BlockManager, acc: AcceptanceStats, it, accept, rng) -> None:
    """The engine's update for one scheduled item: a prefill chunk is computed; a decode step accepts
    ``accept(seq, k)`` of its k drafts (plus the bonus token) and rolls back the rest."""
    s = it.seq
    if not it.samples:
        s.num_computed += it.num_new
        return
    a = accept(s, it.k)
    s.num_computed += it.num_new + a
    s.token_ids.extend(rng.integers(3, 4000, a + 1).tolist())
    s.warm = True
    if it.k:
        s.record_acceptance(it.k, a)
        acc.observe(it.k, a)
    blocks.trim(s.request_id, s.num_tokens)
    if s.num_tokens > 900:  # recycle long requests so the pool never fills
        sched.remove(s)
        s.token_ids = s.token_ids[:64]
        s.reset_for_recompute()
        sched.add(s)


def measure(
    num_requests: int, steps: int, policy: str = "dynamic", max_k: int = 4, seed: int = 0, floors: bool = False
) -> dict:
    rng = np.random.default_rng(seed)
    bs = 16
    blocks = BlockManager(num_requests * 64, bs)
    acc = AcceptanceStats(max_k)
    sched = Scheduler(
        blocks,
        make_policy(policy, max_k, floors),
        acc,
        max_num_seqs=num_requests,
        max_num_batched_tokens=num_requests * (max_k + 1),
        max_draft_tokens=max_k,
        kv_high_water=0.95,
        speculative=True,
    )
    params = SamplingParams(max_tokens=10**6)
    quality = rng.uniform(0.2, 0.95, num_requests)  # per-request acceptance, heterogeneous

    def accept(s: Sequence, k: int) -> int:
        a = 0
        while a < k and rng.random() < quality[int(s.request_id[1:])]:
            a += 1
        return a

    for i in range(num_requests):
        sched.add(Sequence(f"r{i}", rng.integers(3, 4000, 64).tolist(), params, detok=None, seed=i, arrival=i))
    times, cpu, drafts = [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        times.append(time.perf_counter() - t0)
        cpu.append(plan.decision_cpu_seconds)
        drafts.append(sum(plan.ks) / len(plan.items))
        for it in plan.items:  # simulated verification + update
            simulate_update(sched, blocks, acc, it, accept, rng)
    arr = np.array(times[steps // 10 :]) * 1e3  # skip warm-up (prefill steps)
    c = np.array(cpu[steps // 10 :]) * 1e3
    return {
        "requests": num_requests,
        "policy": policy,
        "p50_ms": float(np.percentile(arr, 50)),
        "p99_ms": float(np.percentile(arr, 99)),
        "mean_ms": float(arr.mean()),
        "cpu_p50_ms": float(np.percentile(c, 50)),
        "cpu_p99_ms": float(np.percentile(c, 99)),
        "drafts_per_request": float(np.mean(drafts[steps // 10 :])),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(prog="python tools/bench_scheduler.py", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[32, 256])
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--policy", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--floors", action="store_true", help="also compute the confidence stop's floors")
    a = ap.parse_args(argv)
    rows = []
    print(f"{'requests':>9} {'policy':>8} {'p50 ms':>8} {'p99 ms':>8} {'cpu p50':>8} {'cpu p99':>8}")
    for n in a.requests:
        r = measure(n, a.steps, a.policy, floors=a.floors)
        rows.append(r)
        print(
            f"{n:>9} {a.policy:>8} {r['p50_ms']:>8.3f} {r['p99_ms']:>8.3f} {r['cpu_p50_ms']:>8.3f} {r['cpu_p99_ms']:>8.3f}"
        )
    return rows


if __name__ == "__main__":
    main()
