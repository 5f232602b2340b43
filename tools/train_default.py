"""Train the embedded default model family from the running interpreter's standard library.

    python tools/train_default.py --out lightspec_core/default_model        # full run (~60 min, 2 cores)
    python tools/train_default.py --out /tmp/m --smoke                      # seconds; used by the tests
    python tools/train_default.py --out OUT --heads-from DIR --mtp-minutes 40   # more MTP head training only
    python tools/train_default.py --out OUT --heads-from DIR --greedy-data 1024  # ... half on the target's own continuations

Produces ``OUT/target`` (Llama checkpoint, HF layout + tokenizer.json), ``OUT/mtp`` (K MTP heads trained
with the target frozen, distilled from the target's own next-token distributions, which is what
verification accepts against, plus ``draft_vocab.json``, the 1024 most frequent training token ids
the heads propose from and their loss is over, as ``lightspec train-heads``'s), ``OUT/draft`` (a
1-layer Llama with the same tokenizer) and
``OUT/train_report.json`` (sizes, times, held-out loss and per-head greedy acceptance).

Data: every ``*.py`` under ``sysconfig.get_paths()["stdlib"]`` except ``site-packages``; files with a
path component named ``test`` are held out for validation.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from lightspec_core.corpus import stdlib_files
from lightspec_core.models.llama import LlamaConfig, LlamaModel, num_params
from lightspec_core.models.mtp_heads import MTPConfig, MTPHeads
from lightspec_core.training.data import batches, encode_documents, frequent_tokens, read_documents
from lightspec_core.training.distill import cosine_lr, greedy_windows, mtp_chain_logits
from lightspec_core.training.evaluate import chain_acceptance
from lightspec_core.training.loop import Budget, DistillConfig, HeadTrainer, run_training

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def encode_corpus(tok, texts: list[str]) -> torch.Tensor:
    return encode_documents(tok, texts, tok.token_to_id("</s>"))


def train_lm(model: LlamaModel, data, batch, seq, minutes, lr, max_steps, log, seed):
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    t0, step, it = time.time(), 0, batches(data, batch, seq, gen)
    model.train()
    while True:
        frac = max((time.time() - t0) / (minutes * 60), step / max_steps)
        if frac >= 1.0:
            break
        for g in opt.param_groups:
            g["lr"] = cosine_lr(frac, lr)
        x = next(it)
        hid = model.forward_train(x[:, :-1])
        loss = F.cross_entropy(model.lm_head(hid).flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 50 == 0:
            log(f"  step {step} loss {loss.item():.3f} frac {frac:.2f} {time.time() - t0:.0f}s")
    model.eval()
    return step, time.time() - t0


def train_mtp(mtp, target, data, batch, seq, minutes, lr, max_steps, log, seed, generated=None, share=0.5):
    """``generated`` (optional, [n, seq] windows from ``greedy_windows``): that share of every
    batch is drawn from them instead of the text. The loss is over the heads' draft vocabulary,
    the ids serving proposes from (all ids without one). Returns (steps, seconds)."""
    vocab = torch.tensor(mtp.draft_vocab) if mtp.draft_vocab else None
    trainer = HeadTrainer(mtp, target, data, DistillConfig(batch, seq, lr, share, seed), generated, vocab)

    def on_step(p, frac: float) -> None:
        if p.step % 50 == 0:
            log(f"  mtp step {p.step} loss {p.loss:.3f} frac {frac:.2f} {p.elapsed:.0f}s")

    progress, _ = run_training(trainer, Budget(minutes, max_steps), on_step=on_step)
    return progress.step, progress.train_seconds


def train_mtp_preset(mtp, target, data, pr: dict, lr: float, log, seed: int, generated=None, share: float = 0.5):
    """:func:`train_mtp` with the preset's batch (half the language models'), window, minutes and step cap."""
    batch, seq, minutes, max_steps = pr["batch"] // 2, pr["seq"], pr["mtp_min"], pr["steps"]
    return train_mtp(mtp, target, data, batch, seq, minutes, lr, max_steps, log, seed, generated, share)


@torch.no_grad()
def evaluate(target, mtp, draft, valid, seq, n_batches, seed):
    """Held-out loss of target and draft; per-head greedy acceptance: head i's top-1 equals the
    target's greedy token at the same position (teacher forced on held-out text)."""
    gen = torch.Generator().manual_seed(seed)
    it = batches(valid, 8, seq, gen)
    tl = dl = 0.0
    agree = [0.0] * mtp.config.num_heads
    draft_agree = 0.0
    vocab = torch.tensor(mtp.draft_vocab) if mtp.draft_vocab else None
    for _ in range(n_batches):
        x = next(it)
        inp, lab = x[:, :-1], x[:, 1:]
        hid = target.forward_train(inp)
        tlog = target.lm_head(hid)
        tl += F.cross_entropy(tlog.flatten(0, 1), lab.flatten()).item()
        dlog = draft.lm_head(draft.forward_train(inp))
        dl += F.cross_entropy(dlog.flatten(0, 1), lab.flatten()).item()
        greedy = tlog.argmax(-1)
        draft_agree += (dlog.argmax(-1) == greedy).float().mean().item()
        for i, lg in enumerate(mtp_chain_logits(mtp, target, hid, inp, vocab), start=1):
            pick = lg.argmax(-1) if vocab is None else vocab[lg.argmax(-1)]  # the ids serving would propose
            agree[i - 1] += (pick == greedy[:, i:]).float().mean().item()
    return {
        "target_val_loss": round(tl / n_batches, 4),
        "draft_val_loss": round(dl / n_batches, 4),
        "draft_greedy_agreement": round(draft_agree / n_batches, 4),
        "mtp_head_greedy_acceptance": [round(a / n_batches, 4) for a in agree],
    }


