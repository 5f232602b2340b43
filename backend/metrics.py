"""Engine statistics -> Triton custom metrics (``pb_utils.MetricFamily``), named ``lightspec:<name>``.

The engine's stats object collects; this module only reports. The mapping is generic so new engine
statistics appear without touching the backend:

- snapshot keys ending in ``_total`` are counters (the engine keeps totals; the reporter increments
  Triton's counter by the difference since the last publish); a list value is one counter per
  position, labelled ``position`` (0-based draft position);
- other numeric snapshot keys are gauges;
- drained observations ``(name, value, labels)`` are histograms, with the buckets below.

Checked on Triton 2.51: ``MetricFamily.HISTOGRAM`` exists (``Metric(labels, buckets=[...])``,
``observe(v)``) and is exported with ``_bucket``/``_sum``/``_count``; a family is removed from the
metrics endpoint when its Python object is garbage-collected, so the reporter keeps every family.
"""

from __future__ import annotations

_DECISION = [1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 6e-4, 7e-4, 8e-4, 9e-4, 1e-3, 1.25e-3, 1.5e-3, 2e-3, 2.5e-3,
             5e-3, 1e-2]  # fmt: skip
_LATENCY = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
HISTOGRAM_BUCKETS = {
    "time_to_first_token_seconds": _LATENCY,
    "time_per_output_token_seconds": [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2],
    "e2e_request_latency_seconds": _LATENCY,
    # fine around 1 ms, the decision-time target: a p99 interpolated in a 0.5-1 ms bucket says little
    "scheduler_decision_seconds": _DECISION,
    "scheduler_decision_cpu_seconds": _DECISION,
    "draft_tokens_per_step": [0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16],
    "stage_latency_seconds": [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0],
}
DESCRIPTIONS = {
    "spec_decode_num_draft_tokens_total": "Draft tokens proposed",
    "spec_decode_num_accepted_tokens_total": "Draft tokens accepted by the target",
    "spec_decode_num_accepted_tokens_per_pos_total": "Draft tokens accepted, per draft position",
    "spec_decode_num_draft_tokens_per_pos_total": "Draft tokens proposed, per draft position",
    "spec_decode_num_steps_total": "Request-steps that carried at least one draft token",
    "spec_decode_num_stopped_drafts_total": (
        "Granted draft slots the proposer left empty (a confidence stop, a short n-gram match)"
    ),
    "spec_decode_num_fused_drafts_total": "Drafts the target stage proposed with the previous step (mtp: fused)",
    "num_preemptions_total": "Requests preempted for KV memory",
    "generation_tokens_total": "Generated tokens",
    "prompt_tokens_total": "Prompt tokens processed",
    "num_requests_running": "Requests in the running batch",
    "num_requests_waiting": "Requests waiting for admission",
    "kv_cache_usage_ratio": "Allocated KV blocks / all KV blocks",
    "kv_cache_fragmentation_ratio": "Reserved-but-unused KV slots / allocated slots",
    "mean_acceptance_length": "1 + accepted / request-steps with drafts (counts the bonus token)",
    "time_to_first_token_seconds": "Time from arrival to the first generated token",
    "time_per_output_token_seconds": "Time between generated tokens of a request",
    "e2e_request_latency_seconds": "Time from arrival to the final token",
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
PREFIX = "lightspec:"


class MetricsReporter:
    """Publishes stats into Triton metric families. Call :meth:`publish` from one thread only."""

    def __init__(self, pb_utils, labels: dict[str, str]):
        self.pb = pb_utils
        self.labels = dict(labels)
        self._families: dict[str, object] = {}
        self._metrics: dict[tuple, object] = {}
        self._last_totals: dict[tuple, float] = {}

    def _metric(self, name: str, kind: str, extra: dict[str, str] | None = None, buckets=None):
        labels = {**self.labels, **(extra or {})}
        key = (name, tuple(sorted(labels.items())))
        m = self._metrics.get(key)
        if m is None:
            fam = self._families.get(name)
            if fam is None:
                fam = self.pb.MetricFamily(
                    name=PREFIX + name,
                    description=DESCRIPTIONS.get(name, name.replace("_", " ")),
                    kind=getattr(self.pb.MetricFamily, kind),
                )
                self._families[name] = fam
            m = fam.Metric(labels=labels, buckets=buckets) if buckets is not None else fam.Metric(labels=labels)
            self._metrics[key] = m
        return m, key

    def _count(self, name: str, total: float, extra: dict[str, str] | None = None) -> None:
        m, key = self._metric(name, "COUNTER", extra)
        diff = total - self._last_totals.get(key, 0.0)
        if diff > 0:
            m.increment(diff)
            self._last_totals[key] = total

    def publish(self, snapshot: dict, observations: list[tuple[str, float, dict]]) -> None:
        for name, value in snapshot.items():
            if isinstance(value, (list, tuple)):
                for pos, v in enumerate(value):
                    self._count(name, float(v), {"position": str(pos)})
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            elif name.endswith("_total"):
                self._count(name, float(value))
            else:
                self._metric(name, "GAUGE")[0].set(float(value))
        for name, value, labels in observations:
            buckets = HISTOGRAM_BUCKETS.get(name, _LATENCY)
            extra = {k: str(v) for k, v in labels.items()}
            self._metric(name, "HISTOGRAM", extra, buckets=buckets)[0].observe(float(value))

    def close(self) -> None:
        self._metrics.clear()
        self._families.clear()
