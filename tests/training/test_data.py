"""Reading the user's text: which files, which documents, the held-out split, the token stream."""

from __future__ import annotations

import json

import pytest
import torch

from lightspec_core.training.data import (
    batches,
    encode_documents,
    find_files,
    frequent_tokens,
    read_documents,
    serving_prefix,
    split_documents,
)


def test_find_files_searches_directories_for_text_and_takes_files_as_given(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for name in ("a/x.py", "a/b/y.md", "a/b/z.jsonl", "a/w.txt", "a/skip.bin", "a/b/skip.json"):
        (tmp_path / name).write_text("t")
    (tmp_path / "given.log").write_text("t")
    got = find_files([tmp_path / "a", tmp_path / "given.log"])
    assert [p.relative_to(tmp_path).as_posix() for p in got] == ["a/b/y.md", "a/b/z.jsonl", "a/w.txt", "a/x.py",
                                                                  "given.log"]  # fmt: skip


def test_find_files_names_the_option_for_a_missing_path_or_no_text(tmp_path):
    with pytest.raises(ValueError, match="--data .*no such file"):
        find_files([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="--data .*no text files"):
        find_files([tmp_path / "empty"])


def test_read_documents_takes_each_jsonl_lines_text_and_skips_binary_files(tmp_path):
    (tmp_path / "r.jsonl").write_text("\n".join([json.dumps({"text": "one"}), "not json", json.dumps({"t": 1}),
                                                 json.dumps({"text": "two"})]))  # fmt: skip
    (tmp_path / "s.py").write_text("x = 1\n")
    (tmp_path / "bin.txt").write_bytes(b"\xff\xfe\x00garbage")
    assert read_documents([tmp_path / "r.jsonl", tmp_path / "bin.txt", tmp_path / "s.py"]) == ["one", "two", "x = 1\n"]


def test_split_holds_out_the_last_documents_and_splits_a_lone_one():
    docs = [f"d{i}" for i in range(40)]
    train, held = split_documents(docs)
    assert held == ["d38", "d39"] and train == docs[:38]
    assert split_documents(["a", "b"]) == (["a"], ["b"])  # at least one held out
    train, held = split_documents(["line\n" * 100])
    assert train[0] + held[0] == "line\n" * 100 and train[0] and held[0]


def test_encode_documents_ends_each_with_eos_and_adds_no_other_special_token(smoke_model):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smoke_model / "target" / "tokenizer.json"))
    ids = encode_documents(tok, ["def f():", "x"], eos_id=2)
    assert ids.dtype == torch.int32
    assert ids.tolist() == tok.encode("def f():").ids + [2] + tok.encode("x").ids + [2]
    assert encode_documents(tok, ["x"], eos_id=None).tolist() == tok.encode("x").ids


def test_frequent_tokens_ranks_by_count_then_lower_id():
    ids = torch.tensor([5, 5, 5, 1, 1, 3, 3, 0, 7])
    assert frequent_tokens(ids, 8, 3) == [1, 3, 5]  # 5 (3x); 1 and 3 (2x) tie, both kept
    assert frequent_tokens(ids, 8, 4) == [0, 1, 3, 5]  # 0 and 7 (1x) tie: the lower id


def test_batches_resume_from_the_generators_state():
    data = torch.arange(100, dtype=torch.int32)
    gen = torch.Generator().manual_seed(0)
    first = next(batches(data, 3, 8, gen))
    assert first.shape == (3, 9) and first.dtype == torch.int64
    assert torch.equal(first[:, 1:] - first[:, :-1], torch.ones(3, 8, dtype=torch.int64))  # contiguous windows
    state = gen.get_state()
    a = next(batches(data, 3, 8, gen))
    gen.set_state(state)
    assert torch.equal(next(batches(data, 3, 8, gen)), a)


def test_batches_start_every_window_with_the_prefix_then_the_same_text():
    data = torch.arange(100, dtype=torch.int32)
    plain = next(batches(data, 3, 8, torch.Generator().manual_seed(0)))
    with_bos = next(batches(data, 3, 8, torch.Generator().manual_seed(0), prefix=[1]))
    assert with_bos.shape == (3, 9) and with_bos.dtype == torch.int64
    assert torch.equal(with_bos, torch.cat([torch.ones(3, 1, dtype=torch.int64), plain[:, :-1]], dim=1))


def test_the_serving_prefix_is_the_bos_the_tokenizer_puts_before_a_prompt(smoke_model, bos_model):
    from tokenizers import Tokenizer

    byte_level = Tokenizer.from_file(str(smoke_model / "target" / "tokenizer.json"))
    llama_like = Tokenizer.from_file(str(bos_model / "tokenizer.json"))
    assert serving_prefix(byte_level) == []  # GPT-2, Qwen, the embedded model: nothing before a prompt
    assert serving_prefix(llama_like) == [1]
    assert llama_like.encode("def f():").ids == [1, *byte_level.encode("def f():").ids]
