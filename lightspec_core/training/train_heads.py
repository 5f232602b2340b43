"""lightspec train-heads: MTP heads for a target checkpoint, distilled from the target itself.

    lightspec train-heads --model DIR --data PATH... --out OUT [--minutes M] [--steps N] [--resume]

The target (a Hugging Face directory: config.json, safetensors, tokenizer.json) stays frozen; the
heads learn its next-token distributions on the user's text and, for ``--share`` of every batch, on
its own greedy continuations of that text. ``OUT`` receives the heads (mtp_config.json,
mtp.safetensors, draft_vocab.json: serve them with ``mtp_dir=OUT``), eval.json (the heads on
held-out text) and checkpoint.pt, which ``--resume`` continues from (for the same target only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .run import SETTINGS_HELP, UsageError, run


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="lightspec train-heads", description=__doc__.split("\n")[0].split(": ", 1)[1])
    ap.add_argument("--model", required=True, type=Path, metavar="DIR",
                    help="target checkpoint directory (Hugging Face layout)")  # fmt: skip
    ap.add_argument("--data", required=True, nargs="+", metavar="PATH",
                    help="text files, or directories searched for *.txt, *.py, *.md, *.jsonl ('text' field)")  # fmt: skip
    ap.add_argument(
        "--out", required=True, type=Path, metavar="DIR", help="directory for the heads, eval.json and checkpoint.pt"
    )
    ap.add_argument(
        "--minutes", type=float, metavar="M", help="wall-clock budget of the whole run (resumed parts count)"
    )
    ap.add_argument("--steps", type=int, metavar="N", help="optimiser steps (with --minutes: whichever ends first)")
    ap.add_argument("--resume", action="store_true",
                    help="continue OUT/checkpoint.pt (its settings hold; --model must be the target it trained for)")  # fmt: skip
    for name, (kind, text) in SETTINGS_HELP.items():
        ap.add_argument(f"--{name.replace('_', '-')}", type=kind, metavar="X" if kind is float else "N", help=text)
    ap.add_argument("--eval-windows", type=int, default=64, metavar="N",
                    help="held-out windows of text and of continuations to evaluate on (default 64)")  # fmt: skip
    ap.add_argument("--checkpoint-minutes", type=float, default=5.0, metavar="M",
                    help="minutes between checkpoints (default 5)")  # fmt: skip
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    ap.add_argument("--quiet", action="store_true", help="no progress bar")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 trained and evaluated, 2 bad input (the message names the option), 130
    stopped by a signal after writing checkpoint.pt."""
    args = build_parser().parse_args(argv)
    try:
        report = run(args)
    except UsageError as e:
        print(f"lightspec train-heads: {e}", file=sys.stderr)
        return 2
    if report is None:
        print(f"stopped; {args.out / 'checkpoint.pt'} holds the run: add --resume to continue it", file=sys.stderr)
        return 130
    print(json.dumps(report, indent=2))
    print(f"heads in {args.out} (serve them with mtp_dir={args.out})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
