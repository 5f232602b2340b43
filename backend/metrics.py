"""Engine statistics -> Triton custom metrics (``pb_utils.MetricFamily``).

A quantity vLLM also exports is exported under vLLM's name (``vllm:<name>``, vLLM 0.32's
``v1/metrics/loggers.py`` and ``v1/spec_decode/metrics.py``), with vLLM's label ``model_name``
(and ``engine="0"``) and vLLM's histogram buckets, so dashboards and alerts written for vLLM read
LightSpec unchanged; the others keep the ``lightspec:`` prefix (:data:`VLLM_NAMES` decides).
Triton does not add a ``_total`` suffix, so the counters' family names carry it.

The engine's stats object collects; this module only reports. The mapping is generic so new engine
statistics appear without touching the backend:

- snapshot keys ending in ``_total`` are counters (the engine keeps totals; the reporter increments
  Triton's counter by the difference since the last publish); a list value is one counter per
  position, labelled ``position`` (0-based draft position); a dict value one counter per key,
  labelled as :data:`DICT_LABELS` says;
- other numeric snapshot keys are gauges;
- drained observations ``(name, value, labels)`` are histograms, with the buckets below (the
  per-token ones binned here and exported as counter series, :data:`BINNED_HISTOGRAMS`).

Checked on Triton 2.51: ``MetricFamily.HISTOGRAM`` exists (``Metric(labels, buckets=[...])``,
``observe(v)``) and is exported with ``_bucket``/``_sum``/``_count``; a family is removed from the
metrics endpoint when its Python object is garbage-collected, so the reporter keeps every family.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

# engine statistic -> vLLM's name for the same quantity
VLLM_NAMES = {
    "spec_decode_num_draft_tokens_total": "spec_decode_num_draft_tokens_total",
    "spec_decode_num_accepted_tokens_total": "spec_decode_num_accepted_tokens_total",
    "spec_decode_num_steps_total": "spec_decode_num_drafts_total",
    "spec_decode_num_accepted_tokens_per_pos_total": "spec_decode_num_accepted_tokens_per_pos_total",
    "num_preemptions_total": "num_preemptions_total",
    "generation_tokens_total": "generation_tokens_total",
    "prompt_tokens_total": "prompt_tokens_total",
    "prefix_cache_queries_total": "prefix_cache_queries_total",
    "prefix_cache_hits_total": "prefix_cache_hits_total",
    "request_success_total": "request_success_total",
    "num_requests_running": "num_requests_running",
    "num_requests_waiting": "num_requests_waiting",
    "kv_cache_usage_ratio": "kv_cache_usage_perc",
    "time_to_first_token_seconds": "time_to_first_token_seconds",
    "inter_token_latency_seconds": "inter_token_latency_seconds",
    "e2e_request_latency_seconds": "e2e_request_latency_seconds",
    "request_queue_time_seconds": "request_queue_time_seconds",
    "request_prefill_time_seconds": "request_prefill_time_seconds",
    "request_decode_time_seconds": "request_decode_time_seconds",
    "request_prompt_tokens": "request_prompt_tokens",
    "request_generation_tokens": "request_generation_tokens",
}
DICT_LABELS = {"request_success_total": "finished_reason"}
FINISHED_COUNTERS = ("request_success_total", "request_failure_total")  # published last (MetricsReporter.publish)
PREFIX = "lightspec:"
VLLM_PREFIX = "vllm:"


def exported_name(name: str) -> str:
    """The name an engine statistic is exported under."""
    return VLLM_PREFIX + VLLM_NAMES[name] if name in VLLM_NAMES else PREFIX + name


def build_1_2_5_buckets(max_value: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(float(m * scale))
        scale *= 10


_DECISION = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 6e-4, 7e-4, 8e-4, 9e-4, 1e-3, 1.25e-3, 1.5e-3, 2e-3, 2.5e-3,
             5e-3, 1e-2]  # fmt: skip
_LATENCY = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
# vLLM's buckets (v1/metrics/loggers.py)
_VLLM_TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
              80.0, 160.0, 640.0, 2560.0]  # fmt: skip
_VLLM_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_VLLM_REQUEST = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                 960.0, 1920.0, 7680.0]  # fmt: skip
HISTOGRAM_BUCKETS = {
    "time_to_first_token_seconds": _VLLM_TTFT,
    "inter_token_latency_seconds": _VLLM_ITL,
    "e2e_request_latency_seconds": _VLLM_REQUEST,
    "request_queue_time_seconds": _VLLM_REQUEST,
    "request_prefill_time_seconds": _VLLM_REQUEST,
    "request_decode_time_seconds": _VLLM_REQUEST,
    # fine around 1 ms, the decision-time target: a p99 interpolated in a 0.5-1 ms bucket says little
    "scheduler_decision_seconds": _DECISION,
    "scheduler_decision_cpu_seconds": _DECISION,
    "draft_tokens_per_step": [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16],
    "stage_latency_seconds": [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
}
TOKEN_COUNT_HISTOGRAMS = ("request_prompt_tokens", "request_generation_tokens")  # buckets from the context length
# Histograms observed once per request per step. Every observe() of Triton's Python backend is an
# IPC to the server, and these two are 64 of the 70 observations a step at 32 requests: with metrics
# on, the server streamed a fifth fewer tokens (lightspec bench, stages: process, c=64). They are binned
# here and exported as the series a histogram exposes, ``<name>_bucket{le}``, ``<name>_sum`` and
# ``<name>_count``, as counters incremented once per publish (a few IPCs per bucket that changed,
# whatever the load). PromQL reads them as it reads a histogram (histogram_quantile over the
# buckets' rates, rate(_sum) / rate(_count)); only the exposition's TYPE line says counter.
BINNED_HISTOGRAMS = frozenset({"inter_token_latency_seconds", "draft_tokens_per_step"})
DESCRIPTIONS = {
    "spec_decode_num_draft_tokens_total": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens_total": "Draft tokens accepted by the target",
    "spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, per draft position",
    "spec_decode_num_draft_tokens_per_pos_total": "Draft tokens proposed, per draft position",
    "spec_decode_num_steps_total": "Request-steps that carried at least one draft token (vLLM: drafts)",
    "spec_decode_num_stopped_drafts_total": (
        "Granted draft slots the proposer left empty (a confidence stop, a short n-gram match)"
    ),
    "spec_decode_num_fused_drafts_total": "Drafts the target stage proposed with the previous step (mtp: fused)",
    "num_preemptions_total": "Requests preempted for KV memory",
    "generation_tokens_total": "Generated tokens",
    "prompt_tokens_total": "Prompt tokens processed",
    "prefix_cache_queries_total": "Prompt tokens of admitted requests looked up in the prefix cache",
    "prefix_cache_hits_total": "Prompt tokens the prefix cache held (their prefill skipped)",
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting for admission",
    "kv_cache_usage_ratio": "KV-cache usage: allocated KV blocks / all KV blocks (1 means 100 percent)",
    "kv_cache_fragmentation_ratio": "Reserved-but-unused KV slots / allocated slots",
    "mean_acceptance_length": "1 + accepted / request-steps with drafts (counts the bonus token)",
    "time_to_first_token_seconds": "Time from arrival to the first generated token",
    "inter_token_latency_seconds": "Time between a request's steps that produced tokens",
    "e2e_request_latency_seconds": "Time from arrival to the final token",
    "request_queue_time_seconds": "Time from arrival to the request's first step",
    "request_prefill_time_seconds": "Time from the first step to the first token",
    "request_decode_time_seconds": "Time from the first token to the last",
    "request_prompt_tokens": "Prompt tokens per finished request",
    "request_generation_tokens": "Generated tokens per finished request",
    "request_success_total": "Finished requests by finished_reason (stop, length, abort)",
    "request_failure_total": "Requests that failed: engine errors and requests refused as invalid",
    "scheduler_decision_seconds": "Time the scheduler spent choosing the batch and draft lengths",
    "scheduler_decision_cpu_seconds": (
        "CPU time of the engine thread in that decision (excludes waiting for the GIL or a core)"
    ),
    "draft_tokens_per_step": "Draft tokens chosen per request per step (k)",
    "stage_latency_seconds": "Latency of one stage call",
    "policy_draft_cost_seconds": (
        "Dynamic policy: what one more draft token costs a step at the current batch size (verified and proposed)"
    ),
    "policy_step_excess_seconds": "Dynamic policy: measured target call time beyond the stage profile, per call",
    "policy_step_overhead_seconds": "Dynamic policy: measured step time outside the stages (engine, responses)",
}


@dataclass
class _Bins:
    """One binned histogram's label set: counts per bucket (the last is +Inf), sum, count."""

    counts: list[int]
    total: float = 0.0
    dirty: bool = False


