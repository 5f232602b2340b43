"""Tokenizer loading and incremental detokenisation that never splits a character.

Two exact ways to stream text, chosen by the tokenizer's decoder:

- byte-level BPE (GPT-2, Llama 3, Qwen, the embedded model): each token maps to a fixed byte string,
  so text is produced by feeding token bytes through an incremental UTF-8 decoder; a character split
  across tokens is held back until its last byte arrives;
- any other decoder (SentencePiece-style ``▁`` words with byte fallback, as in Llama 2 and Mistral):
  a token's text depends on its neighbours (a leading space is stripped at the start, byte-fallback
  tokens fuse), so the tokenizer's own ``decode`` is run over a short window of recent tokens and
  only the text past the window's known part is emitted, held back while it ends in an incomplete
  character (U+FFFD), as vLLM's incremental detokeniser does.

Special tokens (the tokenizer's added tokens marked special: BOS, EOS, end-of-turn, padding) are
never part of the text, nor are ids past the tokenizer's: a checkpoint may have more embedding
rows than its tokenizer has tokens (Qwen2 pads 151665 to 152064), and ``tokenizers`` skips them.
"""

from __future__ import annotations

import codecs
import json
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer

_WINDOW = 6  # tokens before the new ones that a window decode sees (enough for any fused character)


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    # GPT-2's reversible byte <-> printable-unicode table used by the ByteLevel pre-tokenizer.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def _special_ids(tokenizer: Tokenizer) -> set[int]:
    ids = {i for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
    # checkpoints whose tokenizer.json does not mark them special (the embedded model's)
    return ids | {i for t in ("<pad>", "<s>", "</s>") if (i := tokenizer.token_to_id(t)) is not None}


def _is_byte_level(tokenizer: Tokenizer) -> bool:
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    return decoder.get("type") == "ByteLevel"


class TokenizerInfo:
    """A ``tokenizers.Tokenizer``, its special ids, and for byte-level BPE the per-token byte table."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.special_ids = _special_ids(tokenizer)
        self.chat_template: str | list | None = None  # tokenizer_config.json's, as transformers keeps it
        self.token_bytes: list[bytes] | None = None
        if _is_byte_level(tokenizer):
            dec = _byte_decoder()
            self.token_bytes = []
            for i in range(tokenizer.get_vocab_size()):
                tok = tokenizer.id_to_token(i)
                special = i in self.special_ids or tok is None
                self.token_bytes.append(b"" if special else bytes(dec[c] for c in tok if c in dec))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TokenizerInfo:
        """``tokenizer.json``, and from ``tokenizer_config.json`` (where there is one) the chat
        template (kept for a chat API) and the added tokens it marks special."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"model_dir: no tokenizer.json in {model_dir}")
        info = cls(Tokenizer.from_file(str(path)))
        extra = Path(model_dir) / "tokenizer_config.json"
        if extra.is_file():
            raw = json.loads(extra.read_text())
            info.chat_template = raw.get("chat_template")
            info.special_ids |= {int(i) for i, t in raw.get("added_tokens_decoder", {}).items() if t.get("special")}
            for i in info.special_ids if info.token_bytes is not None else ():
                if i < len(info.token_bytes):
                    info.token_bytes[i] = b""
        return info

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``text``'s ids. ``add_special_tokens`` runs tokenizer.json's post-processor, which puts
        Llama's and Mistral's BOS before a prompt, as transformers' ``tokenizer(text)`` and vLLM do;
        a rendered chat template already holds its BOS, and pieces of text take none: pass False."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def bytes_of(self, token_id: int) -> bytes:
        """A byte-level token's bytes: none for a special id or one past the tokenizer's."""
        return self.token_bytes[token_id] if token_id < len(self.token_bytes) else b""

    def decode(self, ids: list[int]) -> str:
        if self.token_bytes is not None:
            return b"".join(self.bytes_of(i) for i in ids).decode("utf-8", errors="replace")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)


class IncrementalDetokenizer:
    """Text deltas for one request's tokens, one ``push`` per token; ``flush`` at the end.
    ``prompt``: the request's prompt ids; its last tokens are the first window's known part, so the
    first token's text is what it is after the prompt (a word's leading space kept)."""

    def __init__(self, info: TokenizerInfo, prompt: list[int] = ()):
        self._info = info
        if info.token_bytes is not None:
            self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._ids: list[int] = list(prompt[-_WINDOW:])
        self._read = len(self._ids)  # tokens whose text has been emitted (or is the prompt's)

    def push(self, token_id: int) -> str:
        if self._info.token_bytes is not None:
            return self._dec.decode(self._info.bytes_of(token_id))
        self._ids.append(token_id)
        return self._emit(final=False)

    def flush(self) -> str:
        if self._info.token_bytes is not None:
            return self._dec.decode(b"", final=True)
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        start = max(0, self._read - _WINDOW)
        known = self._info.decode(self._ids[start : self._read])
        text = self._info.decode(self._ids[start:])
        if not final and (text.endswith("\ufffd") or len(text) <= len(known)):
            return ""  # an incomplete character (or nothing new yet): wait for the next token
        self._read = len(self._ids)
        if len(self._ids) > 4 * _WINDOW:  # keep the window's tokens only
            drop = len(self._ids) - _WINDOW
            self._ids, self._read = self._ids[drop:], self._read - drop
        return text.removeprefix(known)
