"""One ``train-heads`` run: check the input, prepare the data and the target's continuations, train
under the budget with checkpoints, evaluate and write the heads (see :mod:`.train_heads`)."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..models.llama import LlamaConfig, LlamaModel
from ..models.mtp_heads import MTPConfig, MTPHeads
from .checkpoint import (
    CHECKPOINT,
    fit_differences,
    load_checkpoint,
    save_checkpoint,
    target_differences,
    target_identity,
)
from .data import (
    batches,
    encode_documents,
    find_files,
    frequent_tokens,
    read_documents,
    serving_prefix,
    split_documents,
)
from .distill import greedy_windows
from .evaluate import chain_acceptance, head_acceptance
from .loop import Budget, Clock, DistillConfig, HeadTrainer, Progress, run_training


class UsageError(ValueError):
    """Bad input to the command; the message names the option."""


# The settings a checkpoint fixes: name -> (type, help). None on the command line: the default
# (see ``resolve_settings``) or, resuming, the checkpoint's value.
SETTINGS_HELP = {
    "heads": (int, "number of MTP heads K (default 4)"),
    "draft_vocab": (int, "the N most frequent token ids the heads propose from (default 1024; 0: all)"),
    "intermediate_size": (int, "the heads' MLP width (default twice the target's hidden size)"),
    "seq": (int, "training window in tokens (default 256, at most the model's context)"),
    "batch": (int, "windows per step (default 16)"),
    "lr": (float, "peak learning rate (default 2e-3)"),
    "share": (float, "share of each batch from the target's greedy continuations (default 0.5)"),
    "continuations": (int, "greedy continuations to generate (default 2048, at most a tenth of --minutes)"),
    "seed": (int, "seed of the heads' initialisation, the data order and the prompts (default 0)"),
}


def default_settings(cfg: LlamaConfig) -> dict:
    seq = min(256, cfg.max_position_embeddings, cfg.sliding_window or 256)  # see check_context
    return {"heads": 4, "draft_vocab": min(1024, cfg.vocab_size), "intermediate_size": 2 * cfg.hidden_size,
            "seq": seq, "batch": 16, "lr": 2e-3, "share": 0.5,
            "continuations": 2048, "seed": 0}  # fmt: skip


def resolve_settings(args: argparse.Namespace, defaults: dict, saved: dict | None) -> dict:
    """The run's settings: the command line's, else the checkpoint's (resuming), else the
    defaults. A resumed run cannot change one: its heads and data order were made with it."""
    out = {}
    for name, default in defaults.items():
        given = getattr(args, name)
        if saved is not None and given is not None and given != saved[name]:
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} {given}: the checkpoint in --out was trained with {flag} {saved[name]}")
        out[name] = given if given is not None else saved[name] if saved is not None else default
    check_settings(out)
    return out


def check_settings(s: dict) -> None:
    rules = [("heads", s["heads"] >= 1, "must be >= 1"), ("draft_vocab", s["draft_vocab"] >= 0, "must be >= 0"),
             ("intermediate_size", s["intermediate_size"] >= 1, "must be >= 1"),
             # the evaluation drafts from a window's middle, with every head inside the window
             ("seq", s["seq"] >= 2 * s["heads"] + 1, f"must be >= 2 * heads + 1 = {2 * s['heads'] + 1}"),
             ("batch", s["batch"] >= 1, "must be >= 1"), ("lr", s["lr"] > 0, "must be > 0"),
             ("share", 0.0 <= s["share"] <= 1.0, "must be in [0, 1]"),
             ("continuations", s["continuations"] >= 0, "must be >= 0")]  # fmt: skip
    for name, ok, why in rules:
        if not ok:
            raise UsageError(f"--{name.replace('_', '-')} {s[name]}: {why}")


def check_context(seq: int, cfg: LlamaConfig) -> None:
    """Windows of ``seq`` tokens, the longest training and its continuations use, must be ones the
    model computes exactly: within its positions, its attention window and its rope scaling."""
    for name, limit in (
        ("max_position_embeddings", cfg.max_position_embeddings),
        ("sliding_window", cfg.sliding_window),
    ):
        if limit is not None and seq > limit:
            raise UsageError(f"--seq {seq}: must be <= the model's {name} {limit}")
    try:
        cfg.check_context(seq)  # anything else that limits it (rope scaling), named by the config
    except ValueError as e:
        raise UsageError(f"--seq {seq}: {e}") from None


def read_target(model_dir: Path):
    """(target config, tokenizer), or a ``UsageError`` naming ``--model``. The tokenizer is checked
    against config.json before any weight is read: ids past the embedding would fail mid-run."""
    from tokenizers import Tokenizer

    for name in ("config.json", "tokenizer.json"):
        if not (model_dir / name).is_file():
            raise UsageError(f"--model {model_dir}: no {name} (expected a Hugging Face checkpoint directory)")
    try:
        cfg = LlamaConfig.from_dir(model_dir)
    except (ValueError, OSError) as e:  # the config parser names the field it refuses
        raise UsageError(f"--model {model_dir}: {e}") from None
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if (n := tok.get_vocab_size(with_added_tokens=True)) > cfg.vocab_size:
        raise UsageError(f"--model {model_dir}: tokenizer.json has {n} tokens, more than the model's "
                         f"vocab_size {cfg.vocab_size}")  # fmt: skip
    return cfg, tok


def load_target(model_dir: Path, seq: int, device: str) -> LlamaModel:
    """The target's weights for windows of at most ``seq`` tokens (see :func:`check_context`), or a
    ``UsageError`` naming ``--model``."""
    try:
        target = LlamaModel.load(model_dir, max_context=seq)
    except (ValueError, OSError, RuntimeError) as e:  # missing, unexpected or misshapen weights
        raise UsageError(f"--model {model_dir}: {e}") from None
    return target.to(device)


@dataclass
class Corpus:
    """The user's text as token ids: ``train`` [N] and ``heldout`` [M] (int32), and ``prefix``, the
    ids serving puts before a prompt (its BOS), which every window of them starts with."""

    train: torch.Tensor
    heldout: torch.Tensor
    files: int
    train_documents: int
    heldout_documents: int
    prefix: tuple[int, ...] = ()

    def sizes(self) -> dict:
        return {"files": self.files, "train_documents": self.train_documents,
                "heldout_documents": self.heldout_documents, "train_tokens": len(self.train),
                "heldout_tokens": len(self.heldout)}  # fmt: skip


def load_corpus(paths: list[str], tok, eos_id: int | None, seq: int, heads: int) -> Corpus:
    try:
        files = find_files(paths)
        train_docs, held_docs = split_documents(read_documents(files))
    except ValueError as e:
        raise UsageError(str(e)) from None
    corpus = Corpus(encode_documents(tok, train_docs, eos_id), encode_documents(tok, held_docs, eos_id),
                    len(files), len(train_docs), len(held_docs), tuple(serving_prefix(tok)))  # fmt: skip
    if len(corpus.train) < seq + 2:
        raise UsageError(f"--data: {len(corpus.train)} tokens of training text, --seq {seq} needs {seq + 2}")
    if len(corpus.heldout) < 2 * heads + 2:  # a window of 2 * heads + 1 tokens and the token after it
        raise UsageError(f"--data: {len(corpus.heldout)} held-out tokens, too few to evaluate {heads} heads "
                         f"(they need {2 * heads + 2})")  # fmt: skip
    return corpus


@contextmanager
def stop_on_signals():
    """Yields ``should_stop()``: true once SIGINT or SIGTERM arrived, so the loop ends between
    steps and the checkpoint is whole. A second signal interrupts at once."""
    flag = threading.Event()
    if threading.current_thread() is not threading.main_thread():  # handlers only install there
        yield flag.is_set
        return

    def handler(signum, frame):
        if flag.is_set():
            raise KeyboardInterrupt
        flag.set()
        print(f"\n{signal.Signals(signum).name}: stopping after this step", file=sys.stderr)

    previous = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield flag.is_set
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def progress_bar(budget: Budget, progress: Progress, clock: Clock, enabled: bool):
    """A tqdm bar over the budget (per mille), with the ETA and the step's loss; on stderr."""
    from tqdm import tqdm

    def done() -> int:
        return round(1000 * min(1.0, budget.fraction(progress.step, progress.train_seconds, clock())))

    bar = tqdm(total=1000, initial=done(), disable=not enabled, file=sys.stderr, dynamic_ncols=True,
               bar_format="train-heads {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")  # fmt: skip

    def on_step(p: Progress, frac: float) -> None:
        bar.set_postfix_str(f"step {p.step} loss {p.loss:.3f}", refresh=False)
        bar.update(done() - bar.n)

    return bar, on_step


