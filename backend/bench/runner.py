"""Driving the server: one orchestrator loaded at a time, the sweep over configurations and loads."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .client import Record, Request, run_closed_loop, run_open_loop
from .configs import RunConfig, stages_for, write_bench_repository
from .scrape import engine_processes, finished_requests, model_config, scrape, server_stats, wait_for_requests
from .stats import client_stats, kind_stats, median_runs
from .workload import Prompt

QUICK = {
    "concurrency": [1, 8],
    "configs": ["none", "static:2", "dynamic"],
    "max_tokens": 32,
    "num_prompts": 16,
    "requests": (16, 4),  # per run: max(16, 4 x concurrency)
}
MIXED_REQUESTS = (16, 8)  # --workload mixed, per run: max(16, 8 x concurrency)
PEER_REQUESTS = (16, 8)  # --peer, per run: max(16, 8 x concurrency)


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
            self._load(model)
        deadline = time.monotonic() + timeout_s
        while not self._ready(model):
            if time.monotonic() > deadline:
                raise RuntimeError(f"model {model!r} not ready after {timeout_s:.0f}s")
            time.sleep(0.2)
        self.active = model

    def _load(self, model: str) -> None:
        from tritonclient.utils import InferenceServerException

        try:
            self.client.load_model(model)
        except InferenceServerException as e:
            raise SystemExit(
                f"cannot load {model!r}: {e.message()}\nThe server needs --model-control-mode=explicit and a "
                "repository written by `lightspec bench --write-repository DIR` (same --configs/--methods)."
            ) from None

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
        ready = [m["name"] for m in self._index() if m.get("state") == "READY"]
        return [name for name in ready if self._is_orchestrator(name)]

    def _is_orchestrator(self, model: str) -> bool:
        cfg = self.client.get_model_config(model, as_json=True).get("config", {})
        role = cfg.get("parameters", {}).get("role", {}).get("string_value") or "orchestrator"
        return cfg.get("backend") == "lightspec" and role == "orchestrator"

    def _index(self) -> list[dict]:
        return self.client.get_model_repository_index(as_json=True).get("models", [])

    def _ready(self, model: str) -> bool:
        from tritonclient.utils import InferenceServerException

        try:
            return self.client.is_model_ready(model)
        except InferenceServerException:
            return False

    def _state(self, model: str) -> str | None:
        return next((m.get("state") for m in self._index() if m.get("name") == model), None)

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


def requests_rule(quick: bool, workload: str, peer: bool = False) -> tuple[int, int]:
    """(minimum, per unit of concurrency) requests per closed-loop run when --requests is not given."""
    if quick:
        return QUICK["requests"]
    if workload == "mixed":
        # Requests of two speeds: a closed-loop run of 2 x C requests is mostly its tail, the last
        # slow (unpredictable) requests running in a shrinking batch, and measures that tail, not
        # the steady state the schedule is for; 8 x C requests make the tail a small part.
        return MIXED_REQUESTS
    if peer:
        # Speculating requests finish at their own speeds too (acceptance varies by prompt): at
        # 2 x C a run at c=16 lasts about 3 s and its clients average 13 requests in flight of 16.
        # The engines are compared in the steady state instead.
        return PEER_REQUESTS
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
    keep_ids: bool = False  # keep each request's token ids in the run (the peer bench compares them)

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


def _drive(url: str, model: str, load: Load, plan: BenchPlan, stream=None) -> tuple[list[Record], float]:
    requests = plan.requests_for(plan.num_requests(load))
    if load.rate is None:
        return run_closed_loop(url, model, requests, load.concurrency, plan.timeout_s, stream)
    if stream is not None:
        raise ValueError("rate: open-loop runs use the gRPC streams only")
    return run_open_loop(url, model, requests, load.rate, plan.seed, plan.timeout_s)


def warm_up(url: str, model: str, plan: BenchPlan, stream=None) -> None:
    """``plan.warmup`` short requests, two at a time, before a run is measured. Their prompts are the
    last ones of the list, which a run reaches last: the prefix cache keeps what a warm-up computed,
    and the run's first requests would find their prompts there (vLLM's runs have no warm-up)."""
    if plan.warmup:
        prompts = plan.requests_for(plan.warmup, offset=-plan.warmup)
        warm = [Request(r.prompt, min(16, plan.max_tokens), r.temperature) for r in prompts]
        run_closed_loop(url, model, warm, min(2, plan.warmup), plan.timeout_s, stream)


def cpu_times() -> list[int] | None:
    """The machine's CPU times (``/proc/stat``'s first line, in ticks), or None where there is none."""
    try:
        with open("/proc/stat") as f:
            return [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None


def steal_share(before: list[int] | None, after: list[int] | None) -> float | None:
    """The share of CPU time the hypervisor gave to other machines between two :func:`cpu_times`
    (the 8th field, ``steal``): on a shared VM a run that lost a third of its CPU says so here."""
    if not before or not after or len(before) < 8:
        return None
    delta = [a - b for a, b in zip(after, before)]
    total = sum(delta[:8])  # user .. steal; guest time is counted inside user already
    return delta[7] / total if total > 0 else None


def _measure(url: str, metrics_url: str | None, model: str, load: Load, plan: BenchPlan, stream=None):
    """(records, duration, metrics before, metrics after, CPU steal share) of one run after its warm-up."""
    # the warm-up's requests must be in the server's counters before the baseline is taken (the
    # backend publishes them at most every 0.25 s), else the run's figures would count them
    earlier = scrape(metrics_url)
    warm_up(url, model, plan, stream)
    before = None
    if earlier is not None:
        before = wait_for_requests(metrics_url, model, finished_requests(earlier, model) + plan.warmup, 5.0)
    cpu_before = cpu_times()
    records, duration = _drive(url, model, load, plan, stream)
    steal = steal_share(cpu_before, cpu_times())
    after = None
    if before is not None:
        after = wait_for_requests(metrics_url, model, finished_requests(before, model) + len(records))
    return records, duration, before, after, steal


def run_one(
    url: str, metrics_url: str | None, cfg: RunConfig, load: Load, plan: BenchPlan, log=print, stream=None
) -> dict:
    """One configuration at one load level: warm up, scrape, run, wait for the metrics, scrape.
    ``stream``: the client's ``make_stream`` (default gRPC; :func:`.sse.stream_factory` for HTTP).
    With ``plan.keep_ids`` the run keeps each request's generated token ids (``outputs``)."""
    model = cfg.model_name
    started_at = time.time()  # the JSON lists runs by configuration; this keeps the order they ran in
    records, duration, before, after, steal = _measure(url, metrics_url, model, load, plan, stream)
    run = {
        "started_at": started_at,
        "config": cfg.config,
        "method": cfg.method,
        "model": model,
        "concurrency": load.concurrency,
        "rate": load.rate,
        "pipeline_depth": cfg.pipeline_depth,
        "max_tokens": plan.max_tokens,
        "loadavg_1m": os.getloadavg()[0],  # other processes on the machine show here
        "cpu_steal_share": steal,  # other machines on the host (a VM's stolen time) show here
        **client_stats(records, duration),
        **server_stats(before, after, model),
    }
    steps = run.get("engine_steps")
    # the backend sums engine_steps_total over its engine processes, which step side by side
    # (lightspec_core.engine.shards): one engine's mean step is the duration over its own share.
    # An HTTP client (``stream``) has Triton's HTTP address, not its gRPC one
    engines = engine_processes(model_config(url, model, http=stream is not None)) if steps else None
    run["engine_processes"] = engines
    run["step_ms"] = 1000 * duration * (engines or 1) / steps if steps and duration else None
    kinds = kind_stats(records)
    if len(kinds) > 1:
        run["by_kind"] = kinds
    errors = [r.error for r in records if r.error]
    if errors:
        run["first_error"] = errors[0]
    if plan.keep_ids:
        run["outputs"] = [{"prompt": r.prompt, "ids": r.ids} for r in records if r.error is None]
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
    configuration for ``config`` (each configuration through all loads)."""
    if order == "config":
        return [(c, load) for c in configs for load in loads]
    if order != "level":
        raise ValueError(f"order={order!r}: expected level or config")
    seq = []
    for i, load in enumerate(loads):
        forward = (i + rnd) % 2 == 0
        seq += [(c, load) for c in (configs if forward else configs[::-1])]
    return seq


def _sweep(url: str, metrics_url: str | None, plan: BenchPlan, switcher: ModelSwitcher, log) -> list[dict]:
    runs = []
    for rnd in range(plan.repeats):
        if plan.repeats > 1:
            log(f"round {rnd + 1} of {plan.repeats}")
        for cfg, load in sweep_order(plan.configs, plan.loads, rnd, plan.order):
            if not switcher.is_active(cfg.model_name):
                t0 = time.perf_counter()
                switcher.activate(cfg.model_name)
                log(f"{cfg.model_name}: ready in {time.perf_counter() - t0:.1f}s")
            runs.append({**run_one(url, metrics_url, cfg, load, plan, log), "repeat": rnd})
    return runs


def run_bench(url: str, metrics_url: str | None, plan: BenchPlan, log=print) -> list[dict]:
    """Every configuration at every load, one orchestrator loaded at a time, in the order of
    :func:`sweep_order`; with ``plan.repeats`` > 1 the sweep is repeated in rounds and each
    (configuration, load) keeps its median-throughput run. Runs come back configuration by
    configuration, loads in the plan's order, whatever order they ran in."""
    switcher = ModelSwitcher(url, [c.model_name for c in plan.configs])
    try:
        runs = _sweep(url, metrics_url, plan, switcher, log)
    finally:
        switcher.close()
    rank = {(c.model_name, lv.concurrency, lv.rate): (i, j)
            for i, c in enumerate(plan.configs) for j, lv in enumerate(plan.loads)}  # fmt: skip
    runs.sort(key=lambda r: (*rank[r["model"], r["concurrency"], r.get("rate")], r["repeat"]))
    return median_runs(runs) if plan.repeats > 1 else runs


