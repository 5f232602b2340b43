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
        ({"text_input": "a", "top_k": -2}, "top_k=-2"),
        ({"text_input": "a", "num_draft_tokens": -2}, "num_draft_tokens=-2"),
        (
            {"text_input": "a", "sampling_parameters": '{"top_k": 1e20}'},
            "sampling_parameters: top_k=100000000000000000000",
        ),
        ({"text_input": "a", "sampling_parameters": '{"max_tokens": "+-5"}'}, "sampling_parameters: max_tokens='+-5'"),
        ({"text_input": "a", "sampling_parameters": '{"seed": "²"}'}, "sampling_parameters: seed='²'"),
        # numbers past float's range or int()'s digit limit, and nesting past the parser's depth
        (
            {"text_input": "a", "sampling_parameters": '{"temperature": 1' + "0" * 400 + "}"},
            "sampling_parameters: temperature: an integer of 1329 bits: expected a finite number",
        ),
        (
            {"text_input": "a", "sampling_parameters": '{"repetition_penalty": 1' + "0" * 400 + "}"},
            "sampling_parameters: repetition_penalty: an integer of 1329 bits: expected a finite number",
        ),
        (
            {"text_input": "a", "sampling_parameters": '{"max_tokens": "1' + "0" * 5000 + '"}'},
            "sampling_parameters: max_tokens: '1000000000000000000000000000000000000000...': expected an integer",
        ),
        (
            {"text_input": "a", "sampling_parameters": '{"max_tokens": 1' + "0" * 5000 + "}"},
            "sampling_parameters: invalid JSON (ValueError: ",
        ),
        (
            {"text_input": "a", "sampling_parameters": "[" * 100_000 + "]" * 100_000},
            "sampling_parameters: invalid JSON (RecursionError: ",
        ),
        ({"text_input": "a", "stream_interval": 0}, "stream_interval=0: must be a positive integer"),
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


def test_stream_interval_from_a_tensor_or_vllm_sampling_parameters():
    assert parse_request(getter(text_input="x", stream_interval=8)).params.stream_interval == 8
    sp = '{"stream_interval": "3"}'
    assert parse_request(getter(text_input="x", sampling_parameters=sp)).params.stream_interval == 3
    assert parse_request(getter(text_input="x")).params.stream_interval is None
    with pytest.raises(ValueError, match="stream_interval is also given by stream_interval"):
        parse_request(getter(text_input="x", stream_interval=2, sampling_parameters=sp))


def test_no_context_check_without_a_model_length():
    assert parse_request(getter(text_input="a", max_tokens=10_000)).params.max_tokens == 10_000


# ---- the vLLM backend's convention ----------------------------------------------------------------


def test_sampling_parameters_json_with_numbers_written_as_strings():
    sp = '{"max_tokens": "12", "temperature": "0.7", "top_p": 0.9, "top_k": "-1", "seed": "7", "min_tokens": 3,' \
         ' "ignore_eos": "true", "stop": "\\n\\n", "n": 1, "best_of": "1", "presence_penalty": 0}'  # fmt: skip
    p = parse_request(getter(text_input="x", sampling_parameters=sp)).params
    assert (p.max_tokens, p.top_k, p.seed, p.min_tokens, p.ignore_eos, p.stop) == (12, 0, 7, 3, True, ["\n\n"])
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)


@pytest.mark.parametrize(
    ("sp", "fragment"),
    [
        ('{"max_tokens": 4, "temprature": 0.5}', "sampling_parameters: temprature: unknown key"),
        ('{"n": 2}', "sampling_parameters: n=2: not supported"),
        ('{"repetition_penalty": 1.2}', "sampling_parameters: repetition_penalty=1.2: not supported"),
        ('{"logprobs": 1}', "sampling_parameters: logprobs=1: not supported"),
        ('{"max_tokens": "many"}', "sampling_parameters: max_tokens='many': expected an integer"),
        ('{"max_tokens": 0}', "sampling_parameters: max_tokens=0"),
        ('{"stream_interval": 0}', "sampling_parameters: stream_interval=0"),
        ('{"ignore_eos": "maybe"}', "sampling_parameters: ignore_eos='maybe': expected true or false"),
        ("[1, 2]", "sampling_parameters: expected a JSON object"),
        ('{"max_tokens": ', "sampling_parameters: invalid JSON"),
    ],
)
def test_sampling_parameters_refuses_by_key(sp, fragment):
    with pytest.raises(ValueError) as e:
        parse_request(getter(text_input="x", sampling_parameters=sp))
    assert str(e.value).startswith(fragment), str(e.value)


def test_a_field_given_as_tensor_and_in_sampling_parameters_is_refused():
    with pytest.raises(ValueError, match=r"^sampling_parameters: max_tokens is also given by max_tokens"):
        parse_request(getter(text_input="x", max_tokens=3, sampling_parameters='{"max_tokens": 4}'))