def check_arguments(args: argparse.Namespace) -> Budget:
    """The run's budget, once the options a checkpoint does not keep are checked."""
    try:
        budget = Budget(args.minutes, args.steps)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.eval_windows < 1:
        raise UsageError(f"--eval-windows {args.eval_windows}: must be >= 1")
    return budget


def run(args: argparse.Namespace) -> dict | None:
    """The whole run; returns the evaluation (also written to ``OUT/eval.json``), or None when a
    signal stopped it (``OUT/checkpoint.pt`` then holds it)."""
    budget = check_arguments(args)
    saved = _previous_run(args.out, args.resume)
    clock = Clock(saved["progress"]["elapsed"] if saved else 0.0)
    target_cfg, tok = read_target(args.model)
    identity = identify_target(args.model, target_cfg, tok)
    check_resumed_target(args, saved, identity, target_cfg)
    s = resolve_settings(args, default_settings(target_cfg), saved["settings"] if saved else None)
    check_context(s["seq"], target_cfg)
    target = load_target(args.model, s["seq"], args.device)
    corpus = load_corpus(args.data, tok, target.config.eos_token_id, s["seq"], s["heads"])
    if saved and saved["data"]["train_tokens"] != len(corpus.train):
        raise UsageError(f"--data: {len(corpus.train)} training tokens, the checkpoint's run had "
                         f"{saved['data']['train_tokens']}: resume with the same --data")  # fmt: skip
    say(args, "{files} files: {train_tokens} training tokens ({train_documents} documents), {heldout_tokens} "
        "held out ({heldout_documents})".format(**corpus.sizes()))  # fmt: skip
    torch.manual_seed(s["seed"])
    mtp = new_heads(target, s, corpus, saved)
    generated, held = saved_or_generated(args, s, corpus, budget, saved)
    vocab = torch.tensor(mtp.draft_vocab, device=args.device) if mtp.draft_vocab else None
    cfg = DistillConfig(batch=s["batch"], seq=s["seq"], lr=s["lr"], share=s["share"], seed=s["seed"],
                        prefix=corpus.prefix)  # fmt: skip
    trainer = HeadTrainer(mtp, target, corpus.train, cfg, generated, vocab)
    progress = Progress(**saved["progress"]) if saved else Progress()
    if saved:
        trainer.load_state_dict(saved["trainer"])
        torch.set_rng_state(saved["torch_rng"])

    def checkpoint(p: Progress) -> None:
        save_checkpoint(args.out, {"settings": s, "progress": asdict(p), "trainer": trainer.state_dict(),
                                   "torch_rng": torch.get_rng_state(), "draft_vocab": mtp.draft_vocab,
                                   "generated": generated, "heldout_windows": held, "data": corpus.sizes(),
                                   "target": identity})  # fmt: skip

    bar, on_step = progress_bar(budget, progress, clock, not args.quiet)
    with stop_on_signals() as should_stop, bar:
        progress, finished = run_training(trainer, budget, progress, clock, checkpoint=checkpoint,
                                          checkpoint_seconds=60 * args.checkpoint_minutes,
                                          should_stop=should_stop, on_step=on_step)  # fmt: skip
    if not finished:
        return None
    return finish(args, target, mtp, corpus, held, s, progress, generated)


