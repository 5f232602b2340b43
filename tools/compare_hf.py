"""LightSpec next to Hugging Face ``transformers`` assisted generation, batch 1, greedy, same checkpoints.

python tools/compare_hf.py [--model-dir DIR] [--num-prompts 8] [--max-tokens 64] [--json OUT]

Systems (``--systems``, default all):

- ``hf``: ``AutoModelForCausalLM.generate`` (the checkpoint's own family) without speculation (the reference output);
- ``hf_assisted``: ``generate(..., assistant_model=draft)`` with the draft model's
  ``num_assistant_tokens_schedule = "heuristic"`` (HF's own adaptive draft length);
- ``hf_prompt_lookup``: ``generate(..., prompt_lookup_num_tokens=K)`` (prompt-lookup decoding);
- ``lightspec_none``, ``lightspec_draft``, ``lightspec_ngram``, ``lightspec_mtp``: the in-process
  ``LLMEngine`` with that speculation method and ``--policy`` (default dynamic), one request at a time.

Every system decodes the same prompt token ids greedily and stops at EOS or ``--max-tokens``; each output
is checked token for token against ``hf``'s, and mismatches are reported with the first differing
position. Pairs compared by tokens/s: ``lightspec_draft`` / ``hf_assisted`` (draft model),
``lightspec_ngram`` / ``hf_prompt_lookup`` (prompt lookup), ``lightspec_none`` / ``hf``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

HF_SYSTEMS = ("hf", "hf_assisted", "hf_prompt_lookup")
LIGHTSPEC_SYSTEMS = ("lightspec_none", "lightspec_draft", "lightspec_ngram", "lightspec_mtp")
PAIRS = [("lightspec_draft", "hf_assisted"), ("lightspec_ngram", "hf_prompt_lookup"), ("lightspec_none", "hf")]
REFERENCE = "hf"


@dataclass
class SystemResult:
    name: str
    outputs: list[list[int]] = field(default_factory=list)  # generated ids per prompt (no prompt ids)
    seconds: float = 0.0

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first position where ``a`` and ``b`` differ (a length difference counts), or ``None``."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mismatches(result: SystemResult, reference: SystemResult) -> list[dict]:
    """Prompts whose output differs from the reference's: ``{"prompt": i, "position": j}``."""
    out = []
    for i, (got, want) in enumerate(zip(result.outputs, reference.outputs)):
        pos = first_difference(got, want)
        if pos is not None:
            out.append({"prompt": i, "position": pos, "got": got[pos : pos + 4], "want": want[pos : pos + 4]})
    return out


# ---- the systems: each is ids -> generated ids -------------------------------------------------------------
def hf_systems(
    model_dir: Path,
    draft_dir: Path,
    names: list[str],
    max_tokens: int,
    num_draft_tokens: int,
    prompt_lookup_num_tokens: int,
) -> dict[str, Callable[[list[int]], list[int]]]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    kwargs: dict[str, dict] = {"hf": {}, "hf_prompt_lookup": {"prompt_lookup_num_tokens": prompt_lookup_num_tokens}}
    if "hf_assisted" in names:
        draft = AutoModelForCausalLM.from_pretrained(str(draft_dir), dtype=torch.float32).eval()
        draft.generation_config.num_assistant_tokens_schedule = "heuristic"
        if num_draft_tokens:
            draft.generation_config.num_assistant_tokens = num_draft_tokens
        kwargs["hf_assisted"] = {"assistant_model": draft}

    def make(kw: dict) -> Callable[[list[int]], list[int]]:
        def generate(ids: list[int]) -> list[int]:
            x = torch.tensor([ids])
            with torch.inference_mode():
                out = target.generate(
                    x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=max_tokens, **kw
                )
            return out[0, len(ids) :].tolist()

        return generate

    return {n: make(kwargs[n]) for n in names if n in HF_SYSTEMS}


def lightspec_systems(
    model_dir: Path, names: list[str], max_tokens: int, policy: str, num_draft_tokens: int
) -> dict[str, Callable[[list[int]], list[int]]]:
    from lightspec_core import EngineConfig, LLMEngine, SamplingParams

    out = {}
    for name in names:
        if name not in LIGHTSPEC_SYSTEMS:
            continue
        method = name.removeprefix("lightspec_")
        cfg = EngineConfig(
            model_dir=str(model_dir),
            speculation=method,
            policy="off" if method == "none" else policy,
            max_draft_tokens=max(num_draft_tokens, _static_k(policy)),
        )
        engine = LLMEngine(cfg)

        def generate(ids: list[int], engine=engine) -> list[int]:
            return engine.generate([ids], SamplingParams(max_tokens=max_tokens))[0].output_token_ids

        out[name] = generate
    return out


def _static_k(policy: str) -> int:
    return int(policy.split(":")[1]) if policy.startswith("static:") else 0


def run_system(name: str, generate: Callable[[list[int]], list[int]], prompts: list[list[int]]) -> SystemResult:
    generate(prompts[0][:8])  # warm-up: first-call allocations, kernel selection
    result = SystemResult(name)
    for ids in prompts:
        t0 = time.perf_counter()
        result.outputs.append(generate(ids))
        result.seconds += time.perf_counter() - t0
    return result