def write_tokenizer(tok, d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": 1024,
            },
            indent=2,
        )
        + "\n"
    )
    (d / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2) + "\n"
    )


PRESETS = {
    "full": {
        "vocab": 4096,
        "target": {
            "hidden_size": 256,
            "intermediate_size": 704,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
        },
        "draft": {
            "hidden_size": 128,
            "intermediate_size": 352,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "mtp_inter": 512,
        "seq": 256,
        "batch": 32,
        "target_min": 40.0,
        "mtp_min": 12.0,
        "draft_min": 6.0,
        "steps": 10**9,
        "max_files": None,
        "eval_batches": 20,
        "draft_vocab": 1024,
    },
    "smoke": {
        "vocab": 512,
        "target": {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        "draft": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
        },
        "mtp_inter": 64,
        "seq": 64,
        "batch": 4,
        "target_min": 1.0,
        "mtp_min": 0.5,
        "draft_min": 0.5,
        "steps": 20,
        "max_files": 60,
        "eval_batches": 2,
        "draft_vocab": 256,
    },
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python tools/train_default.py", description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--smoke", action="store_true", help="tiny model, a few steps (for tests)")
    ap.add_argument("--target-minutes", type=float)
    ap.add_argument("--mtp-minutes", type=float)
    ap.add_argument("--draft-minutes", type=float)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, help="MTP draft vocabulary: most frequent ids (0: all; default 1024)")
    ap.add_argument(
        "--heads-from",
        type=Path,
        metavar="DIR",
        help="keep DIR's target, tokenizer, draft model and draft vocabulary; continue training its "
        "MTP heads for --mtp-minutes and write the family to --out",
    )
    ap.add_argument(
        "--mtp-lr", type=float, help="peak learning rate of the heads (default 2e-3, 1e-3 with --heads-from)"
    )
    ap.add_argument(
        "--greedy-data",
        type=int,
        default=0,
        metavar="N",
        help="with --heads-from: generate N greedy continuations of training text with the target "
        "(half a window of prompt, half of continuation) and draw --greedy-share of every batch "
        "from them; 0: text only",
    )
    ap.add_argument(
        "--greedy-share", type=float, default=0.5, help="share of each batch from --greedy-data (default 0.5)"
    )
    return ap