def say(args: argparse.Namespace, msg: str) -> None:
    if not args.quiet:
        print(f"train-heads: {msg}", file=sys.stderr, flush=True)


def _previous_run(out: Path, resume: bool) -> dict | None:
    if resume:
        if not (out / CHECKPOINT).is_file():
            raise UsageError(f"--resume: no {CHECKPOINT} in --out {out}")
        try:
            return load_checkpoint(out)
        except (ValueError, RuntimeError, OSError) as e:
            raise UsageError(f"--resume: {e}") from None
    if (out / CHECKPOINT).exists():
        raise UsageError(f"--out {out}: holds the {CHECKPOINT} of an earlier run; add --resume to continue "
                         "it, or choose another --out")  # fmt: skip
    return None


def identify_target(model_dir: Path, cfg: LlamaConfig, tok) -> dict:
    """:func:`.checkpoint.target_identity`, or a ``UsageError`` naming ``--model`` (no weights)."""
    try:
        return target_identity(model_dir, cfg, tok)
    except OSError as e:
        raise UsageError(f"--model {model_dir}: {e}") from None


def check_resumed_target(args: argparse.Namespace, saved: dict | None, identity: dict, cfg: LlamaConfig) -> None:
    """A resumed run's ``--model`` must be the target its checkpoint trained the heads for: a
    ``UsageError`` names every difference. A checkpoint of format 1 recorded no target: its heads
    need only fit the target's shapes, and the run records ``--model`` from then on."""
    if saved is None:
        return
    if saved["target"] is None:
        diffs, was = fit_differences(saved, cfg), ""
        if not diffs:
            say(args, f"{CHECKPOINT} records no target (an earlier format): resuming on --model's shapes alone")
    else:
        diffs, was = target_differences(saved["target"], identity), f" ({saved['target']['model']})"
    if diffs:
        raise UsageError(f"--resume: the checkpoint in --out was trained for another target{was} than --model "
                         f"{args.model}: {'; '.join(diffs)}")  # fmt: skip


