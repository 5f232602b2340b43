"""Request tensors -> GenerateRequest: defaults, and ValueErrors whose message starts with the tensor."""

from __future__ import annotations

import numpy as np
import pytest
from lightspec_backend.client import input_array
from lightspec_backend.inputs import parse_request


def getter(**tensors):
    arrays = {k: (v if isinstance(v, np.ndarray) else input_array(k, v)) for k, v in tensors.items()}
    return arrays.get


def test_defaults():
    r = parse_request(getter(text_input="def f():"))
    assert r.prompt == "def f():"
    assert r.params.max_tokens == 64 and r.params.temperature == 0.0 and r.params.top_p == 1.0
    assert r.params.top_k == 0 and r.params.seed is None and r.params.stop == [] and r.params.priority == 0
    assert r.params.num_draft_tokens is None and r.params.ignore_eos is False
    assert not r.stream and not r.exclude_input_in_output
    assert not r.return_num_input_tokens and not r.return_num_output_tokens


def test_all_fields():
    r = parse_request(
        getter(
            text_input="x",
            max_tokens=5,
            stream=True,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=2**63 + 1,
            stop_words=["\n\n", "def"],
            end_id=2,
            ignore_eos=True,
            exclude_input_in_output=True,
            priority=3,
            num_draft_tokens=0,
            return_num_input_tokens=True,
            return_num_output_tokens=True,
        )
    )
    p = r.params
    assert (p.max_tokens, p.top_k, p.seed, p.end_id, p.priority, p.num_draft_tokens) == (5, 40, 2**63 + 1, 2, 3, 0)
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    assert p.stop == ["\n\n", "def"] and p.ignore_eos
    assert r.stream and r.exclude_input_in_output and r.return_num_input_tokens and r.return_num_output_tokens


def test_input_ids_prompt():
    r = parse_request(getter(input_ids=[5, 6, 7]), vocab_size=10)
    assert r.prompt == [5, 6, 7]


def test_utf8_text_is_decoded():
    assert parse_request(getter(text_input="naïve ✓")).prompt == "naïve ✓"


@pytest.mark.parametrize(
    ("tensors", "starts"),
    [
        ({}, "text_input: missing prompt"),
        ({"max_tokens": 4}, "text_input: missing prompt"),
        ({"text_input": ""}, "text_input: the prompt is empty"),
        ({"text_input": b"\xff\xfeabc"}, "text_input: invalid UTF-8"),
        ({"text_input": "a", "input_ids": [1]}, "text_input: give either"),
        ({"input_ids": np.zeros(0, np.int64)}, "input_ids: the prompt is empty"),
        ({"input_ids": [3, 99]}, "input_ids: token id 99"),
        ({"input_ids": [-1]}, "input_ids: token id -1"),
        ({"text_input": "a", "max_tokens": 0}, "max_tokens=0"),
        ({"text_input": "a", "max_tokens": -3}, "max_tokens=-3"),
        ({"text_input": "a", "max_tokens": 10_000}, "max_tokens=10000: exceeds the model's context"),
        ({"text_input": "a", "temperature": -0.5}, "temperature=-0.5"),
        ({"text_input": "a", "temperature": float("nan")}, "temperature=nan"),
        ({"text_input": "a", "top_p": 0.0}, "top_p=0.0"),
        ({"text_input": "a", "top_p": 1.5}, "top_p=1.5"),
        ({"text_input": "a", "top_k": -1}, "top_k=-1"),
        ({"text_input": "a", "num_draft_tokens": -2}, "num_draft_tokens=-2"),
        ({"text_input": "a", "stop_words": ["ok", ""]}, "stop_words="),
        ({"text_input": "a", "stop_words": [b"\xc3"]}, "stop_words: invalid UTF-8"),
        ({"text_input": "a", "stop_words": ["w"] * 10_000}, "stop_words: 10000 stop strings, at most 64"),
        ({"text_input": "a", "stop_words": ["w" * 300]}, "stop_words: a stop string of 300 characters"),
        ({"text_input": "a", "max_tokens": np.array([1.5], np.float32)}, "max_tokens: expected datatype INT32"),
        ({"text_input": "a", "max_tokens": np.array([4, 5], np.int32)}, "max_tokens: expected exactly one element"),
        ({"text_input": np.array([1], np.int64)}, "text_input: expected datatype BYTES"),
        ({"input_ids": np.array([1.0], np.float32)}, "input_ids: expected datatype INT64"),
        ({"text_input": "a", "stream": np.array([1], np.int32)}, "stream: expected datatype BOOL"),
    ],
)
def test_invalid_input_error_names_the_tensor(tensors, starts):
    with pytest.raises(ValueError) as e:
        parse_request(getter(**tensors), max_model_len=512, vocab_size=64)
    assert str(e.value).startswith(starts), str(e.value)


def test_no_context_check_without_a_model_length():
    assert parse_request(getter(text_input="a", max_tokens=10_000)).params.max_tokens == 10_000