def preset(a: argparse.Namespace) -> dict:
    """The preset of ``--smoke`` or the full run, with the command line's overrides."""
    pr = dict(PRESETS["smoke" if a.smoke else "full"])
    if a.draft_vocab is not None:
        pr["draft_vocab"] = a.draft_vocab
    for key, name in (("target_min", "target_minutes"), ("mtp_min", "mtp_minutes"), ("draft_min", "draft_minutes")):
        if getattr(a, name) is not None:
            pr[key] = getattr(a, name)
    return pr


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    a = ap.parse_args(argv)
    if a.greedy_data and a.heads_from is None:
        ap.error("--greedy-data: only with --heads-from (the continuations come from a trained target)")
    if a.greedy_data < 0:
        ap.error(f"--greedy-data {a.greedy_data}: must be >= 0")
    pr = preset(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    t_start = time.time()

    def log(msg: str) -> None:
        print(f"[{time.time() - t_start:7.1f}s] {msg}", flush=True)

    if a.heads_from is not None:
        return continue_heads(a, pr, log, t_start)
    return train_family(a, pr, log, t_start)


def train_family(a: argparse.Namespace, pr: dict, log, t_start: float) -> dict:
    """Tokenizer, target, MTP heads and draft model from scratch; writes them and the report to ``a.out``."""
    train_files, valid_files = corpus_files(pr["max_files"])
    train_texts, valid_texts = read_documents(train_files), read_documents(valid_files)
    log(f"{len(train_texts)} train files, {len(valid_texts)} held-out files")
    tok = train_tokenizer(train_texts, pr["vocab"])
    train_data, valid_data = encode_corpus(tok, train_texts), encode_corpus(tok, valid_texts)
    log(f"tokenizer vocab {tok.get_vocab_size()}; {len(train_data)} train / {len(valid_data)} held-out tokens")

    vocab = tok.get_vocab_size()
    tcfg = LlamaConfig(vocab_size=vocab, **pr["target"])
    target = LlamaModel(tcfg)
    log(f"target: {num_params(target)} params")
    t_steps, t_time = train_lm(
        target, train_data, pr["batch"], pr["seq"], pr["target_min"], 2e-3, pr["steps"], log, a.seed
    )

    draft_vocab = frequent_tokens(train_data, vocab, pr["draft_vocab"]) if 0 < pr["draft_vocab"] < vocab else None
    mtp_cfg = MTPConfig(num_heads=a.num_heads, hidden_size=tcfg.hidden_size, intermediate_size=pr["mtp_inter"])
    mtp = MTPHeads(mtp_cfg, draft_vocab)
    log(f"mtp heads: {num_params(mtp)} params")
    m_steps, m_time = train_mtp_preset(mtp, target, train_data, pr, a.mtp_lr or 2e-3, log, a.seed + 1)

    draft = LlamaModel(LlamaConfig(vocab_size=vocab, **pr["draft"]))
    log(f"draft: {num_params(draft)} params")
    d_steps, d_time = train_lm(
        draft, train_data, pr["batch"], pr["seq"], pr["draft_min"], 3e-3, pr["steps"], log, a.seed + 2
    )

    save_family(a.out, tok, target, mtp, draft)
    report = {
        "python": sysconfig.get_python_version(),
        "train_files": len(train_texts),
        "heldout_files": len(valid_texts),
        "train_tokens": len(train_data),
        "heldout_tokens": len(valid_data),
        "vocab_size": vocab,
        "target_params": num_params(target),
        "mtp_params": num_params(mtp),
        "draft_params": num_params(draft),
        "target_steps": t_steps,
        "mtp_steps": m_steps,
        "draft_steps": d_steps,
        "train_seconds": {"target": round(t_time), "mtp": round(m_time), "draft": round(d_time)},
        "seq_len": pr["seq"],
        "batch": pr["batch"],
    }
    report.update(evaluate(target, mtp, draft, valid_data, pr["seq"], pr["eval_batches"], a.seed + 3))
    report["total_seconds"] = round(time.time() - t_start)
    (a.out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report))
    return report


def save_family(out: Path, tok, target: LlamaModel, mtp: MTPHeads, draft: LlamaModel) -> None:
    """``out/target``, ``out/mtp`` and ``out/draft``, replacing whatever ``out`` held."""
    if out.exists():
        shutil.rmtree(out)
    target.save(out / "target")
    write_tokenizer(tok, out / "target")
    mtp.save(out / "mtp")
    draft.save(out / "draft")
    write_tokenizer(tok, out / "draft")


