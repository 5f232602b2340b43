"""Data parallelism on one machine: :class:`EngineShards` serves through several engine processes
(:class:`~lightspec_core.engine.process.EngineProcess`), each with its own step loop, KV pool and
requests, behind :class:`LLMEngine`'s serving surface (vLLM's ``data_parallel_size``).

Why: on a CPU a speculative step is compute that an engine splits among its OpenMP threads loop by
loop, and every loop ends when its slowest thread does. In a server the front end's processes
(Triton, the stub's responses, a local client) take the cores in short bursts, and each burst that
preempts one of the engine's threads holds the others at the end of their loop. Two engines of one
thread each wait for nothing but their own work; the requests are split between them instead.
docs/benchmarks.md has the measurements.

Requests go to the shard with the fewest in flight (the first on a tie, so that a lone request
always finds the same shard and its prefix cache), among those whose child runs. A shard's failed
step fails its own requests only. Threads follow the load: a shard alone at work
gets every thread the engine was configured with, and the busy shards share them otherwise (the
``threads`` message of the engine process). Statistics are the shards' summed (ratios averaged).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from multiprocessing.connection import wait

from ..config import EngineConfig, SamplingParams
from .outputs import RequestDelta
from .process import EngineProcess, error_delta

log = logging.getLogger("lightspec")

# averaged, not summed: ratios, and what each engine's dynamic policy believes a step costs
MEAN_KEYS = (
    "kv_cache_usage_ratio",
    "kv_cache_fragmentation_ratio",
    "policy_draft_cost_seconds",
    "policy_step_excess_seconds",
    "policy_step_overhead_seconds",
)


def merge_snapshots(snapshots: list[dict]) -> dict:
    """One statistics snapshot from the shards' (:meth:`RuntimeStats.snapshot`): counters and gauges
    summed (lists element by element, dicts key by key), ratios and the policies' prices averaged,
    and the mean acceptance length recomputed from the summed counters."""
    merged: dict = {}
    for key in {k for s in snapshots for k in s}:
        values = [s[key] for s in snapshots if key in s]
        first = values[0]
        if isinstance(first, dict):
            merged[key] = {k: sum(v.get(k, 0) for v in values) for k in {k for v in values for k in v}}
        elif isinstance(first, list):
            merged[key] = [sum(col) for col in zip(*values)]
        elif key in MEAN_KEYS:
            merged[key] = sum(values) / len(values)
        else:
            merged[key] = sum(values)
    steps = merged.get("spec_decode_num_steps_total", 0)
    if "mean_acceptance_length" in merged:
        merged["mean_acceptance_length"] = (
            1.0 + merged["spec_decode_num_accepted_tokens_total"] / steps if steps else 1.0
        )
    return merged


class ShardStats:
    """The shards' :class:`~lightspec_core.engine.process.RemoteStats` read as one."""

    def __init__(self, shards: list[EngineProcess]):
        self._shards = shards

    def count_rejected(self) -> None:
        self._shards[0].stats.count_rejected()

    def snapshot(self) -> dict:
        return merge_snapshots([s.stats.snapshot() for s in self._shards])

    def drain_observations(self) -> list:
        return [o for s in self._shards for o in s.stats.drain_observations()]


class EngineShards:
    """``n`` engine processes serving as one engine. One thread drives it, as with the engine."""

    profile_pending = False  # each shard profiles its stages while it loads

    def __init__(
        self,
        config: EngineConfig,
        n: int,
        threads: int,
        *,
        on_exit: Callable[[str], None] | None = None,
        start_timeout_s: float = 600.0,
        stall_timeout_s: float = 0.0,
    ):
        """``threads``: the intra-op threads the shards share (each loads with all of them: the
        stage profile is taken on idle cores, one shard after the other); ``stall_timeout_s``: see
        :class:`EngineProcess`."""
        if n < 1:
            raise ValueError(f"data_parallel_size={n}: must be at least 1")
        self._total_threads = max(1, threads)
        config = dataclasses.replace(config, num_threads=self._total_threads)
        self.shards: list[EngineProcess] = []
        try:
            for _ in range(n):
                shard = EngineProcess(
                    config, on_exit=on_exit, start_timeout_s=start_timeout_s, stall_timeout_s=stall_timeout_s
                )
                self.shards.append(shard)
        except BaseException:
            self.close()
            raise
        first = self.shards[0]
        self.config, self.max_model_len, self.model_config = first.config, first.max_model_len, first.model_config
        self.tok, self.tokenizer = first.tok, first.tokenizer
        self.pid = first.pid
        self.pids = [s.pid for s in self.shards]
        self.stats = ShardStats(self.shards)
        self._shard_of: dict[str, EngineProcess] = {}
        self._threads = [self._total_threads] * n  # what each shard was last told

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        arrived_at: float | None = None,
    ) -> None:
        if request_id in self._shard_of:
            raise ValueError(f"request_id={request_id!r}: already in use")
        # a shard whose child is gone fails at once whatever it is given, so it always looks the
        # least busy: it gets a request only when no shard is alive (to answer it with its error)
        shard = min(self.shards, key=lambda s: (not s.alive, s.num_unfinished()))
        # a refused prompt raises here, naming the field
        shard.add_request(request_id, prompt, params, add_special_tokens=add_special_tokens, arrived_at=arrived_at)
        self._shard_of[request_id] = shard
        self._share_threads()

    def abort(self, request_id: str, error: str | None = None) -> None:
        shard = self._shard_of.get(request_id)
        if shard is not None:
            shard.abort(request_id, error)

    def has_unfinished(self) -> bool:
        return bool(self._shard_of)

    def profile_stages(self) -> None:
        """Nothing to do: each shard took its stage profile while it loaded."""

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestDelta]:
        """The deltas of every step the shards finished since the last call (waiting for one of
        them when none has any yet)."""
        if on_launched is not None:
            on_launched()
        busy = [s for s in self.shards if s.has_unfinished()]
        if not busy:
            return []
        # a shard whose child is gone answers at once, from what it knows; the others when their
        # child has sent something (a child that dies closes its end, which wakes the wait too)
        now = [s for s in busy if not s.waits_for_child()]
        ready = set(wait([s._conn for s in busy if s not in now], timeout=0 if now else 1.0))
        deltas: list[RequestDelta] = []
        for shard in busy:
            if shard in now or shard._conn in ready:
                deltas += self._step_shard(shard)
        for d in deltas:
            if d.finished:
                self._shard_of.pop(d.request_id, None)
        self._share_threads()
        return deltas

    def _step_shard(self, shard: EngineProcess) -> list[RequestDelta]:
        """A shard's deltas. A failed step fails that shard's requests (as error deltas; the shard
        forgot them), not the other shards', whose deltas of this call would be lost with a raise."""
        try:
            return shard.step()
        except Exception as e:  # noqa: BLE001 - answered as the requests' errors
            log.error("engine process %d: step failed: %s", shard.pid, e)
            return [error_delta(rid, f"engine step failed: {e}") for rid, s in self._shard_of.items() if s is shard]

    def close(self, timeout_s: float = 10.0) -> None:
        for shard in self.shards:
            shard.close(timeout_s)

    def _share_threads(self) -> None:
        """The busy shards split the threads (a shard alone gets them all); an idle shard keeps
        what it had until it gets work again."""
        busy = [i for i, s in enumerate(self.shards) if s.has_unfinished()]
        for i in busy:
            n = max(1, self._total_threads // len(busy))
            if self._threads[i] != n:
                self.shards[i].set_threads(n)
                self._threads[i] = n