def run_with_server(
    plan: BenchPlan,
    overrides: dict[str, str],
    max_draft_tokens: int,
    repository: str | None = None,
    tritonserver: str | None = None,
    sweep=None,
) -> list[dict]:
    """The sweep on a tritonserver started here (explicit model control, the stage models loaded)
    from a repository written to ``repository`` (default: a temporary directory, removed after).
    ``sweep(server, plan) -> runs`` replaces :func:`run_bench` (the peer bench's LightSpec side)."""
    from ..launcher import TritonServer

    tmp = None if repository else tempfile.mkdtemp(prefix="lightspec-bench-")
    repo = write_bench_repository(repository or Path(tmp) / "repo", plan.configs, overrides, max_draft_tokens)
    stages = stages_for(plan.configs, overrides)
    server = TritonServer(repo, model_control_mode="explicit", load_models=stages, tritonserver=tritonserver)
    try:
        t0 = time.perf_counter()
        print(f"starting tritonserver with {repo} ...", flush=True)
        server.start(timeout_s=600)
        print(
            f"tritonserver pid {server.pid} ready in {time.perf_counter() - t0:.1f}s "
            f"(gRPC {server.grpc_url}, metrics {server.metrics_url})",
            flush=True,
        )
        if sweep is not None:
            return sweep(server, plan)
        return run_bench(server.grpc_url, server.metrics_url, plan)
    except RuntimeError as e:
        raise SystemExit(f"{e}\n(server log: {server.log_file or '?'})") from None
    finally:
        server.stop()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
