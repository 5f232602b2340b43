"""The numbers of a sweep: client-side latencies, quantiles, medians over rounds, and ratios.

A run is a dict (``config``, ``method``, ``concurrency``, ``rate``, ``throughput_tok_s``, ...);
these functions compute, the report prints.
"""

from __future__ import annotations

import math

import numpy as np

from .client import Record


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


def _finite(x) -> float | None:
    return None if x is None or not np.isfinite(x) else float(x)


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
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": tokens,
        "duration_s": duration,
        "throughput_tok_s": tokens / duration if duration > 0 else None,
        "mean_latency_s": _finite(lat.mean()),
        "p50_latency_s": _finite(np.percentile(lat, 50)),
        "p99_latency_s": _finite(np.percentile(lat, 99)),
        "mean_ttft_s": _finite(ttft.mean()),
        "p99_ttft_s": _finite(np.percentile(ttft, 99)),
        "mean_itl_s": decode_t / decode_n if decode_n else None,
        "mean_tpot_s": _finite(np.mean(tpot)) if tpot else None,
        "acceptance_rate": accepted / drafted if drafted else None,
        "tokens_per_step": decode_n / steps if steps else None,  # streamed tokens per engine step after the first
        # requests in flight on average (Little's law): a closed loop at level C should hold about C
        "mean_in_flight": _finite(lat.sum() / duration) if ok and duration > 0 else None,
    }


def underloaded(runs: list[dict], fraction: float = 0.8) -> list[dict]:
    """Closed-loop runs that held fewer than ``fraction`` of their level's requests in flight on
    average: their throughput is that of a lower level (the server or the client stalled between
    requests), so a ratio against them does not describe the level they are filed under."""
    return [
        r for r in runs
        if r.get("concurrency") and r.get("mean_in_flight") is not None
        and r["mean_in_flight"] < fraction * min(r["concurrency"], r.get("requests") or r["concurrency"])
    ]  # fmt: skip


def _run_name(r: dict, rounds: bool = False) -> str:
    server = r.get("server", "lightspec")
    level = f"c={r['concurrency']}" if r.get("concurrency") else f"rate={r.get('rate')}"
    name = r["model"] if server == "lightspec" else f"{server} {r['config']}"
    rnd = f" round {r.get('repeat', 0) + 1}" if rounds else ""
    return f"{name}{' ' + r['protocol'] if r.get('protocol') else ''} {level}{rnd}"


def run_caveats(runs: list[dict], steal_threshold: float = 0.1, rounds: bool = False) -> list[str]:
    """Notes on runs whose figures say less than their level: those with failed requests (a failed
    request's client made no tokens for a while, and its tokens are missing), :func:`underloaded`
    ones, and those during which the hypervisor gave more than ``steal_threshold`` of the CPU to
    other machines. ``rounds``: the runs are every round's, and each note names its run's round."""
    notes = []
    failed = [r for r in runs if r.get("errors")]
    if failed:
        names = "; ".join(f"{_run_name(r, rounds)}: {r['errors']} of {r.get('requests')}" for r in failed)
        notes.append(f"note: requests failed in: {names} (their ratios are not the level's)")
    low = underloaded(runs)
    if low:
        names = "; ".join(f"{_run_name(r, rounds)}: {r['mean_in_flight']:.1f} in flight" for r in low)
        notes.append(f"note: fewer requests in flight than the level (latency x throughput / tokens): {names}")
    stolen = [r for r in runs if (r.get("cpu_steal_share") or 0.0) > steal_threshold]
    if stolen:
        names = "; ".join(f"{_run_name(r, rounds)}: {100 * r['cpu_steal_share']:.0f} %" for r in stolen)
        notes.append(f"note: CPU time taken by other machines on the host during: {names}")
    return notes


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


# what each round of a repeated run keeps beside its median run: its timing, load, client figures and
# token check (not its per-request token ids nor its server counters: the median run holds those)
ROUND_FIELDS = (
    "repeat", "started_at", "throughput_tok_s", "mean_latency_s", "p50_latency_s", "p99_latency_s",
    "mean_ttft_s", "p99_ttft_s", "mean_itl_s", "mean_in_flight", "errors", "step_ms",
    "mean_acceptance_length", "loadavg_1m", "cpu_steal_share", "compared", "mismatches", "unchecked",
)  # fmt: skip


