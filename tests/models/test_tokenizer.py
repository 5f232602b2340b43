"""Streaming detokenisation is exact for byte-level BPE and for SentencePiece-style tokenizers with
byte fallback (Llama 2, Mistral): the deltas add up to the tokenizer's own decode, and none splits a
character; special tokens never reach the text."""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from lightspec_core.models.tokenizer import IncrementalDetokenizer, TokenizerInfo


def sentencepiece_style() -> Tokenizer:
    """Llama 2's pipeline: ▁ for spaces, a byte-fallback BPE, and a decoder that fuses byte tokens
    and strips the leading space."""
    pieces = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], "▁", *"abcdefgh", "▁a", "▁b", "ab", "▁ab"]
    vocab = {p: i for i, p in enumerate(pieces)}
    merges = [("▁", "a"), ("▁", "b"), ("a", "b"), ("▁a", "b")]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    return tok


def stream(info: TokenizerInfo, prompt: list[int], out: list[int]) -> list[str]:
    detok = IncrementalDetokenizer(info, prompt)
    return [detok.push(t) for t in out] + [detok.flush()]


def test_sentencepiece_deltas_add_up_to_the_full_decode_and_never_split_a_character():
    info = TokenizerInfo(sentencepiece_style())
    assert info.token_bytes is None  # not byte-level: the window decode
    tok = info.tokenizer
    rng = random.Random(1)
    words = ["ab", "a", "bad", "é", "日本", "😀", "fe"]
    for _ in range(200):
        prompt = tok.encode(" ".join(rng.choice(words) for _ in range(3))).ids
        out = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 6)))).ids
        deltas = stream(info, prompt, out)
        assert info.decode(prompt) + "".join(deltas) == info.decode(prompt + out)
        assert not any("\ufffd" in d for d in deltas), deltas  # every character arrives whole


def test_special_tokens_never_reach_the_text():
    info = TokenizerInfo(sentencepiece_style())
    eos, bos = info.tokenizer.token_to_id("</s>"), info.tokenizer.token_to_id("<s>")
    assert {eos, bos} <= info.special_ids
    ab = info.tokenizer.encode("ab").ids
    text = "".join(stream(info, [bos], ab + [eos]))
    assert text == info.decode([bos, *ab, eos]) == "ab"  # as the tokenizer decodes the whole sequence


def test_byte_level_tokenizer_streams_through_its_byte_table(default_model):
    info = TokenizerInfo.from_dir(default_model / "target")
    assert info.token_bytes is not None
    ids = info.encode("def f():\n    return 'é日本😀'\n")
    assert "".join(stream(info, [], ids)) == info.decode(ids)


def test_tokenizer_config_gives_the_chat_template_and_special_tokens(tmp_path):
    tok = sentencepiece_style()
    tok.save(str(tmp_path / "tokenizer.json"))
    b_id = tok.token_to_id("▁b")
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        f'{{"chat_template": "{template}", "added_tokens_decoder": {{"{b_id}": {{"content": "▁b", "special": true}}}}}}'
    )
    info = TokenizerInfo.from_dir(tmp_path)
    assert info.chat_template == template and b_id in info.special_ids
    assert TokenizerInfo(tok).chat_template is None


def test_ids_past_the_tokenizer_decode_to_nothing_in_both_ways(default_model):
    """A checkpoint may have more embedding rows than its tokenizer has tokens (Qwen2: 152064 over
    151665); a sampled padding id adds no text, as the tokenizer's own decode skips it."""
    for info in (TokenizerInfo.from_dir(default_model / "target"), TokenizerInfo(sentencepiece_style())):
        n = info.tokenizer.get_vocab_size()
        ids = info.encode("ab a é")
        out = [*ids, n, n + 63, *ids]
        assert info.decode(out) == info.tokenizer.decode(out, skip_special_tokens=True) == info.decode(ids + ids)
        assert "".join(stream(info, [n + 1], out)) == info.decode(ids + ids)


def test_encode_adds_the_bos_of_the_post_processor_as_transformers_does_unless_told_not_to():
    """Llama 2's and Mistral's tokenizer.json put ``<s>`` before a text through a post-processor."""
    from transformers import PreTrainedTokenizerFast

    tok = sentencepiece_style()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    info, hf = TokenizerInfo(tok), PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")
    assert info.encode("ab a") == hf("ab a").input_ids == [1, *info.encode("ab a", add_special_tokens=False)]
    assert info.encode("ab a", add_special_tokens=False) == hf("ab a", add_special_tokens=False).input_ids