def test_request_parameters_take_vllm_keys_and_refuse_unknown_ones_by_name():
    r = parse_request(getter(text_input="x"), parameters='{"max_tokens": 5, "stop": ["a"]}')
    assert r.params.max_tokens == 5 and r.params.stop == ["a"]
    with pytest.raises(ValueError, match=r"^max_token: unknown key"):
        parse_request(getter(text_input="x"), parameters={"max_token": 5})


def test_vllm_backend_flags():
    r = parse_request(getter(text_input="x", return_finish_reason=True, return_cumulative_logprob=False))
    assert r.params.max_tokens == 64
    for flag in ("return_cumulative_logprob", "return_logprobs"):
        with pytest.raises(ValueError, match=rf"^{flag}=True: not supported"):
            parse_request(getter(text_input="x", **{flag: True}))


# ---- TensorRT-LLM's convention -----------------------------------------------------------------------


def batched(**tensors):
    """Every input with a leading batch dimension of 1, as a TensorRT-LLM client sends them."""
    return getter(**{k: input_array(k, v)[None, ...] for k, v in tensors.items()})


def test_trtllm_inputs_with_batch_shapes():
    get = batched(text_input="def f():", max_tokens=6, bad_words=[], stop_words=["\n"], end_id=2, pad_id=2,
                  top_k=1, top_p=1.0, temperature=0.0, random_seed=11, min_length=2, beam_width=1,
                  num_return_sequences=1, stream=True, return_log_probs=False, length_penalty=1.0,
                  repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)  # fmt: skip
    assert get("max_tokens").shape == (1, 1) and get("stop_words").shape == (1, 1)
    r = parse_request(get)
    p = r.params
    assert r.prompt == "def f():" and r.stream
    assert (p.max_tokens, p.stop, p.end_id, p.top_k, p.seed, p.min_tokens) == (6, ["\n"], 2, 1, 11, 2)


def test_input_ids_with_batch_shape():
    assert parse_request(batched(input_ids=[5, 6, 7])).prompt == [5, 6, 7]
    with pytest.raises(ValueError, match=r"^input_ids: expected shape \[N\] or \[1, N\]"):
        parse_request(getter(input_ids=np.array([[5, 6], [7, 8]], np.int64)))


@pytest.mark.parametrize(
    ("tensors", "fragment"),
    [
        ({"beam_width": 2}, "beam_width=2: not supported"),
        ({"num_return_sequences": 3}, "num_return_sequences=3: not supported"),
        ({"repetition_penalty": 1.3}, "repetition_penalty=1.3"),
        ({"presence_penalty": 0.5}, "presence_penalty=0.5"),
        ({"return_log_probs": True}, "return_log_probs=True"),
        ({"return_generation_logits": True}, "return_generation_logits=True"),
        ({"bad_words": ["foo"]}, "bad_words: not supported"),
        ({"seed": 1, "random_seed": 2}, "random_seed: give either seed or random_seed"),
        ({"min_tokens": 1, "min_length": 2}, "min_length: give either min_tokens or min_length"),
        ({"min_length": 100, "max_tokens": 10}, "min_length=100: must be an integer in [0, max_tokens=10]"),
    ],
)
def test_trtllm_inputs_that_cannot_be_honoured_are_refused_by_name(tensors, fragment):
    with pytest.raises(ValueError) as e:
        parse_request(batched(text_input="x", **tensors))
    assert str(e.value).startswith(fragment), str(e.value)


def test_scalars_take_shape_one_or_one_by_one_only():
    with pytest.raises(ValueError, match=r"^max_tokens: expected exactly one element \(shape \[1\] or \[1, 1\]\)"):
        parse_request(getter(text_input="x", max_tokens=np.array([[1, 2]], np.int32)))


def test_prompt_errors_from_the_engine_name_the_input_that_carried_the_prompt():
    from lightspec_backend.inputs import name_prompt_error

    ids = parse_request(getter(input_ids=[1, 2]))
    text = parse_request(getter(text_input="x"))
    err = ValueError("prompt: 3000 tokens, the context holds 2048")
    assert name_prompt_error(ids, err) == "input_ids: 3000 tokens, the context holds 2048"
    assert name_prompt_error(text, err).startswith("text_input: 3000 tokens")
    assert name_prompt_error(text, ValueError("max_tokens=9: x")) == "max_tokens=9: x"


def test_empty_word_lists_mean_none_as_in_tensorrt_llm():
    r = parse_request(batched(text_input="x", stop_words=[""], bad_words=[""], embedding_bias_words=[""]))
    assert r.params.stop == []


def test_add_special_tokens_defaults_to_true_and_is_read_from_its_tensor():
    assert parse_request(getter(text_input="x")).add_special_tokens is True
    assert parse_request(getter(text_input="x", add_special_tokens=False)).add_special_tokens is False
    assert parse_request(getter(text_input="x", add_special_tokens=True)).add_special_tokens is True
    assert parse_request(batched(text_input="x", add_special_tokens=False)).add_special_tokens is False
    with pytest.raises(ValueError, match=r"^add_special_tokens: expected datatype BOOL"):
        parse_request(getter(text_input="x", add_special_tokens=np.array([0], np.int32)))


