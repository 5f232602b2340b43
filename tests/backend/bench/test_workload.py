"""``lightspec_backend.bench.workload``: held-out code prompts, the mixed workload, prompt files."""

from __future__ import annotations

import random

import pytest
from lightspec_backend.bench.workload import default_prompts, read_prompts, shuffle_words, trim


def test_mixed_workload_alternates_code_and_shuffled_prompts_deterministically():
    prompts = default_prompts(6, None, max_prompt_tokens=60, workload="mixed", seed=3)
    assert [p.kind for p in prompts] == ["code", "shuffled"] * 3
    assert [p.temperature for p in prompts] == [None, 1.0] * 3  # the shuffled half is sampled
    assert prompts == default_prompts(6, None, max_prompt_tokens=60, workload="mixed", seed=3)
    for p in prompts:
        assert 0 < len(p.text) <= 3 * 60  # trimmed (3 characters per token without a tokenizer)
        if p.kind == "code":
            assert p.text.rstrip().endswith(":") and "def " in p.text.splitlines()[-1]
        else:
            assert "\n" not in p.text
    code = default_prompts(4, None, max_prompt_tokens=60, workload="code", seed=3)
    assert {p.kind for p in code} == {"code"}
    assert [p.temperature for p in default_prompts(2, None, 60, "mixed", 3, mixed_temperature=None)] == [None, None]
    with pytest.raises(ValueError, match="workload='chat'"):
        default_prompts(2, None, workload="chat")


def test_trim_drops_leading_lines_until_the_text_fits():
    text = "".join(f"line {i}\n" for i in range(100))
    out = trim(text, 20, None)
    assert len(out) <= 3 * 20 and text.endswith(out) and out.startswith("line ")
    assert trim("short", 20, None) == "short"


def test_shuffled_text_keeps_the_words_and_loses_the_order():
    text = " ".join(f"w{i}" for i in range(50))
    out = shuffle_words(text, random.Random(0))
    assert sorted(out.split()) == sorted(text.split()) and out != text


def test_prompts_file_needs_a_prompt_field(tmp_path):
    good = tmp_path / "p.jsonl"
    good.write_text('{"prompt": "def f(x):"}\n\n{"prompt": "import os", "kind": "code"}\n')
    assert [(p.text, p.kind) for p in read_prompts(good)] == [("def f(x):", "file"), ("import os", "code")]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        read_prompts(bad)
    temps = tmp_path / "t.jsonl"
    temps.write_text('{"prompt": "a", "temperature": 0.7}\n{"prompt": "b"}\n')
    assert [p.temperature for p in read_prompts(temps)] == [0.7, None]
    temps.write_text('{"prompt": "a", "temperature": "hot"}\n')
    with pytest.raises(SystemExit, match="t.jsonl:1.*temperature"):
        read_prompts(temps)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="no prompts"):
        read_prompts(empty)
