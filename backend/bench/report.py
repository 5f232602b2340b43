"""A sweep's results for people and programs: the printed table and comparison, the JSON, the plot."""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

from .stats import ratio_rows, run_label

METHOD_STYLE = {"mtp": "-", "ngram": "-.", "draft": ":"}  # plot line style per method


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


def format_comparison(rows: list[dict]) -> str:
    """The rows of :func:`~lightspec_backend.bench.stats.dynamic_vs_static`, one line each."""
    lines = ["dynamic against the best static depth (ratio of medians; round by round) and against none:"]
    for r in rows:
        where = f"c={r['load']}" if r["load"] is not None else "mean of levels"
        rounds = f"  [{' '.join(f'{x:.2f}' for x in r['rounds'])}]" if r["rounds"] else ""
        x_none = f"  dynamic {r['dynamic_x_none']:.2f}x none" if r["dynamic_x_none"] is not None else ""
        lines.append(f"  {r['method']:<6} {where:>14}  {r['best_static']:<9} {r['ratio']:.2f}x{rounds}{x_none}")
    return "\n".join(lines)


def write_json(path: str | Path, runs: list[dict], comparison: list[dict], meta: dict) -> None:
    Path(path).write_text(json.dumps({"runs": runs, "comparison": comparison, "meta": meta}, indent=1) + "\n")


def save_results(args, argv: list[str], runs: list[dict], comparison: list[dict], meta: dict, plot_fn) -> None:
    """``--json`` and ``--plot``, where the flags ask for them (``plot_fn(runs, path)`` draws)."""
    if args.json:
        write_json(args.json, runs, comparison, {"argv": argv, **meta, "date": time.strftime("%Y-%m-%d %H:%M:%S")})
        print(f"wrote {args.json}")
    if args.plot:
        plot_fn(runs, args.plot)
        print(f"wrote {args.plot}")


def _series(runs: list[dict], xkey: str) -> list[tuple[str, list[dict]]]:
    """The runs on one x axis (closed loop or rates), one line per configuration, ``none`` first."""
    series: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if (xkey == "rate") == (r.get("rate") is not None):
            label = "none" if r["method"] == "none" else f"{r['method']} {r['config']}"
            series[label].append(r)
    for rs in series.values():
        rs.sort(key=lambda r: r[xkey])
    return sorted(series.items(), key=lambda kv: (kv[0] != "none", kv[0]))


def _style(label: str, first: dict, configs: list[str]) -> dict:
    if label == "none":
        return {"linestyle": "--", "color": "black"}
    # colour: configuration; line style: method
    return {"color": f"C{configs.index(first['config']) % 10}", "linestyle": METHOD_STYLE[first["method"]]}


def _label_axes(row: list, runs: list[dict], xkey: str, xlabel: str) -> None:
    levels = sorted({r["concurrency"] for r in runs if r.get("rate") is None})
    for ax, ylabel in zip(row, ("output tokens/s", "mean request latency, s")):
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        if xkey == "concurrency":
            ax.set_xscale("log", base=2)
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off()
        ax.grid(True, alpha=0.3)
    row[0].legend(fontsize=8)


def _plot_row(row: list, runs: list[dict], xkey: str, xlabel: str) -> None:
    """Throughput (left) and mean latency (right) against ``xkey``."""
    configs = sorted({r["config"] for r in runs if r["method"] != "none"})
    for label, rs in _series(runs, xkey):
        style = _style(label, rs[0], configs)
        xs = [r[xkey] for r in rs]
        row[0].plot(xs, [r["throughput_tok_s"] for r in rs], marker="o", label=label, **style)
        row[1].plot(xs, [r["mean_latency_s"] for r in rs], marker="o", label=label, **style)
    _label_axes(row, runs, xkey, xlabel)


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
    for row, (xkey, xlabel) in zip(axes, axes_x):
        _plot_row(list(row), runs, xkey, xlabel)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# the columns of the peer table: what both servers report
PEER_COLUMNS = [c for c in COLUMNS if c[2] in (
    "throughput_tok_s", "mean_latency_s", "p99_latency_s", "mean_ttft_s", "mean_itl_s", "mean_acceptance_length"
)] + [("differ", 7, "mismatches", lambda v: "-" if v is None else str(v))]  # fmt: skip


def format_peer_table(runs: list[dict]) -> str:
    """One row per run of ``--peer``, level by level: LightSpec's runs (gRPC and HTTP), then vLLM's;
    ``differ``: requests whose tokens differ from LightSpec ``none``'s for the same prompt."""
    head = f"{'server / config / client':<34} {'load':>5} " + " ".join(f"{h:>{w}}" for h, w, _, _ in PEER_COLUMNS)
    lines = [head, "-" * len(head)]
    for r in sorted(runs, key=lambda r: (r["concurrency"] or 0, r.get("server") == "vllm")):
        cells = " ".join(f"{fmt(r.get(key)):>{w}}" for _, w, key, fmt in PEER_COLUMNS)
        errors = f"  [{r['errors']} errors]" if r.get("errors") else ""
        lines.append(f"{run_label(r):<34} {'c=' + str(r['concurrency']):>5} {cells}{errors}")
    return "\n".join(lines)


def format_peer_ratios(rows: list[dict]) -> str:
    """The rows of :func:`~lightspec_backend.bench.stats.peer_ratios`, one line each; where the rows
    carry round-by-round ratios (:func:`~lightspec_backend.bench.stats.peer_comparison`), those too."""
    ratio, plain = _num(".2f", suffix="x"), _num(".2f")
    by_round = any("x_vllm_best_rounds" in r for r in rows)
    head = f"{'LightSpec against vLLM':<34} {'load':>5} {'tok/s':>8} {'x none':>7} {'x best':>7} (best)   lat x none"
    lines = [head + ("   x none by round   x best by round" if by_round else "")]
    for r in rows:
        line = (
            f"{r['label']:<34} {'c=' + str(r['load']):>5} {r['throughput_tok_s']:8.1f} {ratio(r['x_vllm_none']):>7} "
            f"{ratio(r['x_vllm_best']):>7} {r['vllm_best']:<8} {ratio(r['latency_x_vllm_none']):>10}"
        )
        if by_round:
            for name in ("x_vllm_none_rounds", "x_vllm_best_rounds"):
                line += "   " + " ".join(plain(v) for v in r.get(name, []))
        lines.append(line)
    return "\n".join(lines)


def plot_peer(runs: list[dict], path: str | Path) -> None:
    """Throughput and mean latency against concurrency, one line per server / configuration / client
    (vLLM dashed, LightSpec over HTTP dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if r.get("rate") is None:
            series[run_label(r)].append(r)
    fig, row = plt.subplots(1, 2, figsize=(11, 4.2))
    colours = plt.get_cmap("tab20")  # up to 20 lines, each its own colour
    for i, (label, rs) in enumerate(sorted(series.items())):
        rs.sort(key=lambda r: r["concurrency"])
        style = "--" if label.startswith("vllm") else ":" if label.endswith("http") else "-"
        xs = [r["concurrency"] for r in rs]
        kw = {"marker": "o", "label": label, "linestyle": style, "color": colours(i % 20)}
        row[0].plot(xs, [r["throughput_tok_s"] for r in rs], **kw)
        row[1].plot(xs, [r["mean_latency_s"] for r in rs], **kw)
    _label_axes(list(row), runs, "concurrency", "concurrency (closed loop)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
