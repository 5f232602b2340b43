"""The text the heads learn from: files and directories of the user's, read as documents, a
held-out share kept apart for the evaluation, tokenized with the target's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

TEXT_SUFFIXES = (".txt", ".py", ".md", ".jsonl")


def find_files(paths: list[str | Path]) -> list[Path]:
    """``paths`` as files: a file as given, a directory's ``TEXT_SUFFIXES`` files found
    recursively (sorted, so a run sees the same order on every machine). Raises ``ValueError``
    naming ``--data`` for a path that does not exist or when no file is found."""
    files: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file())
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"--data {str(p)!r}: no such file or directory")
    if not files:
        raise ValueError(f"--data {' '.join(map(str, paths))}: no text files ({', '.join(TEXT_SUFFIXES)}) found")
    return files


def read_documents(files: list[Path]) -> list[str]:
    """One document per file, one per line with a string ``"text"`` field for ``*.jsonl``. Files
    that are not UTF-8 text are skipped: a directory of sources often holds a stray binary. Empty
    documents stay: each still ends with an EOS once encoded."""
    docs: list[str] = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        docs += _jsonl_texts(text) if f.suffix == ".jsonl" else [text]
    return docs


def _jsonl_texts(text: str) -> list[str]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("text"), str):
            out.append(record["text"])
    return out


def split_documents(docs: list[str], heldout_share: float = 0.05) -> tuple[list[str], list[str]]:
    """(training, held-out): the last ``heldout_share`` of the documents, at least one, are held
    out; a single document is split in two at a line break (or in the middle), so that a user
    with one file still gets an honest evaluation."""
    if not docs:
        raise ValueError("--data: the files hold no text")
    if len(docs) == 1:
        doc = docs[0]
        cut = doc.rfind("\n", 0, int(len(doc) * (1 - heldout_share)))
        cut = cut if cut > 0 else len(doc) // 2
        return [doc[:cut]], [doc[cut:]]
    n_held = max(1, round(len(docs) * heldout_share))
    return docs[:-n_held], docs[-n_held:]


def encode_documents(tokenizer, docs: list[str], eos_id: int | None) -> torch.Tensor:
    """The documents' token ids back to back [N] (int32), each followed by ``eos_id`` (when the
    model has one), as the target sees the end of a text. No other special tokens: a BOS in the
    middle of a window is not what serving shows the target (windows start with one instead: see
    :func:`serving_prefix`)."""
    ids: list[int] = []
    for enc in tokenizer.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        if eos_id is not None:
            ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.int32)


def serving_prefix(tokenizer) -> list[int]:
    """The ids serving puts before a text prompt: what tokenizer.json's post-processor adds in front
    of a text encoded with ``add_special_tokens`` (the engine's default, as transformers'
    ``tokenizer(text)``). Llama's and Mistral's BOS; none for byte-level tokenizers such as GPT-2's,
    Qwen's and the embedded model's, whose post-processor adds nothing."""
    probe = "a"
    plain = tokenizer.encode(probe, add_special_tokens=False).ids
    full = tokenizer.encode(probe, add_special_tokens=True).ids
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return full[:start]
    return []


def frequent_tokens(ids: torch.Tensor, vocab_size: int, n: int) -> list[int]:
    """The ``n`` most frequent token ids of a corpus, sorted (ties: lower id first)."""
    counts = torch.bincount(ids.to(torch.int64).flatten(), minlength=vocab_size)
    order = torch.sort(-counts, stable=True).indices[:n]
    return sorted(order.tolist())


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator,
            prefix: list[int] | tuple[int, ...] = ()) -> Iterator[torch.Tensor]:  # fmt: skip
    """Endless random windows [batch, seq + 1] (int64) of ``data``; all randomness from ``gen``, so
    restoring its state resumes the same sequence of batches.

    ``prefix`` (:func:`serving_prefix`): the ids each window starts with, followed by
    ``seq + 1 - len(prefix)`` tokens of ``data``. A served prompt is the BOS and then any piece of
    text, so the target's hidden states, which the heads learn from, are the ones serving shows."""
    head = torch.tensor(prefix, dtype=data.dtype)
    n = seq + 1 - len(head)
    assert n > 0, (seq, len(head))
    while True:
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
        yield torch.stack([torch.cat([head, data[s : s + n]]) for s in starts]).long()