def median_runs(runs: list[dict]) -> list[dict]:
    """Per run kind (server, model, configuration, client protocol, concurrency, rate): the run with
    the median throughput (the lower middle one for an even count), with every repeat's throughput in
    ``throughput_repeats`` and every repeat's :data:`ROUND_FIELDS` in ``round_runs`` (round order);
    first-seen order."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        kind = (r.get("server"), r["model"], r.get("config"), r.get("protocol"), r["concurrency"], r.get("rate"))
        groups.setdefault(kind, []).append(r)
    out = []
    for rs in groups.values():
        ranked = sorted(rs, key=lambda r: r["throughput_tok_s"] or 0.0)
        rounds = [{k: r[k] for k in ROUND_FIELDS if k in r} for r in rs]
        median = ranked[(len(ranked) - 1) // 2]
        out.append({**median, "throughput_repeats": [r["throughput_tok_s"] for r in rs], "round_runs": rounds})
    return out


def every_round(runs: list[dict]) -> list[dict]:
    """Runs as :func:`median_runs` left them, back to one a round (each round's own figures over its
    median's), for what must see every round: failed requests, stolen CPU. Unrepeated runs as they are."""
    return [{**r, **x} for r in runs for x in r.get("round_runs") or [{}]]


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


def _x_none(dyn: dict[int, dict], static: list[dict], base: dict[int, dict]) -> dict[str, dict[int, float]]:
    """config -> level -> throughput x none, for ``dynamic`` and the static depths at its levels."""
    out: dict[str, dict[int, float]] = {}
    for c, d in dyn.items():
        if c not in base:
            continue
        for r in (d, *(r for r in static if r["concurrency"] == c)):
            out.setdefault(r["config"], {})[c] = r["throughput_tok_s"] / base[c]["throughput_tok_s"]
    return out


def _level_rows(method: str, dyn: dict[int, dict], static: list[dict], x_none: dict) -> list[dict]:
    """At each level: ``dynamic`` against the static depth with the best median there."""
    out = []
    for c, d in dyn.items():
        rivals = [r for r in static if r["concurrency"] == c]
        if not rivals:
            continue
        best = max(rivals, key=lambda r: r["throughput_tok_s"])
        pairs = zip(d.get("throughput_repeats") or [], best.get("throughput_repeats") or [])
        row = {"method": method, "load": c, "best_static": best["config"]}
        row["ratio"] = d["throughput_tok_s"] / best["throughput_tok_s"]
        row["rounds"] = [a / b for a, b in pairs if a and b]
        row["dynamic_x_none"] = x_none.get("dynamic", {}).get(c)
        out.append(row)
    return out


def _mean_row(method: str, x_none: dict[str, dict[int, float]]) -> dict | None:
    """Over the levels: the mean of ``dynamic``'s ratios to ``none`` against the best static mean."""
    levels = sorted(x_none.get("dynamic", {}))
    means = {cfg: sum(v[c] for c in levels) / len(levels) for cfg, v in x_none.items() if all(c in v for c in levels)}
    statics = [cfg for cfg in means if cfg != "dynamic"]
    if len(levels) <= 1 or not statics:
        return None
    best = max(statics, key=means.get)
    return {"method": method, "load": None, "best_static": best, "ratio": means["dynamic"] / means[best],
            "rounds": [], "dynamic_x_none": means["dynamic"]}  # fmt: skip


def dynamic_vs_static(runs: list[dict]) -> list[dict]:
    """Per method that has a ``dynamic`` run: at each closed-loop level, ``dynamic`` against ``none``
    and against the static depth with the best (median) throughput there, as the ratio of the two
    medians and round by round (``throughput_repeats`` come in round order; a round runs every
    configuration once, so one slow round slows both sides of its ratio); then, over the levels, the
    mean of ``dynamic``'s ratios to ``none`` against that of the static depth whose mean is best
    (``load`` = None). Rows: method, load, best static, ratio, per-round ratios, and ``dynamic`` x
    ``none``."""
    closed = [r for r in runs if r.get("rate") is None]
    base = {r["concurrency"]: r for r in closed if r["method"] == "none"}
    out = []
    for method in dict.fromkeys(r["method"] for r in closed if r["config"] == "dynamic"):
        dyn = {r["concurrency"]: r for r in closed if r["method"] == method and r["config"] == "dynamic"}
        static = [r for r in closed if r["method"] == method and r["config"].startswith("static")]
        x_none = _x_none(dyn, static, base)
        out += _level_rows(method, dyn, static, x_none)
        mean = _mean_row(method, x_none)
        if mean is not None:
            out.append(mean)
    return out


def run_label(run: dict) -> str:
    """``lightspec mtp dynamic grpc``, ``lightspec none http``, ``vllm ngram``."""
    if run.get("server", "lightspec") == "vllm":
        return f"vllm {run['config']}"
    what = "none" if run["method"] == "none" else f"{run['method']} {run['config']}"
    return f"lightspec {what} {run.get('protocol', 'grpc')}"


def mark_mismatches(runs: list[dict]) -> list[dict]:
    """Each run with ``compared``, ``mismatches`` and ``unchecked``: of its requests, how many had a
    reference (LightSpec ``none``'s first output for the same prompt, from any of its runs: one
    level's run holds only some of the prompts), how many of those generated other token ids
    (``None`` when none was compared: nothing was checked, which is not "no difference"), and how
    many had no reference. The runs' ``outputs`` (per-request token ids) are dropped."""
    ref: dict = {}
    for r in runs:
        if r.get("server", "lightspec") == "lightspec" and r["method"] == "none":
            for o in r.get("outputs", []):
                ref.setdefault(o["prompt"], o["ids"])
    out = []
    for r in runs:
        r = dict(r)
        outputs = r.pop("outputs", [])
        same = [o["ids"] == ref[o["prompt"]] for o in outputs if o["prompt"] in ref]
        out.append({**r, "compared": len(same), "mismatches": same.count(False) if same else None,
                    "unchecked": len(outputs) - len(same)})  # fmt: skip
    return out


def peer_ratios(runs: list[dict]) -> list[dict]:
    """At each closed-loop level, every LightSpec run (configuration x protocol) against vLLM's
    ``none`` and against vLLM's best configuration there (highest throughput): throughput ratios,
    and the mean-latency ratio to vLLM ``none``. Rows: load, label, throughput, the ratios, vLLM's
    best configuration."""
    closed = [r for r in runs if r.get("rate") is None and r.get("throughput_tok_s")]
    peers: dict[int, list[dict]] = {}
    for r in closed:
        if r.get("server") == "vllm":
            peers.setdefault(r["concurrency"], []).append(r)
    rows = []
    for r in closed:
        level = peers.get(r["concurrency"])
        if r.get("server") == "vllm" or not level:
            continue
        none = next((p for p in level if p["method"] == "none"), None)
        best = max(level, key=lambda p: p["throughput_tok_s"])
        rows.append({
            "load": r["concurrency"], "label": run_label(r), "throughput_tok_s": r["throughput_tok_s"],
            "x_vllm_none": _ratio(r, none, "throughput_tok_s"), "x_vllm_best": _ratio(r, best, "throughput_tok_s"),
            "vllm_best": best["config"], "latency_x_vllm_none": _ratio(r, none, "mean_latency_s"),
        })  # fmt: skip
    return sorted(rows, key=lambda row: row["load"])


def peer_comparison(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """(runs, :func:`peer_ratios` rows) of a peer bench. With several rounds (``repeat``), the runs
    are each kind's :func:`median_runs` and the ratios those of the medians, each row with its
    ratios round by round as well (``x_vllm_none_rounds``, ``x_vllm_best_rounds``: a round's
    LightSpec run against the same round's vLLM runs, None where that round has no such pair)."""
    rounds = sorted({r.get("repeat", 0) for r in runs})
    if len(rounds) < 2:
        return runs, peer_ratios(runs)
    medians = median_runs(runs)
    rows = peer_ratios(medians)
    per = [{(x["load"], x["label"]): x for x in peer_ratios([r for r in runs if r.get("repeat", 0) == k])}
           for k in rounds]  # fmt: skip
    for row in rows:
        key = (row["load"], row["label"])
        for name in ("x_vllm_none", "x_vllm_best"):
            row[name + "_rounds"] = [p[key][name] if key in p else None for p in per]
    return medians, rows
