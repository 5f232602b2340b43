"""``lightspec bench``: throughput and latency of speculation configurations through a real Triton server.

    lightspec bench --quick                                   # < 5 min on 2 cores
    lightspec bench --json out.json --plot out.png            # none, static:1/2/4, dynamic x mtp; c = 1 4 16 64
    lightspec bench --methods mtp ngram draft --workload mixed --rate 2
    lightspec bench --hf ...                                  # lightspec_backend.bench_hf (HF side by side)

One orchestrator model per configuration (``lightspec_none``, ``lightspec_mtp_static_2``,
``lightspec_mtp_dynamic``, ...) in a generated repository; all share the stage models
(``lightspec_target``, ``lightspec_mtp``, ``lightspec_draft``). The server runs with explicit model
control and exactly one orchestrator is loaded at a time: the target stage's KV pool is indexed by
block ids that each orchestrator allocates on its own, so two orchestrators must never use it at
once, while one after the other is safe (a sequence only reads KV slots its own steps wrote).

Clients are tritonclient gRPC streams. Closed loop (``--concurrency``): C workers, each with its own
stream, send their next request when the previous one finished. Open loop (``--rate``): Poisson
arrivals; latency counts from the scheduled arrival. Server-side numbers (acceptance length, draft
tokens per step, scheduler decision time) are differences of the ``lightspec:`` metrics scraped
before and after each run. See docs/bench.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import queue
import random
import re
import shutil
import sys
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_CONFIGS = ["none", "static:1", "static:2", "static:4", "dynamic"]
DEFAULT_CONCURRENCY = [1, 4, 16, 64]
QUICK = {
    "concurrency": [1, 8],
    "configs": ["none", "static:2", "dynamic"],
    "max_tokens": 32,
    "num_prompts": 16,
    "requests": (16, 4),  # per run: max(16, 4 x concurrency)
}
MIXED_REQUESTS = (16, 8)  # --workload mixed, per run: max(16, 8 x concurrency)
METHODS = ("mtp", "ngram", "draft")
METHOD_STYLE = {"mtp": "-", "ngram": "-.", "draft": ":"}
STAGES = {"mtp": "lightspec_mtp", "draft": "lightspec_draft"}
TARGET_STAGE = "lightspec_target"
STREAM_OUTPUTS = ("output_ids", "total_draft_tokens", "total_accepted_draft_tokens")  # what the bench client reads


# ---- configurations ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunConfig:
    """One server configuration: a speculation method and policy, served by its own orchestrator.

    ``config`` is the user's label: ``none``, ``dynamic``, ``static`` or ``static:K``, optionally
    suffixed ``@2`` for pipeline depth 2; ``dynamic+stop`` is the dynamic policy with its MTP
    confidence stop (``confidence_stop: on``); ``+local`` / ``+fused`` set ``mtp_model`` for this
    configuration (where the MTP heads run, to compare them in one run). The ``none`` baseline has
    ``method == "none"``."""

    config: str
    method: str
    policy: str  # the orchestrator's policy parameter
    pipeline_depth: int = 1
    confidence_stop: bool = False
    mtp_model: str | None = None  # None: the repository's (--set mtp_model=...)

    @property
    def model_name(self) -> str:
        if self.method == "none":
            name = "lightspec_none"
        else:
            name = f"lightspec_{self.method}_{self.policy.replace(':', '_')}"
            name += "_stop" if self.confidence_stop else ""
            name += f"_{self.mtp_model}" if self.mtp_model else ""
        return name + (f"_d{self.pipeline_depth}" if self.pipeline_depth != 1 else "")

    @property
    def static_k(self) -> int | None:
        return int(self.policy.split(":")[1]) if self.policy.startswith("static:") else None

    def parameters(self, max_draft_tokens: int) -> dict[str, str]:
        """The orchestrator parameters that make this configuration."""
        k = self.static_k or 0
        out = {
            "speculation": self.method,
            "policy": self.policy,
            "max_draft_tokens": str(max(max_draft_tokens, k)),
            "pipeline_depth": str(self.pipeline_depth),
        }
        if self.confidence_stop:
            out["confidence_stop"] = "on"
        if self.mtp_model and self.method == "mtp":
            out["mtp_model"] = self.mtp_model
        return out


def parse_configs(configs: list[str], methods: list[str]) -> list[RunConfig]:
    """``["none", "static:2", "dynamic@2"] x ["mtp", "ngram"]`` -> run configurations, ``none`` once."""
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods {m!r}: expected some of {', '.join(METHODS)}")
    out: list[RunConfig] = []
    for spec in configs:
        label, _, depth = spec.partition("@")
        try:
            depth_n = int(depth) if depth else 1
        except ValueError:
            raise SystemExit(f"--configs {spec!r}: expected CONFIG@DEPTH with DEPTH 1 or 2") from None
        if depth_n not in (1, 2):
            raise SystemExit(f"--configs {spec!r}: pipeline depth must be 1 or 2")
        if label in ("none", "off"):
            out.append(RunConfig(spec, "none", "off", depth_n))
            continue
        where = re.search(r"\+(local|fused)$", label)
        label = label.removesuffix(where.group(0)) if where else label
        if not re.fullmatch(r"dynamic(:latency)?(\+stop)?|static(:\d+)?", label):
            raise SystemExit(f"--configs {spec!r}: expected none, dynamic, dynamic:latency, static or static:K "
                             "(optionally @2; dynamic+stop: with the MTP confidence stop; +local or +fused: "
                             "where the MTP heads run)")
        policy, stop = label.removesuffix("+stop"), label.endswith("+stop")
        out += [RunConfig(spec, m, policy, depth_n, stop, where.group(1) if where else None) for m in methods]
    if len({c.model_name for c in out}) != len(out):
        raise SystemExit(f"--configs {' '.join(configs)}: a configuration is listed twice")
    return out


def stages_for(configs: list[RunConfig], overrides: dict[str, str] | None = None) -> list[str]:
    """Stage models the configurations need: the target always, MTP heads / draft model when used
    (not the MTP stage when ``mtp_model=local`` runs the heads inside the orchestrator)."""
    from .repository import default_parameters

    methods = {c.method for c in configs}
    base = {**default_parameters(), **(overrides or {})}.get("mtp_model")
    if all((c.mtp_model or base) in ("local", "fused") for c in configs if c.method == "mtp"):
        methods.discard("mtp")
    return [TARGET_STAGE] + [STAGES[m] for m in ("mtp", "draft") if m in methods]


def write_bench_repository(
    dst: str | Path, configs: list[RunConfig], overrides: dict[str, str], max_draft_tokens: int
) -> Path:
    """The stage models plus one orchestrator per configuration (and the plain ``lightspec`` one)."""
    from .repository import default_parameters, render_orchestrator, write_model_repository

    fused = any(c.mtp_model == "fused" for c in configs)  # then the shared target stage loads the heads
    dst = write_model_repository(dst, {**overrides, "mtp_model": "fused"} if fused else overrides)
    for c in configs:
        params = {**default_parameters(), **overrides, **c.parameters(max_draft_tokens)}
        (dst / c.model_name / "1").mkdir(parents=True, exist_ok=True)
        (dst / c.model_name / "1" / ".gitkeep").touch()
        (dst / c.model_name / "config.pbtxt").write_text(render_orchestrator(params, c.model_name))
    return dst


# ---- prompts --------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    text: str
    kind: str = "code"  # code | shuffled | file
    temperature: float | None = None  # None: the run's --temperature


def load_tokenizer(model_dir: str | Path | None):
    """The model's ``tokenizers.Tokenizer`` (for trimming prompts), or ``None``."""
    from tokenizers import Tokenizer

    from lightspec_core import default_model_dir

    path = Path(model_dir or default_model_dir()) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def trim(text: str, max_tokens: int, tokenizer, sep: str = "\n") -> str:
    """Drop leading lines (words, for ``sep=" "``) until the text is at most ``max_tokens`` tokens
    (about 3 characters per token when there is no tokenizer)."""

    def length(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False).ids) if tokenizer else math.ceil(len(t) / 3)

    while length(text) > max_tokens:
        cut = text.find(sep, 1 + len(text) // 10 if length(text) > 2 * max_tokens else 1)
        text = text[cut + 1 :] if cut >= 0 else text[len(text) // 10 + 1 :]
    return text


def _code_windows(n: int, seed: int, max_chars: int) -> list[str]:
    """``n`` windows of held-out standard-library code, each ending with a ``def ...:`` line (the
    model continues the function body). Deterministic for a given seed and Python installation."""
    from lightspec_core.corpus import stdlib_files

    files = list(stdlib_files()[1])
    rng = random.Random(seed)
    rng.shuffle(files)
    out: list[str] = []
    for _ in range(1 + n // max(len(files), 1)):  # more passes (other defs) when files are few
        if len(out) == n:
            break
        for path in files:
            try:
                lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
            except (UnicodeDecodeError, OSError):
                continue
            defs = [
                i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")
            ]
            if not defs:
                continue
            end = rng.choice(defs)
            start, size = end, len(lines[end])
            while start > 0 and size + len(lines[start - 1]) <= max_chars:
                start -= 1
                size += len(lines[start])
            out.append("".join(lines[start : end + 1]))
            if len(out) == n:
                break
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} prompt windows in the held-out standard-library files")
    return out


def shuffle_words(text: str, rng: random.Random) -> str:
    """Low-predictability text with code's vocabulary: the words of ``text`` in random order."""
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def default_prompts(
    n: int, tokenizer=None, max_prompt_tokens: int = 200, workload: str = "code", seed: int = 0,
    mixed_temperature: float | None = 1.0,
) -> list[Prompt]:
    """Held-out code prompts (``workload="code"``), or for ``"mixed"`` alternately a code prompt and
    a low-predictability request (even indices code, odd indices shuffled words sampled at
    ``mixed_temperature``; ``None``: the run's temperature). Shuffling the prompt alone does not make
    a request hard to speculate on: a small model's greedy continuation of any prompt soon repeats
    itself, and on the embedded model every method accepts about as much after a shuffled prompt as
    after code. Sampling at temperature 1, as a chat request would, drops n-gram lookup's first-draft
    acceptance from about 0.64 to 0.16; the MTP heads and the draft model, which learned the
    target's own distribution, keep theirs."""
    if workload not in ("code", "mixed"):
        raise ValueError(f"workload={workload!r}: expected code or mixed")
    windows = _code_windows(n, seed, max_chars=4 * max_prompt_tokens)
    rng = random.Random(seed + 1)
    out = []
    for i, w in enumerate(windows):
        if workload == "mixed" and i % 2 == 1:
            out.append(Prompt(trim(shuffle_words(w, rng), max_prompt_tokens, tokenizer, " "), "shuffled",
                              mixed_temperature))
        else:
            out.append(Prompt(trim(w, max_prompt_tokens, tokenizer), "code"))
    return out


def read_prompts(path: str | Path) -> list[Prompt]:
    """JSON lines with a ``prompt`` field (and optional ``kind`` and ``temperature``)."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            temp = obj.get("temperature")
            out.append(Prompt(str(obj["prompt"]), str(obj.get("kind", "file")), None if temp is None else float(temp)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise SystemExit(f"--prompts {path}:{lineno}: expected a JSON object with a 'prompt' field "
                             "(and a numeric 'temperature' if any)") from None
    if not out:
        raise SystemExit(f"--prompts {path}: no prompts")
    return out


# ---- server metrics -------------------------------------------------------------------------------------
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
Metrics = dict[tuple[str, frozenset], float]


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


def _samples(metrics: Metrics, full_name: str, model: str, **labels: str) -> list[float]:
    """The values of metric ``full_name`` (prefix included) for ``model`` (and the given labels)."""
    want = {("model", model), *labels.items()}
    return [v for (n, ls), v in metrics.items() if n == full_name and want <= ls]


def metric(metrics: Metrics, name: str, model: str, **labels: str) -> float:
    """Sum of the samples of ``lightspec:<name>`` for ``model`` (and the given labels)."""
    return sum(_samples(metrics, "lightspec:" + name, model, **labels))


def histogram_delta(before: Metrics, after: Metrics, name: str, model: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of a histogram's observations between two scrapes."""

    def buckets(ms: Metrics) -> dict[float, float]:
        out: dict[float, float] = defaultdict(float)
        for (n, ls), v in ms.items():
            d = dict(ls)
            if n == f"lightspec:{name}_bucket" and d.get("model") == model:
                out[float(d["le"])] += v
        return out

    b, a = buckets(before), buckets(after)
    return sorted((le, a[le] - b.get(le, 0.0)) for le in a)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' ``histogram_quantile``: linear interpolation inside the bucket holding rank q;
    a rank in the ``+Inf`` bucket gives the largest finite bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


def server_stats(before: Metrics | None, after: Metrics | None, model: str) -> dict:
    """Acceptance length, draft tokens per step and scheduler decision time between two scrapes."""
    keys = (
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
    if before is None or after is None:
        return dict.fromkeys(keys)

    def d(name: str, **labels: str) -> float:
        return metric(after, name, model, **labels) - metric(before, name, model, **labels)

    steps, accepted = d("spec_decode_num_steps_total"), d("spec_decode_num_accepted_tokens_total")
    k_count = d("draft_tokens_per_step_count")
    sched = histogram_delta(before, after, "scheduler_decision_seconds", model)
    p50, p99 = histogram_quantile(0.5, sched), histogram_quantile(0.99, sched)
    cpu99 = histogram_quantile(0.99, histogram_delta(before, after, "scheduler_decision_cpu_seconds", model))

    def stage_ms(*stages: str) -> float | None:
        """Mean latency of one call of these stages (the propose stage is named by its method)."""
        n = sum(d("stage_latency_seconds_count", stage=st) for st in stages)
        return 1000 * sum(d("stage_latency_seconds_sum", stage=st) for st in stages) / n if n else None

    engine_steps = d("engine_steps_total")
    return {
        "mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
        "mean_draft_tokens_per_step": d("draft_tokens_per_step_sum") / k_count if k_count else None,
        "scheduler_p50_ms": None if p50 is None else 1000 * p50,
        "scheduler_p99_ms": None if p99 is None else 1000 * p99,
        "scheduler_cpu_p99_ms": None if cpu99 is None else 1000 * cpu99,
        "preemptions": int(d("num_preemptions_total")),
        # Where a step's time goes: the engine's step count (duration / steps is the mean step) and
        # the mean stage calls; the rest of a step is the engine, BLS transfers and responses.
        "engine_steps": int(engine_steps),
        "target_stage_ms": stage_ms("target"),
        "propose_stage_ms": stage_ms("mtp", "draft", "ngram"),
        # the dynamic policy's price of a draft when the run ended (gauge; its batch: the run's last)
        "policy_draft_cost_ms": _gauge_ms(after, "policy_draft_cost_seconds", model),
        # Triton's own count of the target stage's execution (from the stage receiving a call to its
        # response): target_stage_ms less this is the BLS round trip as the orchestrator sees it
        "target_compute_ms": _triton_compute_ms(before, after, TARGET_STAGE),
    }


def _gauge_ms(metrics: Metrics, name: str, model: str) -> float | None:
    found = _samples(metrics, "lightspec:" + name, model)
    return 1000 * sum(found) if found else None


def _triton_compute_ms(before: Metrics, after: Metrics, model: str) -> float | None:
    """Mean ``compute_infer`` time per execution of ``model`` between two scrapes (Triton's metrics)."""

    def d(name: str) -> float:
        return sum(_samples(after, name, model)) - sum(_samples(before, name, model))

    execs = d("nv_inference_exec_count")
    return d("nv_inference_compute_infer_duration_us") / 1000 / execs if execs > 0 else None


def wait_for_requests(url: str | None, model: str, count: float, timeout_s: float = 10.0) -> Metrics | None:
    """Scrape until the server's finished-request counter for ``model`` reaches ``count`` (the
    backend publishes at most every 0.25 s and when the engine goes idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        ms = scrape(url)
        if ms is None:
            return None
        done = metric(ms, "request_success_total", model) + metric(ms, "request_failure_total", model)
        if done >= count or time.monotonic() > deadline:
            return ms
        time.sleep(0.1)


def finished_requests(ms: Metrics | None, model: str) -> float:
    if ms is None:
        return 0.0
    return metric(ms, "request_success_total", model) + metric(ms, "request_failure_total", model)


# ---- clients --------------------------------------------------------------------------------------------
@dataclass
class Record:
    """What one request did, seen from the client (``perf_counter`` times)."""

    kind: str
    t_send: float
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    tokens: int = 0
    responses: int = 0  # responses with tokens: one per engine step that produced tokens
    drafted: int = 0
    accepted: int = 0
    error: str | None = None


@dataclass
class Request:
    prompt: Prompt
    max_tokens: int
    temperature: float = 0.0

    def inputs(self) -> list:
        from .client import grpc_inputs

        return grpc_inputs(
            text_input=self.prompt.text,
            max_tokens=self.max_tokens,
            stream=True,
            ignore_eos=True,
            exclude_input_in_output=True,
            temperature=self.temperature,
        )


class Stream:
    """One gRPC client with one open stream; runs one request at a time."""

    def __init__(self, url: str, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self._q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._q.put((time.perf_counter(), result, error)))
        # only what ``run`` reads: the server builds no other tensors for each streamed response
        self.outputs = [grpcclient.InferRequestedOutput(n) for n in STREAM_OUTPUTS]

    def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        from .client import is_final

        inputs = req.inputs()
        rec = Record(req.prompt.kind, t_send if t_send is not None else time.perf_counter())
        self.client.async_stream_infer(model, inputs, outputs=self.outputs, enable_empty_final_response=True)
        while True:
            try:
                t, result, error = self._q.get(timeout=self.timeout_s)
            except queue.Empty:
                rec.error, rec.t_end = f"no response for {self.timeout_s:.0f}s", time.perf_counter()
                return rec
            if error is not None:
                rec.error, rec.t_end = str(error), t
                return rec
            if result.get_response().outputs:
                ids = result.as_numpy("output_ids")
                if ids is not None and ids.size:
                    rec.t_first = t if rec.t_first is None else rec.t_first
                    rec.t_last = t
                    rec.tokens += int(ids.size)
                    rec.responses += 1
                rec.drafted = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
                rec.accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
            if is_final(result):
                rec.t_end = t
                return rec

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_stream()
        with contextlib.suppress(Exception):
            self.client.close()


def run_closed_loop(
    url: str, model: str, requests: list[Request], concurrency: int, timeout_s: float = 600.0
) -> tuple[list[Record], float]:
    """C workers, each with its own stream, send their next request when the previous one finished.
    Returns the records (in request order) and the wall time from the first send to the last answer."""
    streams = [Stream(url, timeout_s) for _ in range(min(concurrency, len(requests)))]
    records: list[Record | None] = [None] * len(requests)
    todo = iter(range(len(requests)))
    lock = threading.Lock()

    def worker(stream: Stream) -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            records[i] = stream.run(model, requests[i])

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in streams]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in streams:
            s.close()
    done = [r for r in records if r is not None]
    return done, max((r.t_end for r in done), default=t0) - t0


def run_open_loop(
    url: str, model: str, requests: list[Request], rate: float, seed: int = 0, timeout_s: float = 600.0
) -> tuple[list[Record], float]:
    """Poisson arrivals at ``rate`` requests/s; a request's latency counts from its scheduled arrival
    (so client-side queueing shows). Streams are pooled: one per request in flight."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests)))
    idle: queue.Queue = queue.Queue()
    for _ in range(min(len(requests), 16)):
        idle.put(Stream(url, timeout_s))
    made: list[Stream] = list(idle.queue)

    def one(i: int, t_send: float) -> Record:
        try:
            stream = idle.get_nowait()
        except queue.Empty:
            stream = Stream(url, timeout_s)
            made.append(stream)
        try:
            return stream.run(model, requests[i], t_send)
        finally:
            idle.put(stream)

    t0 = time.perf_counter()
    futures = []
    try:
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            for i, at in enumerate(arrivals):
                delay = t0 + at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                futures.append(pool.submit(one, i, t0 + at))
        records = [f.result() for f in futures]
    finally:
        for s in made:
            s.close()
    return records, max(r.t_end for r in records) - t0


# ---- summaries ------------------------------------------------------------------------------------------
def client_stats(records: list[Record], duration: float) -> dict:
    """Client-side numbers of one run. Latencies of failed requests are left out (``errors`` counts
    them). ``mean_itl_s`` is decode time per token after the first, over all requests (token-weighted);
    ``mean_tpot_s`` the same per request, averaged."""
    ok = [r for r in records if r.error is None and r.t_first is not None]
    lat = np.array([r.t_end - r.t_send for r in ok]) if ok else np.array([np.nan])
    ttft = np.array([r.t_first - r.t_send for r in ok]) if ok else np.array([np.nan])
    decode_t = sum(r.t_last - r.t_first for r in ok)
    decode_n = sum(r.tokens - 1 for r in ok)
    tpot = [(r.t_last - r.t_first) / (r.tokens - 1) for r in ok if r.tokens > 1]
    tokens = sum(r.tokens for r in records)
    drafted, accepted = sum(r.drafted for r in ok), sum(r.accepted for r in ok)
    steps = sum(r.responses - 1 for r in ok)

    def f(x) -> float | None:
        return None if x is None or not np.isfinite(x) else float(x)

    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": tokens,
        "duration_s": duration,
        "throughput_tok_s": tokens / duration if duration > 0 else None,
        "mean_latency_s": f(lat.mean()),
        "p50_latency_s": f(np.percentile(lat, 50)),
        "p99_latency_s": f(np.percentile(lat, 99)),
        "mean_ttft_s": f(ttft.mean()),
        "p99_ttft_s": f(np.percentile(ttft, 99)),
        "mean_itl_s": decode_t / decode_n if decode_n else None,
        "mean_tpot_s": f(np.mean(tpot)) if tpot else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": decode_n / steps if steps else None,  # streamed tokens per engine step after the first
    }


def kind_stats(records: list[Record]) -> dict[str, dict]:
    """Per prompt kind (code / shuffled): mean latency, acceptance rate, decode tokens per step."""
    out = {}
    for kind in sorted({r.kind for r in records}):
        rs = [r for r in records if r.kind == kind and r.error is None and r.t_first is not None]
        if not rs:
            continue
        drafted, steps = sum(r.drafted for r in rs), sum(r.responses - 1 for r in rs)
        out[kind] = {
            "requests": len(rs),
            "mean_latency_s": float(np.mean([r.t_end - r.t_send for r in rs])),
            "acceptance_rate": sum(r.accepted for r in rs) / drafted if drafted else None,
            "draft_tokens_per_request": drafted / len(rs),
            "tokens_per_step": sum(r.tokens - 1 for r in rs) / steps if steps else None,
        }
    return out


def _ratio(run: dict, base: dict | None, key: str) -> float | None:
    if base is None or not run.get(key) or not base.get(key):
        return None
    return run[key] / base[key]


def ratio_rows(runs: list[dict]) -> list[dict]:
    """Every run with its throughput and mean-latency ratio against ``none`` at the same load."""
    base = {(r["concurrency"], r.get("rate")): r for r in runs if r["method"] == "none"}
    rows = []
    for r in runs:
        b = base.get((r["concurrency"], r.get("rate")))
        rows.append(
            {**r, "throughput_ratio": _ratio(r, b, "throughput_tok_s"), "latency_ratio": _ratio(r, b, "mean_latency_s")}
        )
    return rows


def _num(fmt: str, scale: float = 1.0, suffix: str = ""):
    return lambda v: "-" if v is None else format(v * scale, fmt) + suffix


# (header, width, key, format): the printed table's columns
COLUMNS = [
    ("tok/s", 8, "throughput_tok_s", _num(".1f")),
    ("x none", 7, "throughput_ratio", _num(".2f", suffix="x")),
    ("lat s", 7, "mean_latency_s", _num(".3f")),
    ("x none", 7, "latency_ratio", _num(".2f", suffix="x")),
    ("p99 s", 7, "p99_latency_s", _num(".3f")),
    ("ttft s", 7, "mean_ttft_s", _num(".3f")),
    ("itl ms", 7, "mean_itl_s", _num(".2f", 1000.0)),
    ("acc len", 7, "mean_acceptance_length", _num(".2f")),
    ("k/step", 6, "mean_draft_tokens_per_step", _num(".2f")),
    ("sched p99 ms", 12, "scheduler_p99_ms", _num(".3f")),
    ("cpu p99 ms", 10, "scheduler_cpu_p99_ms", _num(".3f")),
    ("step ms", 7, "step_ms", _num(".2f")),
    ("target ms", 9, "target_stage_ms", _num(".2f")),
    ("propose ms", 10, "propose_stage_ms", _num(".2f")),
    ("compute ms", 10, "target_compute_ms", _num(".2f")),
    ("draft cost ms", 13, "policy_draft_cost_ms", _num(".3f")),
]


def dynamic_vs_static(runs: list[dict]) -> list[dict]:
    """The issue's comparisons, per method that has a ``dynamic`` run: at each closed-loop level,
    ``dynamic`` against ``none`` and against the static depth with the best (median) throughput
    there, as the ratio of the two medians and round by round (``throughput_repeats`` come in round
    order; a round runs every configuration once, so one slow round slows both sides of its ratio);
    then, over the levels, the mean of ``dynamic``'s ratios to ``none`` against that of the static
    depth whose mean is best (``load`` = None). Rows: method, load, best static, ratio, per-round
    ratios, and ``dynamic`` x ``none``."""
    closed = [r for r in runs if r.get("rate") is None]
    base = {r["concurrency"]: r for r in closed if r["method"] == "none"}
    out = []
    for method in dict.fromkeys(r["method"] for r in closed if r["config"] == "dynamic"):
        dyn = {r["concurrency"]: r for r in closed if r["method"] == method and r["config"] == "dynamic"}
        static = [r for r in closed if r["method"] == method and r["config"].startswith("static")]
        x_none: dict[str, dict[int, float]] = {}  # config -> level -> throughput x none
        for c, d in dyn.items():
            rivals = [r for r in static if r["concurrency"] == c]
            if c in base:
                for r in (d, *rivals):
                    x_none.setdefault(r["config"], {})[c] = r["throughput_tok_s"] / base[c]["throughput_tok_s"]
            if not rivals:
                continue
            best = max(rivals, key=lambda r: r["throughput_tok_s"])
            rounds = [a / b for a, b in zip(d.get("throughput_repeats") or [], best.get("throughput_repeats") or [])
                      if a and b]
            out.append({"method": method, "load": c, "best_static": best["config"],
                        "ratio": d["throughput_tok_s"] / best["throughput_tok_s"], "rounds": rounds,
                        "dynamic_x_none": x_none.get("dynamic", {}).get(c)})
        levels = sorted(x_none.get("dynamic", {}))
        means = {cfg: sum(v[c] for c in levels) / len(levels) for cfg, v in x_none.items()
                 if all(c in v for c in levels)}
        statics = [cfg for cfg in means if cfg != "dynamic"]
        if len(levels) > 1 and statics:
            best = max(statics, key=means.get)
            out.append({"method": method, "load": None, "best_static": best, "ratio": means["dynamic"] / means[best],
                        "rounds": [], "dynamic_x_none": means["dynamic"]})
    return out


def format_comparison(rows: list[dict]) -> str:
    lines = ["dynamic against the best static depth (ratio of medians; round by round) and against none:"]
    for r in rows:
        where = f"c={r['load']}" if r["load"] is not None else "mean of levels"
        rounds = f"  [{' '.join(f'{x:.2f}' for x in r['rounds'])}]" if r["rounds"] else ""
        x_none = f"  dynamic {r['dynamic_x_none']:.2f}x none" if r["dynamic_x_none"] is not None else ""
        lines.append(f"  {r['method']:<6} {where:>14}  {r['best_static']:<9} {r['ratio']:.2f}x{rounds}{x_none}")
    return "\n".join(lines)


def format_table(runs: list[dict]) -> str:
    """One row per run, with throughput and mean-latency ratios against ``none`` at the same load."""
    head = f"{'config':<12} {'method':<6} {'load':>7} " + " ".join(f"{h:>{w}}" for h, w, _, _ in COLUMNS)
    lines = [head, "-" * len(head)]
    # closed-loop levels first, then rates; within a level the runs keep their order (none first)
    order = sorted(
        ratio_rows(runs), key=lambda r: (r.get("rate") is not None, r["concurrency"] or 0, r.get("rate") or 0)
    )
    for r in order:
        load = f"c={r['concurrency']}" if r.get("rate") is None else f"{r['rate']:g}/s"
        cells = " ".join(f"{fmt(r.get(key)):>{w}}" for _, w, key, fmt in COLUMNS)
        errors = f"  [{r['errors']} errors]" if r.get("errors") else ""
        lines.append(f"{r['config']:<12} {r['method']:<6} {load:>7} {cells}{errors}")
    return "\n".join(lines)


def plot(runs: list[dict], path: str | Path) -> None:
    """Throughput and mean latency against concurrency (and against rate, if any), one line per
    configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes_x = [("concurrency", "concurrency (closed loop)")]
    if any(r.get("rate") is not None for r in runs):
        axes_x.append(("rate", "arrival rate, req/s (Poisson)"))
    fig, axes = plt.subplots(len(axes_x), 2, figsize=(11, 4.2 * len(axes_x)), squeeze=False)
    for row, (xkey, xlabel) in enumerate(axes_x):
        series: dict[str, list[dict]] = defaultdict(list)
        for r in runs:
            if (xkey == "rate") == (r.get("rate") is not None):
                label = "none" if r["method"] == "none" else f"{r['method']} {r['config']}"
                series[label].append(r)
        configs = sorted({r["config"] for r in runs if r["method"] != "none"})
        for label, rs in sorted(series.items(), key=lambda kv: (kv[0] != "none", kv[0])):
            rs.sort(key=lambda r: r[xkey])
            xs = [r[xkey] for r in rs]
            if label == "none":
                style = {"linestyle": "--", "color": "black"}
            else:  # colour: configuration; line style: method
                style = {"color": f"C{configs.index(rs[0]['config']) % 10}", "linestyle": METHOD_STYLE[rs[0]["method"]]}
            axes[row][0].plot(xs, [r["throughput_tok_s"] for r in rs], marker="o", label=label, **style)
            axes[row][1].plot(xs, [r["mean_latency_s"] for r in rs], marker="o", label=label, **style)
        for col, ylabel in enumerate(("output tokens/s", "mean request latency, s")):
            ax = axes[row][col]
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            if xkey == "concurrency":
                ax.set_xscale("log", base=2)
                levels = sorted({r["concurrency"] for r in runs if r.get("rate") is None})
                ax.set_xticks(levels, [str(c) for c in levels])
                ax.minorticks_off()
            ax.grid(True, alpha=0.3)
        axes[row][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- driving the server ---------------------------------------------------------------------------------
class ModelSwitcher:
    """Keeps exactly one LightSpec orchestrator loaded (explicit model control): before loading the
    next configuration it unloads every other loaded orchestrator of the sweep and waits until Triton
    reports it gone, so no two orchestrators ever allocate blocks in the same KV pool. An orchestrator
    that is not part of the sweep (the plain ``lightspec``, say) is never touched: the bench refuses
    to run beside it. At the end, the sweep's orchestrators are unloaded again."""

    def __init__(self, url: str, managed: list[str]):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)
        self.managed = set(managed)
        self.active: str | None = None  # what the last activate() loaded

    def is_active(self, model: str) -> bool:
        return self.active == model and self._ready(model)

    def activate(self, model: str, timeout_s: float = 600.0) -> None:
        from tritonclient.utils import InferenceServerException

        for other in self.loaded_orchestrators():
            if other == model:
                continue
            if other not in self.managed:
                raise SystemExit(
                    f"orchestrator {other!r} is loaded and is not part of this sweep: it would allocate KV "
                    f"blocks in the same stage models as {model!r}; unload it first"
                )
            self.deactivate(other)
        if not self._ready(model):
            try:
                self.client.load_model(model)
            except InferenceServerException as e:
                raise SystemExit(
                    f"cannot load {model!r}: {e.message()}\nThe server needs --model-control-mode=explicit and a "
                    "repository written by `lightspec bench --write-repository DIR` (same --configs/--methods)."
                ) from None
        deadline = time.monotonic() + timeout_s
        while not self._ready(model):
            if time.monotonic() > deadline:
                raise RuntimeError(f"model {model!r} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)
        self.active = model

    def deactivate(self, model: str, timeout_s: float = 120.0) -> None:
        """Unload and wait: Triton's unload returns before the model's ``finalize`` has run."""
        if self.active == model:
            self.active = None
        self.client.unload_model(model)
        deadline = time.monotonic() + timeout_s
        while self._state(model) not in ("UNAVAILABLE", None):
            if time.monotonic() > deadline:
                raise RuntimeError(f"model {model!r} still unloading after {timeout_s:.0f}s")
            time.sleep(0.2)

    def loaded_orchestrators(self) -> list[str]:
        out = []
        for m in self.client.get_model_repository_index(as_json=True).get("models", []):
            if m.get("state") != "READY":
                continue
            cfg = self.client.get_model_config(m["name"], as_json=True).get("config", {})
            role = cfg.get("parameters", {}).get("role", {}).get("string_value") or "orchestrator"
            if cfg.get("backend") == "lightspec" and role == "orchestrator":
                out.append(m["name"])
        return out

    def _ready(self, model: str) -> bool:
        from tritonclient.utils import InferenceServerException

        try:
            return self.client.is_model_ready(model)
        except InferenceServerException:
            return False

    def _state(self, model: str) -> str | None:
        index = self.client.get_model_repository_index(as_json=True).get("models", [])
        return next((m.get("state") for m in index if m.get("name") == model), None)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            for model in self.loaded_orchestrators():
                if model in self.managed:
                    self.deactivate(model)
        self.client.close()


@dataclass
class Load:
    concurrency: int | None = None
    rate: float | None = None

    @property
    def label(self) -> str:
        return f"c={self.concurrency}" if self.rate is None else f"rate={self.rate:g}/s"


def requests_rule(quick: bool, workload: str) -> tuple[int, int]:
    """(minimum, per unit of concurrency) requests per closed-loop run when --requests is not given."""
    if quick:
        return QUICK["requests"]
    if workload == "mixed":
        # Requests of two speeds: a closed-loop run of 2 x C requests is mostly its tail, the last
        # slow (unpredictable) requests running in a shrinking batch, and measures that tail, not
        # the steady state the schedule is for; 8 x C requests make the tail a small part.
        return MIXED_REQUESTS
    return BenchPlan.requests_rule


@dataclass
class BenchPlan:
    configs: list[RunConfig]
    loads: list[Load]
    prompts: list[Prompt]
    max_tokens: int
    requests: int | None  # per run; None: by ``requests_rule``
    warmup: int = 2
    temperature: float = 0.0
    seed: int = 0
    timeout_s: float = 600.0
    # (minimum, per unit of concurrency): max(16, 2 x C) requests per closed-loop run by default, so
    # every worker sends several; rate runs get 8 s of arrivals (at least the minimum)
    requests_rule: tuple[int, int] = (16, 2)
    repeats: int = 1
    order: str = "level"  # see sweep_order

    def num_requests(self, load: Load) -> int:
        if self.requests:
            return self.requests
        least, per = self.requests_rule
        if load.rate is not None:
            return max(least, round(8 * load.rate))
        return max(least, per * load.concurrency)

    def requests_for(self, n: int, offset: int = 0) -> list[Request]:
        out = []
        for i in range(n):
            p = self.prompts[(offset + i) % len(self.prompts)]
            out.append(Request(p, self.max_tokens, self.temperature if p.temperature is None else p.temperature))
        return out


def run_one(url: str, metrics_url: str | None, cfg: RunConfig, load: Load, plan: BenchPlan, log=print) -> dict:
    """One configuration at one load level: warm up, scrape, run, wait for the metrics, scrape."""
    model = cfg.model_name
    if plan.warmup:
        warm = [Request(r.prompt, min(16, plan.max_tokens), r.temperature) for r in plan.requests_for(plan.warmup)]
        run_closed_loop(url, model, warm, min(2, plan.warmup), plan.timeout_s)
    before = scrape(metrics_url)
    if before is not None:  # settle: the warm-up's counters must be in before the baseline is taken
        before = wait_for_requests(metrics_url, model, finished_requests(before, model), 2.0)
    requests = plan.requests_for(plan.num_requests(load))
    if load.rate is None:
        records, duration = run_closed_loop(url, model, requests, load.concurrency, plan.timeout_s)
    else:
        records, duration = run_open_loop(url, model, requests, load.rate, plan.seed, plan.timeout_s)
    after = None
    if before is not None:
        after = wait_for_requests(metrics_url, model, finished_requests(before, model) + len(records))
    run = {
        "config": cfg.config,
        "method": cfg.method,
        "model": model,
        "concurrency": load.concurrency,
        "rate": load.rate,
        "pipeline_depth": cfg.pipeline_depth,
        "max_tokens": plan.max_tokens,
        "loadavg_1m": os.getloadavg()[0],  # other processes on the machine show here
        **client_stats(records, duration),
        **server_stats(before, after, model),
    }
    steps = run.get("engine_steps")
    run["step_ms"] = 1000 * duration / steps if steps and duration else None
    kinds = kind_stats(records)
    if len(kinds) > 1:
        run["by_kind"] = kinds
    errors = [r.error for r in records if r.error]
    if errors:
        run["first_error"] = errors[0]
    log(
        f"  {cfg.method:<5} {cfg.config:<10} {load.label:<10} {run['throughput_tok_s'] or 0:8.1f} tok/s  "
        f"mean latency {run['mean_latency_s'] or float('nan'):.3f}s  "
        f"acceptance length {run['mean_acceptance_length'] or float('nan'):.2f}"
        + (f"  {len(errors)} errors: {errors[0]}" if errors else "")
    )
    return run


def sweep_order(configs: list, loads: list, rnd: int, order: str = "level") -> list[tuple]:
    """The (configuration, load) runs of round ``rnd``.

    ``level`` (default): load by load, every configuration back to back, in serpentine order (the
    direction flips from one load to the next and from one round to the next). The runs a ratio
    compares are then close in time (for five configurations, within about a minute) instead of up
    to a round apart on a host whose speed drifts from minute to minute; no configuration is always
    first or last; and each orchestrator, with the dynamic policy's startup profile, is loaded once per
    load rather than once per round. Consecutive loads share their boundary configuration (one model
    switch fewer per load). It costs a model switch per configuration and load, against one per
    configuration for ``config`` (each configuration through all loads, the previous order). One
    A/B on a quiet machine showed no smaller round-to-round spread (docs/bench_history.md)."""
    if order == "config":
        return [(c, load) for c in configs for load in loads]
    if order != "level":
        raise ValueError(f"order={order!r}: expected level or config")
    seq = []
    for i, load in enumerate(loads):
        forward = (i + rnd) % 2 == 0
        seq += [(c, load) for c in (configs if forward else configs[::-1])]
    return seq


def run_bench(url: str, metrics_url: str | None, plan: BenchPlan, log=print) -> list[dict]:
    """Every configuration at every load, one orchestrator loaded at a time, in the order of
    :func:`sweep_order`; with ``plan.repeats`` > 1 the sweep is repeated in rounds and each
    (configuration, load) keeps its median-throughput run. Runs come back configuration by
    configuration, loads in the plan's order, whatever order they ran in."""
    switcher = ModelSwitcher(url, [c.model_name for c in plan.configs])
    runs = []
    try:
        for rnd in range(plan.repeats):
            if plan.repeats > 1:
                log(f"round {rnd + 1} of {plan.repeats}")
            for cfg, load in sweep_order(plan.configs, plan.loads, rnd, plan.order):
                if not switcher.is_active(cfg.model_name):
                    t0 = time.perf_counter()
                    switcher.activate(cfg.model_name)
                    log(f"{cfg.model_name}: ready in {time.perf_counter() - t0:.1f}s")
                runs.append({**run_one(url, metrics_url, cfg, load, plan, log), "repeat": rnd})
    finally:
        switcher.close()
    rank = {(c.model_name, lv.concurrency, lv.rate): (i, j)
            for i, c in enumerate(plan.configs) for j, lv in enumerate(plan.loads)}
    runs.sort(key=lambda r: (*rank[r["model"], r["concurrency"], r.get("rate")], r["repeat"]))
    return median_runs(runs) if plan.repeats > 1 else runs


def median_runs(runs: list[dict]) -> list[dict]:
    """Per (model, concurrency, rate): the run with the median throughput (the lower middle one for an
    even count), with every repeat's throughput in ``throughput_repeats``; first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["model"], r["concurrency"], r.get("rate")), []).append(r)
    out = []
    for rs in groups.values():
        ranked = sorted(rs, key=lambda r: r["throughput_tok_s"] or 0.0)
        out.append({**ranked[(len(ranked) - 1) // 2], "throughput_repeats": [r["throughput_tok_s"] for r in rs]})
    return out


# ---- command line -----------------------------------------------------------------------------------------
def _list(values: list[str] | None, cast=str) -> list:
    """``["1,4", "16"]`` -> ``[1, 4, 16]``; ``none`` is dropped from numeric lists."""
    items = [x for v in values or [] for x in v.replace(",", " ").split()]
    return [cast(x) for x in items if cast is str or x != "none"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightspec bench", description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hf", action="store_true", help="run the Hugging Face side-by-side instead (bench_hf)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="reduced sweep: concurrency 1 8, configs none static:2 dynamic, 32 tokens, few requests",
    )
    p.add_argument("--configs", nargs="+", help=f"default: {' '.join(DEFAULT_CONFIGS)}; CONFIG@2: pipeline depth 2")
    p.add_argument("--methods", nargs="+", default=["mtp"], help="mtp ngram draft (default mtp)")
    p.add_argument("--concurrency", nargs="+", help="closed-loop levels (default 1 4 16 64; 'none' for none)")
    p.add_argument("--rate", nargs="+", help="Poisson arrival rates in requests/s (open loop), added to the sweep")
    p.add_argument(
        "--requests",
        type=int,
        help="requests per run (default: max(16, 2 x concurrency), --quick max(16, 4 x C), --workload mixed "
        "max(16, 8 x C); rates: 8 s of arrivals)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens per request (default 128; 32 with --quick)")
    p.add_argument("--max-draft-tokens", type=int, default=4, help="K for dynamic (default 4)")
    p.add_argument("--prompts", help="JSON lines with a 'prompt' field (default: held-out stdlib code)")
    p.add_argument(
        "--workload",
        choices=("code", "mixed"),
        default="code",
        help="mixed: half code prompts, half shuffled-words prompts sampled at --mixed-temperature",
    )
    p.add_argument("--mixed-temperature", type=float, default=1.0,
                   help="temperature of the shuffled half of --workload mixed (default 1.0; <0: --temperature)")
    p.add_argument("--num-prompts", type=int, help="distinct default prompts (default 64; 16 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="max tokens of a default prompt")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=1, help="repeat the sweep in rounds; keep each run's median")
    p.add_argument(
        "--order",
        choices=("level", "config"),
        default="level",
        help="level (default): at each load every configuration back to back, serpentine; config: each "
        "configuration through all loads (fewer model switches, ratios over minutes of drift)",
    )
    p.add_argument("--warmup", type=int, default=2, help="short warm-up requests before each run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="target checkpoint (default: the embedded model)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config.pbtxt parameter for all models")
    p.add_argument("--url", help="gRPC HOST:PORT of a running server (explicit model control) instead of starting one")
    p.add_argument("--metrics-url", help="with --url: its metrics endpoint (default http://HOST:8002/metrics)")
    p.add_argument("--repository", help="write the generated model repository here (default: a temporary directory)")
    p.add_argument("--write-repository", metavar="DIR", help="only write the repository for --url use, then exit")
    p.add_argument("--tritonserver", help="tritonserver binary (default: as lightspec serve)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one response")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--plot", help="draw throughput and latency against concurrency here (PNG)")
    return p


def _overrides(args, prompts: list[Prompt], tokenizer, loads: list[Load]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a config.pbtxt parameter)")
        out[key.strip()] = value.strip()
    if args.model_dir:
        out["model_dir"] = str(Path(args.model_dir).resolve())
    if "num_kv_blocks" not in out:
        # Room for every concurrent request (prompt + tokens + lookahead), so the sweep measures
        # speculation rather than preemption; --set num_kv_blocks=N overrides.
        block = int(out.get("block_size", 16))
        longest = max(len(tokenizer.encode(p.text).ids) if tokenizer else len(p.text) for p in prompts)
        per_seq = math.ceil((longest + args.max_tokens + args.max_draft_tokens + 1) / block)
        peak = max([ld.concurrency or 0 for ld in loads] + [64 if any(ld.rate for ld in loads) else 0])
        out["num_kv_blocks"] = str(max(1024, math.ceil(1.1 * peak * per_seq)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--hf" in argv:
        from lightspec_backend import bench_hf

        return bench_hf.main([a for a in argv if a != "--hf"])
    args = build_parser().parse_args(argv)
    quick = QUICK if args.quick else {}
    args.max_tokens = args.max_tokens or quick.get("max_tokens", 128)
    configs = parse_configs(_list(args.configs) or quick.get("configs", DEFAULT_CONFIGS), _list(args.methods))
    levels = _list(args.concurrency, int) if args.concurrency else quick.get("concurrency", DEFAULT_CONCURRENCY)
    loads = [Load(concurrency=c) for c in levels] + [Load(rate=r) for r in _list(args.rate, float)]
    if not loads:
        raise SystemExit("nothing to run: give --concurrency and/or --rate")
    if any(
        (ld.concurrency is not None and ld.concurrency < 1) or (ld.rate is not None and ld.rate <= 0) for ld in loads
    ):
        raise SystemExit("--concurrency and --rate must be positive")
    tokenizer = load_tokenizer(args.model_dir)
    if args.prompts:
        prompts = read_prompts(args.prompts)
    else:
        prompts = default_prompts(
            args.num_prompts or quick.get("num_prompts", 64), tokenizer, args.prompt_tokens, args.workload, args.seed,
            None if args.mixed_temperature < 0 else args.mixed_temperature,
        )
    overrides = _overrides(args, prompts, tokenizer, loads)
    if args.write_repository:
        repo = write_bench_repository(args.write_repository, configs, overrides, args.max_draft_tokens)
        print(
            f"wrote {repo}: serve it with --model-control-mode=explicit "
            + " ".join(f"--load-model={s}" for s in stages_for(configs, overrides))
        )
        return 0
    plan = BenchPlan(
        configs, loads, prompts, args.max_tokens, args.requests, args.warmup, args.temperature, args.seed, args.timeout
    )
    plan.requests_rule = requests_rule(bool(quick), args.workload)
    plan.repeats = max(1, args.repeats)
    plan.order = args.order
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before the bench: other processes share the CPU, results will be noisy")
    t_start = time.perf_counter()
    if args.url:
        host = args.url.rsplit(":", 1)[0]
        runs = run_bench(args.url, args.metrics_url or f"http://{host}:8002/metrics", plan)
    else:
        runs = _run_with_server(args, configs, overrides, plan)
    elapsed = time.perf_counter() - t_start
    print()
    print(format_table(runs))
    comparison = dynamic_vs_static(runs)
    if comparison:
        print()
        print(format_comparison(comparison))
    print(f"\n{len(runs)} runs in {elapsed:.0f}s")
    if args.json:
        meta = {
            "argv": argv,
            "model_dir": overrides.get("model_dir"),
            "overrides": overrides,
            "prompts": len(prompts),
            "workload": "file" if args.prompts else args.workload,
            "elapsed_s": elapsed,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        Path(args.json).write_text(json.dumps({"runs": runs, "comparison": comparison, "meta": meta}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(runs, args.plot)
        print(f"wrote {args.plot}")
    return 1 if any(r["errors"] for r in runs) else 0


def _run_with_server(args, configs: list[RunConfig], overrides: dict[str, str], plan: BenchPlan) -> list[dict]:
    from .launcher import TritonServer

    tmp = None if args.repository else tempfile.mkdtemp(prefix="lightspec-bench-")
    repo = write_bench_repository(args.repository or Path(tmp) / "repo", configs, overrides, args.max_draft_tokens)
    server = TritonServer(
        repo, model_control_mode="explicit", load_models=stages_for(configs, overrides), tritonserver=args.tritonserver
    )
    try:
        t0 = time.perf_counter()
        print(f"starting tritonserver with {repo} ...", flush=True)
        server.start(timeout_s=600)
        print(
            f"tritonserver pid {server.pid} ready in {time.perf_counter() - t0:.1f}s "
            f"(gRPC {server.grpc_url}, metrics {server.metrics_url})",
            flush=True,
        )
        return run_bench(server.grpc_url, server.metrics_url, plan)
    except RuntimeError as e:
        raise SystemExit(f"{e}\n(server log: {getattr(server, '_log', '?')})") from None
    finally:
        server.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
