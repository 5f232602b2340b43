"""Runtime statistics: collected here (no I/O), reported elsewhere (Triton metrics, logs, bench).

Counters and gauges are read with :meth:`RuntimeStats.snapshot`; histogram samples are buffered and
handed over by :meth:`RuntimeStats.drain_observations` (bounded, so an exporter that never drains
cannot grow memory).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..spec.cost import CostModel
    from .block_manager import BlockManager
    from .scheduler import Scheduler
    from .sequence import Sequence

# How a request ended -> the ``finished_reason`` it is counted under (vLLM's FinishReason names).
FINISHED_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}


class RuntimeStats:
    def __init__(self, max_k: int, max_buffer: int = 100_000):
        self.counters = {
            "spec_decode_num_draft_tokens_total": 0,
            "spec_decode_num_accepted_tokens_total": 0,
            "spec_decode_num_steps_total": 0,  # request-steps that carried >= 1 draft
            "spec_decode_num_stopped_drafts_total": 0,  # granted draft slots the proposer left empty
            "spec_decode_num_fused_drafts_total": 0,  # drafts the target stage proposed with its previous step
            "num_preemptions_total": 0,
            "generation_tokens_total": 0,
            "prompt_tokens_total": 0,
            "prefix_cache_queries_total": 0,  # prompt tokens of admitted requests
            "prefix_cache_hits_total": 0,  # of which the prefix cache held
            "engine_steps_total": 0,
            "request_failure_total": 0,  # engine errors; rejected requests are added in snapshot()
        }
        self.finished = dict.fromkeys(FINISHED_REASONS.values(), 0)  # by vLLM finished_reason
        self._rejected = 0  # requests refused as invalid, counted from any thread
        self._rejected_lock = threading.Lock()
        self.accepted_per_pos = [0] * max(max_k, 1)
        self.drafted_per_pos = [0] * max(max_k, 1)
        self.gauges = {
            "num_requests_running": 0,
            "num_requests_waiting": 0,
            "kv_cache_usage_ratio": 0.0,
            "kv_cache_fragmentation_ratio": 0.0,
            "stage_inflight_calls": 0,
        }
        self._obs: deque[tuple[str, float, dict]] = deque(maxlen=max_buffer)

    def observe(self, name: str, value: float, labels: dict | None = None) -> None:
        self._obs.append((name, float(value), labels or {}))

    def count_finished(self, reason: str) -> None:
        """A request ended: ``stop``/``length``/``cancelled`` count as finished, anything else failed."""
        label = FINISHED_REASONS.get(reason)
        if label is None:
            self.counters["request_failure_total"] += 1
        else:
            self.finished[label] += 1

    def count_rejected(self) -> None:
        """A request refused before it ran (INVALID_ARG): counted as a failure. Thread-safe."""
        with self._rejected_lock:
            self._rejected += 1

    def observe_verification(self, drafted: int, accepted: int) -> None:
        c = self.counters
        c["spec_decode_num_draft_tokens_total"] += drafted
        c["spec_decode_num_accepted_tokens_total"] += accepted
        if drafted:
            c["spec_decode_num_steps_total"] += 1
        for j in range(drafted):
            self.drafted_per_pos[j] += 1
            if j < accepted:
                self.accepted_per_pos[j] += 1

    def observe_decision(self, seconds: float, ks: list[int], cpu_seconds: float | None = None) -> None:
        self.observe("scheduler_decision_seconds", seconds)
        if cpu_seconds is not None:
            self.observe("scheduler_decision_cpu_seconds", cpu_seconds)
        for k in ks:
            self.observe("draft_tokens_per_step", k)

    def observe_tokens(self, seq: Sequence, now: float) -> None:
        """A step gave ``seq`` tokens at ``now`` (before the engine stamps it with that time)."""
        if seq.t_first_token is None:
            self.observe("time_to_first_token_seconds", now - seq.t_arrival)
            # at its first token, as vLLM counts it: a request cancelled in the queue computed no prompt
            self.counters["prompt_tokens_total"] += seq.prompt_len
        elif seq.t_last_token is not None:
            # per step, as vLLM counts it: the tokens of one step (accepted drafts) arrive together
            self.observe("inter_token_latency_seconds", now - seq.t_last_token)

    def observe_finished(self, seq: Sequence, reason: str, now: float) -> None:
        """A finished request's times and sizes, as vLLM's request-level histograms define them."""
        self.count_finished(reason)
        self.observe("e2e_request_latency_seconds", now - seq.t_arrival)
        scheduled = seq.t_scheduled if seq.t_scheduled is not None else now
        first = seq.t_first_token if seq.t_first_token is not None else now
        self.observe("request_queue_time_seconds", scheduled - seq.t_arrival)
        self.observe("request_prefill_time_seconds", max(0.0, first - scheduled))
        self.observe("request_decode_time_seconds", max(0.0, (seq.t_last_token or first) - first))
        self.observe("request_prompt_tokens", seq.prompt_len)
        self.observe("request_generation_tokens", seq.num_output)

    def update_gauges(self, scheduler: Scheduler, blocks: BlockManager, inflight: int, cost: CostModel | None) -> None:
        """The gauges after a step; ``cost``: the dynamic policy's model (None for a static policy)."""
        g, c = self.gauges, self.counters
        g["num_requests_running"] = len(scheduler.running)
        g["num_requests_waiting"] = len(scheduler.waiting)
        g["kv_cache_usage_ratio"] = blocks.usage()  # exported as vllm:kv_cache_usage_perc (a fraction)
        g["kv_cache_fragmentation_ratio"] = blocks.fragmentation()
        g["stage_inflight_calls"] = inflight
        c["num_preemptions_total"] = scheduler.num_preemptions
        c["prefix_cache_queries_total"] = scheduler.prefix_queries
        c["prefix_cache_hits_total"] = scheduler.prefix_hits
        if cost is not None:  # what the dynamic policy believes a step costs, at today's batch
            g["policy_draft_cost_seconds"] = cost.per_slot(max(len(scheduler.running), 1))
            g["policy_step_excess_seconds"] = cost.verify_extra
            g["policy_step_overhead_seconds"] = cost.overhead

    def mean_acceptance_length(self) -> float:
        """1 + accepted / request-steps with drafts (vLLM's definition, counting the bonus token)."""
        steps = self.counters["spec_decode_num_steps_total"]
        return 1.0 + self.counters["spec_decode_num_accepted_tokens_total"] / steps if steps else 1.0

    def snapshot(self) -> dict:
        d: dict = dict(self.counters)
        with self._rejected_lock:
            d["request_failure_total"] += self._rejected
        d["request_success_total"] = dict(self.finished)
        d.update(self.gauges)
        d["spec_decode_num_accepted_tokens_per_pos_total"] = list(self.accepted_per_pos)
        d["spec_decode_num_draft_tokens_per_pos_total"] = list(self.drafted_per_pos)
        d["mean_acceptance_length"] = self.mean_acceptance_length()
        return d

    def drain_observations(self) -> list[tuple[str, float, dict]]:
        out = []
        while self._obs:
            out.append(self._obs.popleft())
        return out
