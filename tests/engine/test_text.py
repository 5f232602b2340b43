"""Stop strings on a streaming text: the tail held back, the cut, the bounds on a request's list."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from lightspec_core.config import MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from lightspec_core.engine.text import sendable_chars, truncate_at_stop


def held_back_by_brute_force(text: str, stops: list[str]) -> int:
    """The longest n < len(s) with text ending in s[:n], over every stop string s."""
    return max((n for s in stops for n in range(1, min(len(s) - 1, len(text)) + 1) if text.endswith(s[:n])), default=0)


def seq_with(text: str, stops: list[str]):
    return SimpleNamespace(text=text, params=SimpleNamespace(stop=stops))


def test_the_held_back_tail_is_the_longest_prefix_of_a_stop_string():
    rng = random.Random(0)
    for _ in range(2000):  # a small alphabet makes partial matches common
        text = "".join(rng.choice("ab\n") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3))]
        want = len(text) - held_back_by_brute_force(text, stops)
        assert sendable_chars(seq_with(text, stops)) == want, (text, stops)


def test_a_stop_string_cuts_the_text_before_it():
    seq = seq_with("x = 1\nprint(x)\n", ["print", "zzz"])
    assert truncate_at_stop(seq, len("print(x)\n")) and seq.text == "x = 1\n"
    assert not truncate_at_stop(seq_with("x = 1\n", ["print"]), 6)


def test_a_stop_string_counts_when_the_new_text_completes_it_however_much_follows():
    seq = seq_with("def f():\n" + " " * 48, ["\n"])  # one token: a newline and 48 spaces of indentation
    assert truncate_at_stop(seq, 49) and seq.text == "def f():"
    seq = seq_with("x = pri" + "nt(x)" + " " * 40, ["print"])  # completed by the new text, which begins with "nt"
    assert truncate_at_stop(seq, 45) and seq.text == "x = "


def test_a_stop_string_already_in_the_text_before_the_new_characters_does_not_count():
    """It was searched for when it appeared, or appeared before min_tokens let it end the request."""
    assert not truncate_at_stop(seq_with(" # The path", [" # The"]), len(" path"))
    assert not truncate_at_stop(seq_with("abc", ["b"]), 0)


def test_a_request_s_stop_strings_are_bounded():
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS)
    SamplingParams(stop=["s" * MAX_STOP_CHARS])
    with pytest.raises(ValueError, match=rf"stop: {MAX_STOP_STRINGS + 1} stop strings, at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"stop: a stop string of {MAX_STOP_CHARS + 1} characters"):
        SamplingParams(stop=["s" * (MAX_STOP_CHARS + 1)])
