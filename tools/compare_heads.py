"""Compare MTP heads by the acceptance length they reach in the engine on held-out prompts.

    python tools/compare_heads.py --mtp-dir lightspec_core/default_model/mtp --mtp-dir /tmp/heads_run

For each ``--mtp-dir``, an in-process engine (``speculation=mtp``, ``--policy``, default
``static:4``) generates ``--max-tokens`` greedy tokens (ignore_eos) for each of ``--prompts`` held-out
code prompts (``tools/bench_engine.py``'s ``code_prompts``), all at once. Acceptance length is
1 + accepted drafts / request-steps with drafts, as ``RuntimeStats.mean_acceptance_length`` counts
it. Prints each directory's figure, its per-position acceptance, and its ratio to the first
directory's; greedy speculation is lossless, so every directory's outputs must be equal too.
"""

from __future__ import annotations

import argparse
import json

from lightspec_core.config import EngineConfig, SamplingParams
from lightspec_core.engine.engine import LLMEngine

try:  # as a script, tools/ is on the path; imported as tools.compare_heads, the repository root is
    from bench_engine import code_prompts
except ModuleNotFoundError:
    from tools.bench_engine import code_prompts


def measure(mtp_dir: str, model_dir: str | None, prompts: list[str], a: argparse.Namespace) -> dict:
    """One heads directory's acceptance on ``prompts``, and its outputs."""
    engine = LLMEngine(
        EngineConfig(model_dir=model_dir, mtp_dir=mtp_dir, speculation="mtp", policy=a.policy, profile_stages=False)
    )
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=a.max_tokens, ignore_eos=True))
        stats = engine.stats
    finally:
        engine.close()
    steps = stats.counters["spec_decode_num_steps_total"]
    accepted = sum(o.num_accepted_tokens for o in outs)
    assert accepted == stats.counters["spec_decode_num_accepted_tokens_total"]
    per_pos = [acc / max(d, 1) for acc, d in zip(stats.accepted_per_pos, stats.drafted_per_pos)]
    return {
        "mtp_dir": mtp_dir,
        "acceptance_length": stats.mean_acceptance_length(),
        "accepted": accepted,
        "steps": steps,
        "acceptance_per_position": [round(r, 4) for r in per_pos],
        "outputs": [o.output_token_ids for o in outs],
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tools/compare_heads.py", description=__doc__.split("\n")[0])
    ap.add_argument("--mtp-dir", action="append", required=True, help="heads directory (repeat; the first is the base)")
    ap.add_argument("--model-dir", default=None, help="target checkpoint (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--policy", default="static:4")
    ap.add_argument("--json", help="write the figures here")
    return ap


def main(argv: list[str] | None = None) -> list[dict]:
    a = build_parser().parse_args(argv)
    prompts = code_prompts(a.prompts)
    rows = [measure(d, a.model_dir, prompts, a) for d in a.mtp_dir]
    base = rows[0]["acceptance_length"]
    print("| heads | acceptance length | x first | per position | outputs = first |\n|---|---|---|---|---|")
    for r in rows:
        r["ratio_to_first"] = r["acceptance_length"] / base
        r["outputs_equal_first"] = r["outputs"] == rows[0]["outputs"]
        print(
            f"| {r['mtp_dir']} | {r['acceptance_length']:.3f} | {r['ratio_to_first']:.3f} | "
            f"{r['acceptance_per_position']} | {'yes' if r['outputs_equal_first'] else 'NO'} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in rows], f, indent=1)
    return rows


if __name__ == "__main__":
    main()
