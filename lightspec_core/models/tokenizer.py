"""Tokenizer loading and incremental detokenisation that is exact for byte-level BPE.

Each byte-level token maps to a fixed byte string, so streaming text is produced by feeding token
bytes through an incremental UTF-8 decoder: a character split across tokens is held back until its
last byte arrives, and no delta ever contains half a character.
"""

from __future__ import annotations

import codecs
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer


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


class TokenizerInfo:
    """A ``tokenizers.Tokenizer`` plus the per-token byte table the detokeniser needs."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        dec = _byte_decoder()
        self.special_ids = {tokenizer.token_to_id(t) for t in ("<pad>", "<s>", "</s>") if tokenizer.token_to_id(t) is not None}
        self.token_bytes: list[bytes] = []
        for i in range(tokenizer.get_vocab_size()):
            tok = tokenizer.id_to_token(i)
            if i in self.special_ids or tok is None:
                self.token_bytes.append(b"")
            else:
                self.token_bytes.append(bytes(dec[c] for c in tok))

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> TokenizerInfo:
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"model_dir: no tokenizer.json in {model_dir}")
        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return b"".join(self.token_bytes[i] for i in ids).decode("utf-8", errors="replace")


class IncrementalDetokenizer:
    def __init__(self, info: TokenizerInfo):
        self._bytes = info.token_bytes
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        return self._dec.decode(self._bytes[token_id])

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)
