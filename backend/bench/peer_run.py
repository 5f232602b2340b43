"""``lightspec bench --peer vllm``: LightSpec and vLLM side by side on the same checkpoint, prompts,
token count and concurrency levels.

Every server starts before the first run and stays up to the last: one vLLM server per vLLM
configuration (each takes minutes to start) and one tritonserver (one LightSpec orchestrator loaded
at a time). The runs then interleave, level by level, in serpentine order: each LightSpec
configuration, over gRPC (the bench's usual client) and over HTTP SSE (Triton's
``generate_stream``), the two swapping places from round to round, next to the vLLM configuration
of its method, over HTTP SSE (``/v1/completions``) with the same SSE client. The two sides of a
ratio run a minute or two apart instead of one whole server's sweep apart: on a shared host whose
speed drifts from minute to minute (another machine's load shows as CPU steal), a sweep run
entirely before the other's can lose a quarter of its speed to a drift the other never saw. An
idle vLLM server took about 1 % of a core (sampled from /proc while LightSpec ran). With
``--repeats`` the interleaved sweep repeats in rounds on the same servers.

Every run keeps its generated token ids, which are compared with LightSpec ``none``'s for the same
prompt (``mismatches``): greedy decoding is the same function of the checkpoint on both servers, so
a difference is a bug or float reordering.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace
from pathlib import Path

from .peer import SERVED_NAME, PeerConfig, VllmServer, peer_env, scrape_peer, vllm_command, vllm_server_stats
from .runner import BenchPlan, ModelSwitcher, run_one, run_with_server, sweep_order, warm_up
from .scrape import scrape
from .sse import stream_factory


def interleaved(configs: list, peers: list[PeerConfig]) -> list[tuple[str, object]]:
    """The order of one level's runs: each LightSpec configuration followed by the vLLM
    configuration of the same method (none, ngram, draft), vLLM's others at the end."""
    items, rest = [], list(peers)
    for cfg in configs:
        items.append(("lightspec", cfg))
        match = next((p for p in rest if p.config == cfg.method), None)
        if match is not None:
            items.append(("vllm", match))
            rest.remove(match)
    return items + [("vllm", p) for p in rest]


def lightspec_clients(server, rnd: int) -> list[tuple[str, str, object]]:
    """(protocol, url, stream factory) of LightSpec's two clients in round ``rnd``: gRPC first in even
    rounds, HTTP SSE first in odd ones: the first run after a model switch finds the prompts not yet
    in the prefix cache, and no client should always be the one to take it."""
    clients = [("grpc", server.grpc_url, None), ("http", server.http_url, stream_factory("lightspec"))]
    return clients if rnd % 2 == 0 else clients[::-1]


def _tagged(log, server: str, protocol: str):
    """``log`` with each run's line naming the server and the client: at a level one configuration
    runs twice on LightSpec, and a vLLM configuration shares a method's name with LightSpec's."""
    return lambda line: log(f"  {server:<9} {protocol:<4} {line.lstrip()}")


def _lightspec_runs(server, switcher: ModelSwitcher, cfg, load, plan: BenchPlan, rnd: int, log) -> list[dict]:
    if not switcher.is_active(cfg.model_name):
        t0 = time.perf_counter()
        switcher.activate(cfg.model_name)
        log(f"{cfg.model_name}: ready in {time.perf_counter() - t0:.1f}s")
    runs = []
    for protocol, url, stream in lightspec_clients(server, rnd):
        run = run_one(url, server.metrics_url, cfg, load, plan, _tagged(log, "lightspec", protocol), stream)
        runs.append({**run, "server": "lightspec", "protocol": protocol})
    return runs


def _vllm_run(server: VllmServer, cfg: PeerConfig, load, plan: BenchPlan, log) -> dict:
    stream = stream_factory("vllm")
    # the warm-up runs before the first scrape, so the acceptance counts are the run's own
    warm_up(server.url, SERVED_NAME, plan, stream)
    before = scrape(server.metrics_url)
    run = run_one(server.url, None, cfg, load, replace(plan, warmup=0), _tagged(log, "vllm", "http"), stream)
    run.update(vllm_server_stats(before, scrape_peer(server)))
    return {**run, "server": "vllm", "protocol": "http"}