def test_streaming_with_the_prompt_in_the_output_is_refused_as_in_vllms_backend():
    assert parse_request(getter(text_input="x", stream=True)).exclude_input_in_output is False
    assert parse_request(getter(text_input="x", exclude_input_in_output=False)).exclude_input_in_output is False
    with pytest.raises(ValueError, match=r"^exclude_input_in_output=False: not supported when streaming"):
        parse_request(getter(text_input="x", stream=True, exclude_input_in_output=False))
    with pytest.raises(ValueError, match=r"^exclude_input_in_output=False"):
        parse_request(getter(text_input="x", exclude_input_in_output=False), parameters={"stream": True})


def test_a_null_max_tokens_asks_for_the_rest_of_the_context_as_in_vllm():
    r = parse_request(getter(text_input="x", sampling_parameters='{"max_tokens": null, "top_k": null}'),
                      max_model_len=512)  # fmt: skip
    assert r.params.max_tokens is None and r.params.top_k == 0  # other keys' null: their default
    assert parse_request(getter(text_input="x"), parameters={"max_tokens": None}).params.max_tokens is None
    with pytest.raises(ValueError, match=r"^sampling_parameters: max_tokens is also given by max_tokens"):
        parse_request(getter(text_input="x", max_tokens=4, sampling_parameters='{"max_tokens": null}'))


def test_stream_as_a_request_parameter():
    assert parse_request(getter(text_input="x"), parameters={"stream": "true"}).stream
    assert not parse_request(getter(text_input="x"), parameters={"stream": False}).stream
    with pytest.raises(ValueError, match=r"^stream: given both"):
        parse_request(getter(text_input="x", stream=True), parameters={"stream": True})


def test_tensor_spellings_of_off_as_vllm_and_tensorrt_llm_send_them():
    r = parse_request(getter(text_input="x", top_k=-1, end_id=-1, stop_words=["ok", ""]))
    assert r.params.top_k == 0  # vLLM: top_k -1 is off
    assert r.params.end_id is None and r.params.ignore_eos  # TensorRT-LLM: end_id -1, no end token
    assert r.params.stop == ["ok"]  # TensorRT-LLM skips a stop word that encodes to nothing
    with pytest.raises(ValueError, match=r"^end_id=-1: means no end token, and ignore_eos=false"):
        parse_request(getter(text_input="x", end_id=-1, ignore_eos=False))


def test_end_id_replaces_eos_as_in_tensorrt_llm_unless_ignore_eos_false_keeps_both():
    r = parse_request(getter(text_input="x", end_id=7))
    assert (r.params.end_id, r.params.ignore_eos) == (7, True)  # only end_id ends the output
    r = parse_request(getter(text_input="x", end_id=7, ignore_eos=False))
    assert (r.params.end_id, r.params.ignore_eos) == (7, False)  # asked for: EOS ends it too
    r = parse_request(getter(text_input="x", end_id=7), parameters={"ignore_eos": False})
    assert (r.params.end_id, r.params.ignore_eos) == (7, False)
    assert not parse_request(getter(text_input="x")).params.ignore_eos  # no end_id: EOS ends it
    # ignore_eos false as a request parameter contradicts end_id -1 as the tensor does
    with pytest.raises(ValueError, match=r"^end_id=-1: means no end token, and parameter: ignore_eos=false"):
        parse_request(getter(text_input="x", end_id=-1), parameters={"ignore_eos": False})


def test_return_perf_metrics_is_a_tensorrt_llm_input_that_reaches_the_engine():
    assert parse_request(getter(text_input="x", return_perf_metrics=True)).params.return_perf_metrics
    assert not parse_request(getter(text_input="x")).params.return_perf_metrics


def test_a_negative_seed_in_sampling_parameters_is_its_64_bits_as_vllm_takes_any_int64():
    r = parse_request(getter(text_input="x", sampling_parameters='{"seed": -1}'))
    assert r.params.seed == (1 << 64) - 1  # what the UINT64 seed input carries for the same bits
    with pytest.raises(ValueError, match=r"^sampling_parameters: seed=-9223372036854775809"):
        parse_request(getter(text_input="x", sampling_parameters=f'{{"seed": {-(1 << 63) - 1}}}'))


def test_headers_the_server_forwards_as_request_parameters_are_left_alone_where_configured():
    sent = {"x-tenant-id": "acme", "traceparent": "00-ab-cd-01", "temperature": 0.5}
    with pytest.raises(ValueError, match=r"^x-tenant-id: unknown key"):  # not configured: a misspelt input?
        parse_request(getter(text_input="x"), parameters=sent)
    r = parse_request(getter(text_input="x"), parameters=sent, forwarded_headers="^(x-tenant|traceparent)")
    assert r.params.temperature == 0.5
    # a broad pattern never hides a sampling key, nor a key it does not match
    r = parse_request(getter(text_input="x"), parameters={"temperature": 0.5}, forwarded_headers=".*")
    assert r.params.temperature == 0.5
    with pytest.raises(ValueError, match=r"^temprature: unknown key"):
        parse_request(getter(text_input="x"), parameters={"temprature": 0.5}, forwarded_headers="^x-")