def new_heads(target: LlamaModel, s: dict, corpus: Corpus, saved: dict | None) -> MTPHeads:
    """Freshly initialised heads sized from the target (a resumed run loads its weights later),
    proposing from the draft vocabulary: the checkpoint's, or the training text's most frequent ids."""
    cfg = target.config
    if saved is not None:
        vocab = saved["draft_vocab"]
    elif 0 < s["draft_vocab"] < cfg.vocab_size:
        vocab = frequent_tokens(corpus.train, cfg.vocab_size, s["draft_vocab"])
    else:
        vocab = None
    heads_cfg = MTPConfig(num_heads=s["heads"], hidden_size=cfg.hidden_size,
                          intermediate_size=s["intermediate_size"], rms_norm_eps=cfg.rms_norm_eps)  # fmt: skip
    return MTPHeads(heads_cfg, vocab).to(target.lm_head.weight.device)


def saved_or_generated(args, s: dict, corpus: Corpus, budget: Budget, saved: dict | None):
    """(training continuations [n, seq] or None, held-out continuations [m, L]): the checkpoint's,
    or generated by the target now (a tenth of a time budget at most for the training ones). Saved
    ones that do not start with what serving puts first (a checkpoint of format 1 for a tokenizer
    with a BOS) are generated again: the heads would learn and be judged on hidden states that
    serving never shows them."""
    if saved is not None:
        kept = saved["generated"], saved["heldout_windows"]
        head = torch.tensor(corpus.prefix, dtype=torch.int64)
        if all(w is None or torch.equal(w[:, : len(head)].cpu(), head.expand(len(w), -1)) for w in kept):
            return kept
        say(args, f"the continuations in {CHECKPOINT} do not start with the tokenizer's {head.tolist()} "
                  "(an earlier format): generating them again")  # fmt: skip
    seq, n = s["seq"], s["continuations"] if s["share"] > 0 else 0
    cap = None if budget.minutes is None else 6.0 * budget.minutes
    generated, t0 = None, time.monotonic()
    if n:
        generated = greedy_windows(args.model, corpus.train, n, seq // 2, seq - seq // 2, s["seed"] + 1, cap,
                                   args.device, corpus.prefix)  # fmt: skip
        say(args, f"{len(generated)} greedy continuations of {seq} tokens in {time.monotonic() - t0:.0f}s")
    length = min(seq, len(corpus.heldout) - 1)
    held = greedy_windows(args.model, corpus.heldout, args.eval_windows, length // 2, length - length // 2,
                          s["seed"] + 2, None, args.device, corpus.prefix)  # fmt: skip
    return generated, held


@torch.no_grad()
def finish(args, target, mtp: MTPHeads, corpus: Corpus, held: torch.Tensor, s: dict, progress: Progress,
           generated: torch.Tensor | None) -> dict:  # fmt: skip
    """Write the heads, then evaluate them on held-out text and continuations into eval.json beside
    them (the heads first: a failed evaluation must not lose the budget's training)."""
    mtp.save(args.out)
    length = held.shape[1]
    gen = torch.Generator().manual_seed(s["seed"] + 3)
    text = next(batches(corpus.heldout, args.eval_windows, length - 1, gen, corpus.prefix))
    chain = chain_acceptance(target, mtp, held, length // 2)
    report = {
        "model": str(args.model),
        "heads": s["heads"],
        "hidden_size": mtp.config.hidden_size,
        "intermediate_size": mtp.config.intermediate_size,
        "draft_vocab": len(mtp.draft_vocab) if mtp.draft_vocab else target.config.vocab_size,
        "head_greedy_acceptance": head_acceptance(target, mtp, text),
        "continuation_head_agreement": chain["mtp_head_greedy_continuation_agreement"],
        "chain_accepted": chain["mtp_chain_accepted"],
        "acceptance_length": round(1.0 + chain["mtp_chain_accepted"], 4),
        "steps": progress.step,
        "train_seconds": round(progress.train_seconds, 1),
        "total_seconds": round(progress.elapsed, 1),
        "data": {**corpus.sizes(), "continuations": 0 if generated is None else len(generated),
                 "heldout_continuations": len(held), "heldout_text_windows": len(text), "window": length},
        "settings": s,
    }  # fmt: skip
    (args.out / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    return report