def peer_sweep(server, vllm: dict[str, VllmServer], peers: list[PeerConfig], plan: BenchPlan, log=print) -> list[dict]:
    """Round by round, level by level, the runs of :func:`interleaved` in serpentine order
    (:func:`~.runner.sweep_order`) on ``server`` (a started tritonserver) and the started vLLM
    servers (``vllm``: configuration name -> server). Each run carries its ``repeat``."""
    items = interleaved(plan.configs, peers)
    switcher = ModelSwitcher(server.grpc_url, [c.model_name for c in plan.configs])
    runs = []
    try:
        for rnd in range(plan.repeats):
            if plan.repeats > 1:
                log(f"round {rnd + 1} of {plan.repeats}")
            for (kind, cfg), load in sweep_order(items, plan.loads, rnd):
                if kind == "lightspec":
                    done = _lightspec_runs(server, switcher, cfg, load, plan, rnd, log)
                else:
                    done = [_vllm_run(vllm[cfg.config], cfg, load, plan, log)]
                runs += [{**run, "repeat": rnd} for run in done]
    finally:
        switcher.close()
    return runs


def start_vllm_servers(
    stack: contextlib.ExitStack, python: str | Path, model_dir: str | Path, peers: list[PeerConfig],
    extra: list[str] | None = None, cpus: str = "auto", log=print,
) -> dict[str, VllmServer]:  # fmt: skip
    """One vLLM server per configuration (``cpus``: see :func:`~.peer.peer_env`), each stopped when
    ``stack`` closes."""
    from ..launcher import free_ports

    servers = {}
    for cfg in peers:
        port = free_ports(1)[0]
        server = VllmServer(vllm_command(python, model_dir, port, cfg, extra=extra), port, env=peer_env(cpus))
        stack.callback(server.stop)
        t0 = time.perf_counter()
        log(f"starting vLLM ({cfg.config}) on port {port}, log {server.log_path} ...")
        try:
            server.start()
        except RuntimeError as e:
            raise SystemExit(f"vLLM ({cfg.config}): {e}") from None
        log(f"vLLM ({cfg.config}) pid {server.process.pid} ready in {time.perf_counter() - t0:.1f}s")
        servers[cfg.config] = server
    return servers


def report_order(runs: list[dict], configs: list, peers: list[PeerConfig], loads: list) -> list[dict]:
    """The runs as the report lists them, whatever order they ran in: LightSpec's configurations,
    then vLLM's, each level by level, gRPC before HTTP, rounds in order."""
    rank = {("lightspec", c.model_name): i for i, c in enumerate(configs)}
    rank.update({("vllm", p.config): len(configs) + i for i, p in enumerate(peers)})
    level = {ld.concurrency: j for j, ld in enumerate(loads)}

    def key(r: dict) -> tuple:
        which = (r["server"], r["model"] if r["server"] == "lightspec" else r["config"])
        return rank[which], level[r["concurrency"]], r["protocol"] != "grpc", r.get("repeat", 0)

    return sorted(runs, key=key)


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
    log=print,
) -> list[dict]:
    """The vLLM servers, then tritonserver, then :func:`peer_sweep`; every run of every round, in
    :func:`report_order`. Every server is stopped before this returns."""
    plan = replace(plan, keep_ids=True)
    with contextlib.ExitStack() as stack:
        vllm = start_vllm_servers(stack, peer_python, model_dir, peer_configs, peer_args, peer_cpus, log)
        runs = run_with_server(plan, overrides, max_draft_tokens, None, tritonserver,
                               sweep=lambda server, p: peer_sweep(server, vllm, peer_configs, p, log))  # fmt: skip
    return report_order(runs, plan.configs, peer_configs, plan.loads)
