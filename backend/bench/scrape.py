"""The server's side of a run: the metrics endpoint scraped before and after it, and the differences.

The backend's metrics give acceptance, draft tokens per step, scheduler decision time and stage
latencies; Triton's own ``nv_inference_*`` counters give the target stage's compute time. Every
backend metric is read through :data:`NAMES` (short name -> exported name) and :data:`MODEL_LABEL`,
so a renaming of the exported metrics changes this table only.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
import urllib.request
from collections import defaultdict

from ..metrics import exported_name
from ..params import Role, flatten_parameters, parse_backend_config
from .configs import TARGET_STAGE
from .stats import histogram_quantile

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Metrics = dict[tuple[str, frozenset], float]

PREFIX = "lightspec:"
MODEL_LABEL = "model_name"  # the label that names the orchestrator a sample belongs to (vLLM's)
# short name (as this module uses it) -> the name the backend exports; histograms: the base name
NAMES = {
    n: exported_name(n)
    for n in (
        "spec_decode_num_steps_total",
        "spec_decode_num_accepted_tokens_total",
        "draft_tokens_per_step",
        "scheduler_decision_seconds",
        "scheduler_decision_cpu_seconds",
        "num_preemptions_total",
        "engine_steps_total",
        "stage_latency_seconds",
        "policy_draft_cost_seconds",
        "request_success_total",
        "request_failure_total",
    )
}

SERVER_KEYS = (
    "mean_acceptance_length",
    "mean_draft_tokens_per_step",
    "scheduler_p50_ms",
    "scheduler_p99_ms",
    "scheduler_cpu_p99_ms",
    "preemptions",
    "engine_steps",
    "target_stage_ms",
    "propose_stage_ms",
    "policy_draft_cost_ms",
    "target_compute_ms",
)


def parse_metrics(text: str) -> Metrics:
    """Prometheus text format -> {(name, frozenset(labels)): value}."""
    out: Metrics = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        labels = frozenset(_LABEL.findall(m.group(2) or ""))
        with contextlib.suppress(ValueError):
            out[(m.group(1), labels)] = float(m.group(3))
    return out


def scrape(url: str | None) -> Metrics | None:
    if not url:
        return None
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return parse_metrics(r.read().decode())
    except OSError:
        return None


def _samples(metrics: Metrics, full_name: str, model: str, model_label: str = "model", **labels: str) -> list[float]:
    """The values of metric ``full_name`` (prefix included) for ``model`` (and the given labels)."""
    want = {(model_label, model), *labels.items()}
    return [v for (n, ls), v in metrics.items() if n == full_name and want <= ls]


def _exported(name: str) -> str:
    """``draft_tokens_per_step_sum`` -> its exported name, through :data:`NAMES` (suffixes kept)."""
    for suffix in ("", "_sum", "_count", "_bucket"):
        base = name.removesuffix(suffix) if suffix else name
        if base in NAMES and (not suffix or name.endswith(suffix)):
            return NAMES[base] + suffix
    return PREFIX + name


def metric(metrics: Metrics, name: str, model: str, **labels: str) -> float:
    """Sum of the samples of the backend metric ``name`` (a :data:`NAMES` key, with ``_sum`` /
    ``_count`` for a histogram's parts) for ``model`` (and the given labels)."""
    return sum(_samples(metrics, _exported(name), model, MODEL_LABEL, **labels))


def _buckets(metrics: Metrics, name: str, model: str) -> dict[float, float]:
    out: dict[float, float] = defaultdict(float)
    full = _exported(name + "_bucket")
    for (n, ls), v in metrics.items():
        d = dict(ls)
        if n == full and d.get(MODEL_LABEL) == model:
            out[float(d["le"])] += v
    return out


def histogram_delta(before: Metrics, after: Metrics, name: str, model: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of a histogram's observations between two scrapes."""
    b, a = _buckets(before, name, model), _buckets(after, name, model)
    return sorted((le, a[le] - b.get(le, 0.0)) for le in a)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def server_stats(before: Metrics | None, after: Metrics | None, model: str) -> dict:
    """Acceptance length, draft tokens per step and scheduler decision time between two scrapes."""
    if before is None or after is None:
        return dict.fromkeys(SERVER_KEYS)

    def d(name: str, **labels: str) -> float:
        return metric(after, name, model, **labels) - metric(before, name, model, **labels)

    steps, accepted = d("spec_decode_num_steps_total"), d("spec_decode_num_accepted_tokens_total")
    k_count = d("draft_tokens_per_step_count")
    sched = histogram_delta(before, after, "scheduler_decision_seconds", model)
    cpu = histogram_delta(before, after, "scheduler_decision_cpu_seconds", model)
    return {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "mean_draft_tokens_per_step": d("draft_tokens_per_step_sum") / k_count if k_count else None,
        "scheduler_p50_ms": _ms(histogram_quantile(0.5, sched)),
        "scheduler_p99_ms": _ms(histogram_quantile(0.99, sched)),
        "scheduler_cpu_p99_ms": _ms(histogram_quantile(0.99, cpu)),
        "preemptions": int(d("num_preemptions_total")),
        # Where a step's time goes: the engine's step count (duration / steps is the mean step) and
        # the mean stage calls; the rest of a step is the engine, BLS transfers and responses.
        "engine_steps": int(d("engine_steps_total")),
        "target_stage_ms": _stage_ms(d, "target"),
        "propose_stage_ms": _stage_ms(d, "mtp", "draft", "ngram"),
        # the dynamic policy's price of a draft when the run ended (gauge; its batch: the run's last)
        "policy_draft_cost_ms": _gauge_ms(after, "policy_draft_cost_seconds", model),
        # Triton's own count of the target stage's execution (from the stage receiving a call to its
        # response): target_stage_ms less this is the BLS round trip as the orchestrator sees it
        "target_compute_ms": _triton_compute_ms(before, after, TARGET_STAGE),
    }


def _stage_ms(delta, *stages: str) -> float | None:
    """Mean latency of one call of these stages (the propose stage is named by its method), from
    ``delta(name, **labels)``, a counter's difference between the scrapes."""
    n = sum(delta("stage_latency_seconds_count", stage=st) for st in stages)
    return 1000 * sum(delta("stage_latency_seconds_sum", stage=st) for st in stages) / n if n else None


def _gauge_ms(metrics: Metrics, name: str, model: str) -> float | None:
    found = _samples(metrics, _exported(name), model, MODEL_LABEL)
    return 1000 * sum(found) if found else None


def _triton_compute_ms(before: Metrics, after: Metrics, model: str) -> float | None:
    """Mean ``compute_infer`` time per execution of ``model`` between two scrapes (Triton's metrics)."""

    def d(name: str) -> float:
        return sum(_samples(after, name, model)) - sum(_samples(before, name, model))

    execs = d("nv_inference_exec_count")
    return d("nv_inference_compute_infer_duration_us") / 1000 / execs if execs > 0 else None


def finished_requests(ms: Metrics | None, model: str) -> float:
    if ms is None:
        return 0.0
    return metric(ms, "request_success_total", model) + metric(ms, "request_failure_total", model)


def wait_for_requests(url: str | None, model: str, count: float, timeout_s: float = 10.0) -> Metrics | None:
    """Scrape until the server's finished-request counter for ``model`` reaches ``count`` (the
    backend publishes at most every 0.25 s and when the engine goes idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ms = scrape(url)
        if ms is None:
            return None
        if finished_requests(ms, model) >= count or time.monotonic() > deadline:
            return ms
        time.sleep(0.1)


def model_config(url: str, model: str, http: bool = False) -> dict | None:
    """The configuration Triton at ``url`` (``host:port``) serves for ``model``, over gRPC, or with
    ``http`` over its HTTP endpoint (``url`` is then the HTTP address); None where none comes back."""
    if http:
        base = url if "://" in url else f"http://{url}"
        try:
            with urllib.request.urlopen(f"{base}/v2/models/{model}/config", timeout=10) as r:
                return json.loads(r.read().decode())
        except (OSError, ValueError):
            return None
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        return client.get_model_config(model, as_json=True, client_timeout=10).get("config")
    except InferenceServerException:
        return None
    finally:
        client.close()


def engine_processes(config: dict | None) -> int | None:
    """How many engine processes serve a LightSpec orchestrator of this model configuration, by the
    backend's own rule (``BackendConfig.engine_processes``); None for any other model. The rule's
    automatic count reads the CPUs of this process, which are the server's where the bench started
    it (its child inherits them) but may not be those of a server elsewhere (``--url``)."""
    if not config or config.get("backend") != "lightspec":
        return None
    try:
        backend = parse_backend_config(flatten_parameters(config))
    except ValueError:  # parameters the backend refuses: it serves no such orchestrator
        return None
    return backend.engine_processes() if backend.role is Role.ORCHESTRATOR else None
