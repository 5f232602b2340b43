"""``lightspec bench --peer vllm``: LightSpec and vLLM side by side on the same checkpoint, prompts,
token count and concurrency levels.

LightSpec runs first (one tritonserver, one orchestrator loaded at a time), each configuration at
each level twice: over gRPC (the bench's usual client) and over HTTP SSE (Triton's
``generate_stream``); then each vLLM configuration in its own server process, over HTTP SSE
(``/v1/completions``), with the same SSE client. Every run keeps its generated token ids, which are
compared with LightSpec ``none``'s for the same prompt (``mismatches``): greedy decoding is the
same function of the checkpoint on both servers, so a difference is a bug or float reordering.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from .peer import SERVED_NAME, PeerConfig, VllmServer, peer_env, scrape_peer, vllm_command, vllm_server_stats
from .runner import BenchPlan, ModelSwitcher, run_one, run_with_server, warm_up
from .scrape import scrape
from .sse import stream_factory


def lightspec_sweep(server, plan: BenchPlan, log=print) -> list[dict]:
    """Every LightSpec configuration at every level, over gRPC and over HTTP SSE, on ``server``
    (a started :class:`~lightspec_backend.launcher.TritonServer`)."""
    switcher = ModelSwitcher(server.grpc_url, [c.model_name for c in plan.configs])
    clients = (("grpc", server.grpc_url, None), ("http", server.http_url, stream_factory("lightspec")))
    runs = []
    try:
        for cfg in plan.configs:
            t0 = time.perf_counter()
            switcher.activate(cfg.model_name)
            log(f"{cfg.model_name}: ready in {time.perf_counter() - t0:.1f}s")
            for load in plan.loads:
                for protocol, url, stream in clients:
                    run = run_one(url, server.metrics_url, cfg, load, plan, log, stream)
                    runs.append({**run, "server": "lightspec", "protocol": protocol})
    finally:
        switcher.close()
    return runs


def _vllm_levels(server: VllmServer, cfg: PeerConfig, plan: BenchPlan, log) -> list[dict]:
    stream = stream_factory("vllm")
    runs = []
    for load in plan.loads:
        # the warm-up runs before the first scrape, so the acceptance counts are the run's own
        warm_up(server.url, SERVED_NAME, plan, stream)
        before = scrape(server.metrics_url)
        run = run_one(server.url, None, cfg, load, replace(plan, warmup=0), log, stream)
        run.update(vllm_server_stats(before, scrape_peer(server)))
        runs.append({**run, "server": "vllm", "protocol": "http"})
    return runs


def vllm_sweep(
    python: str | Path, model_dir: str | Path, configs: list[PeerConfig], plan: BenchPlan,
    extra: list[str] | None = None, cpus: str = "auto", log=print,
) -> list[dict]:  # fmt: skip
    """Every vLLM configuration at every level, each in its own server process (``cpus``: see
    :func:`~.peer.peer_env`)."""
    from ..launcher import free_ports

    runs = []
    for cfg in configs:
        port = free_ports(1)[0]
        server = VllmServer(vllm_command(python, model_dir, port, cfg, extra=extra), port, env=peer_env(cpus))
        t0 = time.perf_counter()
        log(f"starting vLLM ({cfg.config}) on port {port}, log {server.log_path} ...")
        try:
            server.start()
            log(f"vLLM ({cfg.config}) pid {server.process.pid} ready in {time.perf_counter() - t0:.1f}s")
            runs += _vllm_levels(server, cfg, plan, log)
        except RuntimeError as e:
            raise SystemExit(f"vLLM ({cfg.config}): {e}") from None
        finally:
            server.stop()
    return runs


def run_peer_bench(
    plan: BenchPlan,
    overrides: dict[str, str],
    max_draft_tokens: int,
    peer_python: str | Path,
    peer_configs: list[PeerConfig],
    model_dir: str | Path,
    peer_args: list[str] | None = None,
    tritonserver: str | None = None,
    peer_cpus: str = "auto",
) -> list[dict]:
    """LightSpec's sweep (gRPC and HTTP), then vLLM's; the LightSpec server is stopped before vLLM
    starts, so neither shares the CPU with the other's idle threads."""
    plan = replace(plan, keep_ids=True)
    runs = run_with_server(plan, overrides, max_draft_tokens, None, tritonserver, sweep=lightspec_sweep)
    runs += vllm_sweep(peer_python, model_dir, peer_configs, plan, peer_args, peer_cpus)
    return runs