def compare(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_tokens: int,
    systems: list[str] | None = None,
    policy: str = "dynamic",
    num_draft_tokens: int = 4,
    prompt_lookup_num_tokens: int | None = None,
    draft_dir: str | Path | None = None,
    log=print,
) -> dict[str, SystemResult]:
    """Run every system on every prompt (token ids); returns the results by system name."""
    systems = list(systems or (*HF_SYSTEMS, *LIGHTSPEC_SYSTEMS))
    if REFERENCE not in systems:
        systems.insert(0, REFERENCE)
    model_dir = Path(model_dir)
    draft_dir = Path(draft_dir) if draft_dir else model_dir.parent / "draft"
    fns = {
        **hf_systems(
            model_dir, draft_dir, systems, max_tokens, num_draft_tokens, prompt_lookup_num_tokens or num_draft_tokens
        ),
        **lightspec_systems(model_dir, systems, max_tokens, policy, num_draft_tokens),
    }
    results = {}
    for name in systems:
        results[name] = r = run_system(name, fns[name], prompts)
        log(f"  {name:<18} {r.tokens:6d} tokens in {r.seconds:7.2f}s  {r.tokens_per_s:8.1f} tok/s")
    return results


def report(results: dict[str, SystemResult]) -> tuple[str, dict]:
    """The printed table and the JSON document."""
    ref = results[REFERENCE]
    doc: dict = {"systems": {}, "pairs": []}
    lines = [f"{'system':<18} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'x hf':>6}  mismatches vs hf", "-" * 70]
    for name, r in results.items():
        bad = mismatches(r, ref)
        x = r.tokens_per_s / ref.tokens_per_s if ref.tokens_per_s else 0.0
        where = ", ".join(f"prompt {m['prompt']} at token {m['position']}" for m in bad[:3])
        lines.append(
            f"{name:<18} {r.tokens:7d} {r.seconds:8.2f} {r.tokens_per_s:8.1f} {x:5.2f}x  "
            f"{len(bad)}/{len(r.outputs)}" + (f" ({where}{', ...' if len(bad) > 3 else ''})" if bad else "")
        )
        doc["systems"][name] = {
            "tokens": r.tokens,
            "seconds": r.seconds,
            "tokens_per_s": r.tokens_per_s,
            "ratio_vs_hf": x,
            "mismatches": bad,
        }
    lines.append("")
    for ours, theirs in PAIRS:
        if ours in results and theirs in results and results[theirs].tokens_per_s:
            ratio = results[ours].tokens_per_s / results[theirs].tokens_per_s
            lines.append(f"{ours} / {theirs}: {ratio:.2f}x tokens/s")
            doc["pairs"].append({"lightspec": ours, "hf": theirs, "tokens_per_s_ratio": ratio})
    return "\n".join(lines), doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python tools/compare_hf.py", description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", help="target checkpoint, HF layout (default: the embedded model); draft: sibling")
    p.add_argument("--draft-dir", help="draft checkpoint (default: the sibling draft/ of --model-dir)")
    p.add_argument("--systems", nargs="+", help=f"default: {' '.join(HF_SYSTEMS + LIGHTSPEC_SYSTEMS)}")
    p.add_argument("--prompts", help="JSON lines with a 'prompt' field (default: held-out stdlib code)")
    p.add_argument("--workload", choices=("code", "mixed"), default="code")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=200, help="max tokens of a default prompt")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--policy", default="dynamic", help="LightSpec policy: dynamic | static:K")
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        help="LightSpec max_draft_tokens; HF assistant's initial num_assistant_tokens (0: HF default)",
    )
    p.add_argument(
        "--prompt-lookup-num-tokens", type=int, help="HF prompt_lookup_num_tokens (default: --num-draft-tokens)"
    )
    # Batch 1 of a small model gains nothing from intra-op threads, and torch's default (one per core)
    # collapses when anything else runs on the machine (spinning OpenMP workers; docs/serving.md, num_threads).
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; 0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--strict", action="store_true", help="exit 1 when an output differs from hf's")
    p.add_argument("--json", help="write the results here")
    return p


def main(argv: list[str] | None = None) -> int:
    import torch

    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        return _main(args, argv)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting


def _main(args, argv: list[str] | None) -> int:
    from lightspec_backend.bench.workload import default_prompts, load_tokenizer, read_prompts

    from lightspec_core import default_model_dir
    from lightspec_core.models.tokenizer import TokenizerInfo

    model_dir = Path(args.model_dir or default_model_dir())
    systems = [s for v in args.systems or [] for s in v.replace(",", " ").split()] or None
    unknown = sorted(set(systems or []) - set(HF_SYSTEMS + LIGHTSPEC_SYSTEMS))
    if unknown:
        raise SystemExit(f"--systems {unknown[0]!r}: expected some of {' '.join(HF_SYSTEMS + LIGHTSPEC_SYSTEMS)}")
    if args.prompts:
        texts = [p.text for p in read_prompts(args.prompts)]
    else:
        texts = [
            p.text
            for p in default_prompts(
                args.num_prompts, load_tokenizer(model_dir), args.prompt_tokens, args.workload, args.seed
            )
        ]
    tok = TokenizerInfo.from_dir(model_dir)
    prompts = [tok.encode(t) for t in texts]
    print(f"{len(prompts)} prompts, up to {args.max_tokens} tokens each, greedy, batch 1 ({model_dir})")
    results = compare(
        model_dir,
        prompts,
        args.max_tokens,
        systems,
        args.policy,
        args.num_draft_tokens,
        args.prompt_lookup_num_tokens,
        args.draft_dir,
    )
    table, doc = report(results)
    print()
    print(table)
    if args.json:
        doc["meta"] = {
            "argv": sys.argv[1:] if argv is None else argv,
            "model_dir": str(model_dir),
            "prompts": len(prompts),
            "max_tokens": args.max_tokens,
            "policy": args.policy,
        }
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.json}")
    bad = any(s["mismatches"] for s in doc["systems"].values())
    return 1 if bad and args.strict else 0


if __name__ == "__main__":
    sys.exit(main())