def corpus_files(max_files: int | None):
    """The training and held-out standard-library files, the first ``max_files`` (half as many held out)."""
    train_files, valid_files = stdlib_files()
    if max_files:
        train_files, valid_files = train_files[:max_files], valid_files[: max_files // 2]
    return train_files, valid_files


def load_corpus(tok_dir: Path, max_files: int | None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    train_files, valid_files = corpus_files(max_files)
    return encode_corpus(tok, read_documents(train_files)), encode_corpus(tok, read_documents(valid_files))


def continue_heads(a, pr: dict, log, t_start: float) -> dict:
    """Further MTP head training on a finished family: the target, tokenizer, draft model and draft
    vocabulary stay as they are (so earlier measurements of them still hold); the heads start from
    DIR's weights. The report keeps DIR's fields and adds the heads' agreement before and after."""
    src: Path = a.heads_from
    train_data, valid_data = load_corpus(src / "target", pr["max_files"])
    target, draft, mtp = LlamaModel.load(src / "target"), LlamaModel.load(src / "draft"), MTPHeads.load(src / "mtp")
    report = json.loads((src / "train_report.json").read_text()) if (src / "train_report.json").exists() else {}
    if not 0.0 <= a.greedy_share <= 1.0:
        raise SystemExit(f"--greedy-share {a.greedy_share}: must be in [0, 1]")
    seq, half = pr["seq"], pr["seq"] // 2
    # held-out continuations to judge the heads on, as serving uses them (before and after alike)
    valid_gen = greedy_windows(src / "target", valid_data, pr["eval_batches"] * 4, half, half, a.seed + 5)
    before = evaluate(target, mtp, draft, valid_data, seq, pr["eval_batches"], a.seed + 3)
    before.update(chain_acceptance(target, mtp, valid_gen, half))
    log(f"heads before: {before['mtp_head_greedy_acceptance']}, chain on continuations {before['mtp_chain_accepted']}")
    generated = None
    if a.greedy_data:
        t0 = time.time()
        generated = greedy_windows(src / "target", train_data, a.greedy_data, half, half, a.seed + 7)
        log(f"{len(generated)} greedy continuations of training text in {time.time() - t0:.0f}s")
    steps, secs = train_mtp_preset(
        mtp, target, train_data, pr, a.mtp_lr or 1e-3, log, a.seed + 11, generated, a.greedy_share
    )
    after = evaluate(target, mtp, draft, valid_data, seq, pr["eval_batches"], a.seed + 3)
    after.update(chain_acceptance(target, mtp, valid_gen, half))
    log(f"heads after: {after['mtp_head_greedy_acceptance']}, chain on continuations {after['mtp_chain_accepted']}")
    out: Path = a.out
    if out.resolve() != src.resolve():
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(src, out)
    mtp.save(out / "mtp")
    if "mtp_continued" in report:  # an earlier continuation: keep its record
        earlier = dict(report.pop("mtp_continued"))
        earlier["mtp_head_greedy_acceptance_before"] = report.pop("mtp_head_greedy_acceptance_before_continued", None)
        report.setdefault("mtp_continued_earlier", []).append(earlier)
    report["mtp_head_greedy_acceptance_before_continued"] = before["mtp_head_greedy_acceptance"]
    report["mtp_head_greedy_acceptance"] = after["mtp_head_greedy_acceptance"]
    report["mtp_continued"] = {
        "steps": steps,
        "seconds": round(secs),
        "peak_lr": a.mtp_lr or 1e-3,
        "greedy_continuations": a.greedy_data,
        "greedy_share": a.greedy_share if a.greedy_data else 0.0,
        "heldout_continuations": len(valid_gen),
        "before": {k: before[k] for k in ("mtp_head_greedy_continuation_agreement", "mtp_chain_accepted")},
        "after": {k: after[k] for k in ("mtp_head_greedy_continuation_agreement", "mtp_chain_accepted")},
    }
    report["mtp_steps"] = report.get("mtp_steps", 0) + steps
    (out / "train_report.json").write_text(json.dumps(report, indent=2) + "\n")
    log(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
