"""``lightspec bench --peer vllm``: the vLLM environment, the dry run, the run and its report."""

from __future__ import annotations

import os
import shlex
import time
from pathlib import Path

from .peer import create_venv, default_venv, find_peer_python, peer_configs, peer_env, venv_plan, vllm_command
from .peer_run import interleaved, run_peer_bench
from .report import format_peer_ratios, format_peer_table, plot_peer, save_results
from .runner import BenchPlan
from .stats import mark_mismatches, peer_comparison, run_caveats


def _model_dirs(overrides: dict[str, str]) -> tuple[Path, Path]:
    """The target checkpoint both servers load and the draft model beside it (``draft_dir`` when set)."""
    from lightspec_core import default_model_dir

    target = Path(overrides.get("model_dir") or default_model_dir())
    return target, Path(overrides.get("draft_dir") or target.parent / "draft")


def _peer_python(args) -> Path:
    if args.peer_venv_create:
        return create_venv(args.peer_venv_create, torch_index=args.peer_torch_index)
    python = find_peer_python(args.peer_python)
    if python is None:
        raise SystemExit(
            f"--peer vllm: no vLLM environment at {default_venv()}; make one with --peer-venv-create [DIR] "
            "(or name one with --peer-python PATH; --peer-dry-run prints the plan)"
        )
    return python


def _dry_run(args, plan: BenchPlan, overrides: dict[str, str]) -> int:
    venv = args.peer_venv_create or str(default_venv())
    print(f"vLLM environment ({venv}):")
    for cmd in venv_plan(venv, torch_index=args.peer_torch_index):
        print("  " + shlex.join(cmd))
    target, draft = _model_dirs(overrides)
    python = args.peer_python or str(Path(venv) / "bin" / "python")
    print("vLLM servers (PORT: a free port at run time):")
    for cfg in peer_configs(args.peer_configs, draft, args.max_draft_tokens):
        print(
            "  "
            + shlex.join(vllm_command(python, target, 0, cfg, extra=args.peer_arg)).replace(
                " --port 0 ", " --port PORT ", 1
            )
        )
    env = " ".join(f"{k}={v}" for k, v in peer_env(args.peer_cpus).items())
    print(f"vLLM environment variables: {env or '(vLLM defaults)'}")
    print("LightSpec configurations: " + " ".join(c.model_name for c in plan.configs))
    print(
        "levels: "
        + " ".join(f"{ld.label} ({plan.num_requests(ld)} requests)" for ld in plan.loads)
        + f"; {plan.max_tokens} tokens per request"
    )
    items = interleaved(plan.configs, peer_configs(args.peer_configs, draft, args.max_draft_tokens))
    order = ", ".join(cfg.model_name if kind == "lightspec" else f"vllm {cfg.config}" for kind, cfg in items)
    print(f"at each level, in turn (reversed every other level): {order}")
    return 0


def _report(args, argv: list[str], every: list[dict], meta: dict) -> None:
    """``every``: every run of every round; the tables show each kind's median over the rounds."""
    runs, ratios = peer_comparison(every)
    rounds = len({r.get("repeat", 0) for r in every})
    print()
    print(format_peer_table(runs))
    print()
    print(format_peer_ratios(ratios))
    differ = [r for r in every if r["mismatches"]]
    compared, unchecked = sum(r["compared"] for r in every), sum(r["unchecked"] for r in every)
    print(
        f"\ntoken identity: {sum(r['mismatches'] or 0 for r in every)} of {compared} requests differ from "
        "LightSpec none"
        + (f" (in {', '.join(sorted({str(r['concurrency']) for r in differ}))})" if differ else "")
        + (f"; {unchecked} not compared (no LightSpec none output for their prompt)" if unchecked else "")
    )
    for note in run_caveats(every, rounds=rounds > 1):
        print(note)
    print(
        f"{len(every)} runs in {meta['elapsed_s']:.0f}s"
        + (f", {rounds} rounds (tables: medians)" if rounds > 1 else "")
    )
    save_results(args, argv, runs, ratios, {**meta, "rounds": rounds}, plot_peer)


def peer_main(args, argv: list[str], plan: BenchPlan, overrides: dict[str, str]) -> int:
    """The peer bench (:mod:`.peer_run`) from the parsed flags."""
    if args.rate or args.url:
        raise SystemExit("--peer: closed-loop levels only, on servers the bench starts (no --rate, no --url)")
    if args.peer_dry_run:
        return _dry_run(args, plan, overrides)
    python = _peer_python(args)
    target, draft = _model_dirs(overrides)
    configs = peer_configs(args.peer_configs, draft, args.max_draft_tokens)
    load = os.getloadavg()[0]
    if load > 0.5:
        print(f"note: load average {load:.1f} before the bench: other processes share the CPU, results will be noisy")
    t0 = time.perf_counter()
    runs = run_peer_bench(plan, overrides, args.max_draft_tokens, python, configs, target, args.peer_arg,
                          args.tritonserver, args.peer_cpus)  # fmt: skip
    runs = mark_mismatches(runs)
    meta = {"model_dir": str(target), "peer_python": str(python), "peer_cpus": args.peer_cpus, "overrides": overrides,
            "prompts": len(plan.prompts), "elapsed_s": time.perf_counter() - t0}  # fmt: skip
    _report(args, argv, runs, meta)
    return 1 if any(r["errors"] for r in runs) else 0