def _le(bound: float) -> str:
    return format(float(bound), "g")


class MetricsReporter:
    """Publishes stats into Triton metric families. Call :meth:`publish` from one thread only."""

    def __init__(self, pb_utils, labels: dict[str, str], max_model_len: int = 2048):
        """``labels`` go on every metric (vLLM's: ``model_name`` and ``engine``); ``max_model_len``
        bounds the token-count histograms' buckets, as in vLLM."""
        self.pb = pb_utils
        self.labels = dict(labels)
        self.buckets = {
            **HISTOGRAM_BUCKETS,
            **dict.fromkeys(TOKEN_COUNT_HISTOGRAMS, build_1_2_5_buckets(max_model_len)),
        }
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}
        self._last_totals: dict[tuple, float] = {}
        self._bins: dict[tuple, _Bins] = {}

    def _metric(self, name: str, kind: str, extra: dict[str, str] | None = None, buckets=None, series: str = ""):
        """``series``: ``_bucket``/``_sum``/``_count``, a binned histogram's counter of that name."""
        labels = {**self.labels, **(extra or {})}
        key = (name + series, tuple(sorted(labels.items())))
        m = self._metrics.get(key)
        if m is None:
            fam = self._families.get(name + series)
            if fam is None:
                description = DESCRIPTIONS.get(name, name.replace("_", " "))
                fam = self.pb.MetricFamily(
                    name=exported_name(name) + series,
                    description=f"{description} (histogram series {series})" if series else description,
                    kind=getattr(self.pb.MetricFamily, kind),
                )
                self._families[name + series] = fam
            m = fam.Metric(labels=labels, buckets=buckets) if buckets is not None else fam.Metric(labels=labels)
            self._metrics[key] = m
        return m, key

    def _count(self, name: str, total: float, extra: dict[str, str] | None = None, series: str = "") -> None:
        m, key = self._metric(name, "COUNTER", extra, series=series)
        diff = total - self._last_totals.get(key, 0.0)
        if diff > 0:
            m.increment(diff)
            self._last_totals[key] = total

    def publish(self, snapshot: dict, observations: list[tuple[str, float, dict]]) -> None:
        """Gauges and counters, then the histograms' observations, and the finished-request
        counters last: a reader that waits for those to count its requests (``lightspec bench``
        does) then finds every other metric of those requests in the same scrape. With every
        counter first, a scrape between the two halves saw a run's requests and steps counted and
        none of its histograms' observations."""
        finished = {k: v for k, v in snapshot.items() if k in FINISHED_COUNTERS}
        self._publish_snapshot({k: v for k, v in snapshot.items() if k not in FINISHED_COUNTERS})
        for name, value, labels in observations:
            buckets = self.buckets.get(name, _LATENCY)
            extra = {k: str(v) for k, v in labels.items()}
            if name in BINNED_HISTOGRAMS:
                self._bin(name, buckets, float(value), extra)
            else:
                self._metric(name, "HISTOGRAM", extra, buckets=buckets)[0].observe(float(value))
        self._publish_bins()
        self._publish_snapshot(finished)

    def _publish_snapshot(self, snapshot: dict) -> None:
        for name, value in snapshot.items():
            if isinstance(value, (list, tuple)):
                for pos, v in enumerate(value):
                    self._count(name, float(v), {"position": str(pos)})
            elif isinstance(value, dict):
                for key, v in value.items():
                    self._count(name, float(v), {DICT_LABELS.get(name, "key"): str(key)})
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            elif name.endswith("_total"):
                self._count(name, float(value))
            else:
                self._metric(name, "GAUGE")[0].set(float(value))

    def _bin(self, name: str, buckets: list[float], value: float, extra: dict[str, str]) -> None:
        key = (name, tuple(sorted(extra.items())))
        b = self._bins.get(key)
        if b is None:
            b = self._bins[key] = _Bins([0] * (len(buckets) + 1))
        b.counts[bisect.bisect_left(buckets, value)] += 1  # the first bound >= value: Prometheus' le
        b.total += value
        b.dirty = True

    def _publish_bins(self) -> None:
        for (name, extra_items), b in self._bins.items():
            if not b.dirty:
                continue
            b.dirty = False
            extra = dict(extra_items)
            bounds = [*map(_le, self.buckets.get(name, _LATENCY)), "+Inf"]
            for le, cumulative in zip(bounds, itertools.accumulate(b.counts)):
                self._count(name, cumulative, {**extra, "le": le}, series="_bucket")
            self._count(name, b.total, extra, series="_sum")
            self._count(name, sum(b.counts), extra, series="_count")

    def close(self) -> None:
        self._metrics.clear()
        self._families.clear()
