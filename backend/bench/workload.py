"""The prompts a sweep sends: held-out standard-library code, a mixed workload, or a JSON-lines file."""

from __future__ import annotations

import itertools
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from lightspec_core.corpus import stdlib_files


@dataclass
class Prompt:
    text: str
    kind: str = "code"  # code | shuffled | file
    temperature: float | None = None  # None: the run's --temperature


def load_tokenizer(model_dir: str | Path | None):
    """The model's ``tokenizers.Tokenizer`` (for trimming prompts), or ``None``."""
    from tokenizers import Tokenizer

    from lightspec_core import default_model_dir

    path = Path(model_dir or default_model_dir()) / "tokenizer.json"
    return Tokenizer.from_file(str(path)) if path.is_file() else None


def trim(text: str, max_tokens: int, tokenizer, sep: str = "\n") -> str:
    """Drop leading lines (words, for ``sep=" "``) until the text is at most ``max_tokens`` tokens
    (about 3 characters per token when there is no tokenizer)."""

    def length(t: str) -> int:
        return len(tokenizer.encode(t, add_special_tokens=False).ids) if tokenizer else math.ceil(len(t) / 3)

    while length(text) > max_tokens:
        cut = text.find(sep, 1 + len(text) // 10 if length(text) > 2 * max_tokens else 1)
        text = text[cut + 1 :] if cut >= 0 else text[len(text) // 10 + 1 :]
    return text


def _def_window(path: Path, rng: random.Random, max_chars: int) -> str | None:
    """The lines of ``path`` up to a random ``def ...:`` line, at most ``max_chars`` characters
    (at least that line); ``None`` for a file without one or that cannot be read."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except (UnicodeDecodeError, OSError):
        return None
    defs = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ") and line.rstrip().endswith(":")]
    if not defs:
        return None
    end = rng.choice(defs)
    start, size = end, len(lines[end])
    while start > 0 and size + len(lines[start - 1]) <= max_chars:
        start -= 1
        size += len(lines[start])
    return "".join(lines[start : end + 1])


def _code_windows(n: int, seed: int, max_chars: int) -> list[str]:
    """``n`` windows of held-out standard-library code, each ending with a ``def ...:`` line (the
    model continues the function body). Deterministic for a given seed and Python installation."""
    files = list(stdlib_files()[1])
    rng = random.Random(seed)
    rng.shuffle(files)
    passes = 1 + n // max(len(files), 1)  # more passes (other defs) when files are few
    out: list[str] = []
    for path in itertools.chain.from_iterable(itertools.repeat(files, passes)):
        if len(out) == n:
            break
        window = _def_window(path, rng, max_chars)
        if window is not None:
            out.append(window)
    if len(out) < n:
        raise RuntimeError(f"found only {len(out)} prompt windows in the held-out standard-library files")
    return out


def shuffle_words(text: str, rng: random.Random) -> str:
    """Low-predictability text with code's vocabulary: the words of ``text`` in random order."""
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def default_prompts(
    n: int,
    tokenizer=None,
    max_prompt_tokens: int = 200,
    workload: str = "code",
    seed: int = 0,
    mixed_temperature: float | None = 1.0,
) -> list[Prompt]:
    """Held-out code prompts (``workload="code"``), or for ``"mixed"`` alternately a code prompt and
    a low-predictability request (even indices code, odd indices shuffled words sampled at
    ``mixed_temperature``; ``None``: the run's temperature). Shuffling the prompt alone does not make
    a request hard to speculate on: a small model's greedy continuation of any prompt soon repeats
    itself, so after a shuffled prompt every method accepts about as much as after code. Sampling at
    temperature 1, as a chat request would, is what makes n-gram lookup's drafts fail; the MTP heads
    and the draft model, which learned the target's own distribution, keep most of theirs
    (docs/benchmarks.md)."""
    if workload not in ("code", "mixed"):
        raise ValueError(f"workload={workload!r}: expected code or mixed")
    windows = _code_windows(n, seed, max_chars=4 * max_prompt_tokens)
    rng = random.Random(seed + 1)
    out = []
    for i, w in enumerate(windows):
        if workload == "mixed" and i % 2 == 1:
            text = trim(shuffle_words(w, rng), max_prompt_tokens, tokenizer, " ")
            out.append(Prompt(text, "shuffled", mixed_temperature))
        else:
            out.append(Prompt(trim(w, max_prompt_tokens, tokenizer), "code"))
    return out


def _prompt_from_json(line: str) -> Prompt:
    obj = json.loads(line)
    temp = obj.get("temperature")
    return Prompt(str(obj["prompt"]), str(obj.get("kind", "file")), None if temp is None else float(temp))


def read_prompts(path: str | Path) -> list[Prompt]:
    """JSON lines with a ``prompt`` field (and optional ``kind`` and ``temperature``)."""
    out = []
    for lineno, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            out.append(_prompt_from_json(line))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError):
            raise SystemExit(
                f"--prompts {path}:{lineno}: expected a JSON object with a 'prompt' field "
                "(and a numeric 'temperature' if any)"
            ) from None
    if not out:
        raise SystemExit(f"--prompts {path}: no prompts")
    return out
