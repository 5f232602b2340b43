"""OpenAI request bodies -> the lightspec model's tensors, and response totals -> OpenAI fields."""

from __future__ import annotations

import pytest
from lightspec_backend.openai_api.convert import Accumulator, choice_tensors, request_tensors, sampling_tensors
from lightspec_backend.openai_api.errors import OpenAIError
from lightspec_backend.openai_api.protocol import ChatCompletionRequest, CompletionRequest
from lightspec_backend.openai_api.triton import Chunk
from pydantic import ValidationError


def completion(**kw) -> CompletionRequest:
    return CompletionRequest(model="lightspec", prompt=kw.pop("prompt", "def f():"), **kw)


def chat(**kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="lightspec", messages=[{"role": "user", "content": "hi"}], **kw)


def test_completion_maps_every_sampling_field_to_its_tensor():
    req = completion(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop=["\n\n", "END"], stream=True, top_k=4,
                     ignore_eos=True, num_draft_tokens=2, stream_interval=5)  # fmt: skip
    (prompt,) = req.prompts()
    t = request_tensors(prompt, req)
    assert t == {
        "text_input": "def f():", "add_special_tokens": True, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "seed": 3,
        "stop_words": ["\n\n", "END"], "stream": True, "top_k": 4, "ignore_eos": True, "num_draft_tokens": 2,
        "stream_interval": 5,
        "exclude_input_in_output": True, "return_num_input_tokens": True, "return_num_output_tokens": True,
    }  # fmt: skip


def test_openai_defaults_sampling_at_temperature_one_and_16_completion_tokens():
    t = sampling_tensors(completion())
    assert t == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 16}
    assert "max_tokens" not in sampling_tensors(chat())
    # a chat without a length: the rest of the context, as in vLLM (vLLM's null max_tokens)
    assert request_tensors("hi", chat())["sampling_parameters"] == '{"max_tokens": null}'
    assert "sampling_parameters" not in request_tensors("hi", chat(max_tokens=3))


def test_a_single_stop_string_and_token_id_prompts():
    req = completion(prompt=[5, 6, 7], stop="\n")
    (prompt,) = req.prompts()
    t = request_tensors(prompt, req)
    assert t["input_ids"] == [5, 6, 7] and "text_input" not in t and t["stop_words"] == ["\n"]
    assert completion(prompt=["only one"]).prompts() == ["only one"]
    assert completion(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert completion(prompt=[[1, 2], [3]]).prompts() == [[1, 2], [3]]
    with pytest.raises(OpenAIError, match="^prompt: an empty list"):
        completion(prompt=[]).prompts()


def test_a_seeded_requests_choices_take_seed_plus_their_index_as_vllm_does():
    t = request_tensors("x", completion(seed=(1 << 64) - 1, n=3))
    assert [choice_tensors(t, j).get("seed") for j in range(3)] == [(1 << 64) - 1, 0, 1]
    assert choice_tensors(t, 0) is t and t["seed"] == (1 << 64) - 1
    unseeded = request_tensors("x", completion(n=2))
    assert choice_tensors(unseeded, 1) == unseeded and "seed" not in unseeded
    with pytest.raises(OpenAIError, match="^n=0: must be at least 1"):
        sampling_tensors(completion(n=0))


def test_a_completion_adds_special_tokens_and_chat_does_not_unless_the_request_says_otherwise():
    """vLLM's defaults: the tokenizer's BOS before a completion's text prompt, none after a chat
    template (which writes bos_token itself); the extension field overrides either."""
    assert request_tensors("p", completion())["add_special_tokens"] is True
    assert request_tensors("p", completion(add_special_tokens=False))["add_special_tokens"] is False
    assert request_tensors("p", chat())["add_special_tokens"] is False
    assert request_tensors("p", chat(add_special_tokens=True))["add_special_tokens"] is True
    assert "add_special_tokens" not in request_tensors([5, 6], completion(prompt=[5, 6]))  # ids: nothing to add
    with pytest.raises(ValidationError):
        completion(add_special_tokens="maybe")


def test_chat_max_completion_tokens_wins_over_max_tokens_as_in_vllm():
    """A client may fill in both (the deprecated one for older servers): vLLM takes
    max_completion_tokens, and errors name the field that was used."""
    assert sampling_tensors(chat(max_completion_tokens=9))["max_tokens"] == 9
    assert sampling_tensors(chat(max_tokens=16, max_completion_tokens=8))["max_tokens"] == 8
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(chat(max_tokens=8, max_completion_tokens=0))
    assert e.value.param == "max_completion_tokens"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_k": -2}, "top_k"),
        ({"seed": -(1 << 63) - 1}, "seed"),  # below int64, vLLM's range
        ({"stream_interval": 0}, "stream_interval"),
        ({"seed": 1 << 64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"n": 0}, "n"),
        ({"logprobs": 1}, "logprobs"),
        ({"best_of": 3}, "best_of"),
        ({"echo": True}, "echo"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"presence_penalty": -1}, "presence_penalty"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ],
)
def test_bad_or_unsupported_values_are_a_400_naming_the_field(kw, param):
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(completion(**kw))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)
    assert e.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"top_k": (1 << 32) + 5}, "top_k"),  # INT32 would wrap it to 5
        ({"priority": -(1 << 31) - 1}, "priority"),  # INT32 would wrap it to the highest priority
        ({"priority": 1 << 31}, "priority"),
        ({"num_draft_tokens": 1 << 31}, "num_draft_tokens"),
        ({"stream_interval": 1 << 31}, "stream_interval"),
        ({"max_tokens": 1 << 31}, "max_tokens"),
        ({"seed": 1 << 64}, "seed"),  # UINT64
    ],
)
def test_integers_their_tensor_cannot_hold_are_a_400_naming_the_field(kw, param):
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(completion(**kw))
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(f"{param}={kw[param]}: ")


def test_the_range_check_names_the_chat_length_field_and_covers_prompt_token_ids():
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(chat(max_completion_tokens=1 << 31))
    assert e.value.param == "max_completion_tokens"
    with pytest.raises(OpenAIError) as e:
        request_tensors([5, 1 << 63], completion())  # INT64 input_ids
    assert e.value.param == "prompt" and e.value.message.startswith(f"prompt: {1 << 63}: out of range")
    edges = sampling_tensors(completion(priority=-(1 << 31), top_k=(1 << 31) - 1, seed=(1 << 64) - 1))
    assert (edges["priority"], edges["top_k"], edges["seed"]) == (-(1 << 31), (1 << 31) - 1, (1 << 64) - 1)


def test_a_negative_seed_is_its_64_bits_as_vllm_takes_any_int64():
    assert sampling_tensors(completion(seed=-1))["seed"] == (1 << 64) - 1
    assert sampling_tensors(chat(seed=-(1 << 63)))["seed"] == 1 << 63


def test_top_k_minus_one_is_vllms_off():
    assert sampling_tensors(completion(top_k=-1))["top_k"] == 0
    assert sampling_tensors(chat(top_k=-1))["top_k"] == 0


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": -1}, "n"),
    ],
)
def test_chat_fields_lightspec_cannot_honour_are_refused_by_name(kw, param):
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(chat(**kw))
    assert e.value.param == param and param in e.value.message


def test_harmless_openai_fields_are_accepted_and_unknown_ones_refused():
    sampling_tensors(chat(user="u", frequency_penalty=0, store=False, metadata={"a": "b"}, n=1, tool_choice="none",
                          response_format={"type": "text"}, parallel_tool_calls=False))  # fmt: skip
    with pytest.raises(ValidationError) as e:
        chat(guided_json={"type": "object"})
    assert e.value.errors()[0]["loc"] == ("guided_json",)


def test_non_text_message_parts_are_refused_naming_the_message():
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ])  # fmt: skip
    assert req.messages[0].for_template(0)["content"] == "a\nb"  # joined as vLLM joins them
    with pytest.raises(OpenAIError) as e:
        req.messages[1].for_template(1)
    assert e.value.param == "messages[1].content"


def chunk(text, reason="", n_in=None, n_out=None, drafted=0, accepted=0, hist=()):
    return Chunk(text, reason, n_in, n_out, drafted, accepted, list(hist))


def test_accumulated_usage_and_speculation_metrics_in_vllm_form():
    acc = Accumulator()
    acc.add(chunk("ab", n_in=5, n_out=2, drafted=2, accepted=1, hist=[0, 1]))
    acc.add(chunk("c", "length", n_in=5, n_out=3, drafted=6, accepted=4, hist=[1, 0, 0, 0, 1]))
    assert "".join(acc.text) == "abc" and acc.finish_reason == "length"
    assert acc.usage() == {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    spec = acc.metrics()["speculative_decoding"]
    # aiperf's invariants: the histogram sums to the steps, its j-weighted sum to the accepted drafts
    assert spec["num_spec_steps"] == sum(spec["acceptance_histogram"]) == 2
    assert sum(j * c for j, c in enumerate(spec["acceptance_histogram"])) == spec["num_accepted_draft_tokens"] == 4
    assert spec["num_draft_tokens"] == 6 and spec["draft_acceptance_rate"] == pytest.approx(4 / 6)
    assert spec["mean_acceptance_length"] == pytest.approx(1 + 4 / 2)


def test_the_total_of_choices_counts_each_prompt_once_and_sums_the_rest():
    accs = [Accumulator() for _ in range(4)]  # two prompts, n=2
    for i, a in enumerate(accs):
        a.add(
            chunk("t", "stop", n_in=10 * (1 + i // 2), n_out=i + 1, drafted=2, accepted=i % 2, hist=[1 - i % 2, i % 2])
        )
    total = Accumulator.total(accs, 2)
    assert total.usage() == {"prompt_tokens": 30, "completion_tokens": 10, "total_tokens": 40}
    spec = total.metrics()["speculative_decoding"]
    assert spec["acceptance_histogram"] == [2, 2] and spec["num_accepted_draft_tokens"] == 2
    assert spec["num_draft_tokens"] == 8


def test_metrics_without_speculation_are_all_zero_steps():
    acc = Accumulator()
    acc.add(chunk("x", "stop", n_in=1, n_out=1))
    spec = acc.metrics()["speculative_decoding"]
    assert spec["acceptance_histogram"] == [0] and spec["num_spec_steps"] == 0 and spec["mean_acceptance_length"] == 1.0


def test_min_tokens_reaches_its_tensor_and_is_checked_against_the_length():
    assert sampling_tensors(completion(min_tokens=4, max_tokens=8))["min_tokens"] == 4
    assert sampling_tensors(chat(min_tokens=2))["min_tokens"] == 2
    with pytest.raises(OpenAIError) as e:
        sampling_tensors(completion(min_tokens=9, max_tokens=8))
    assert e.value.param == "min_tokens"


@pytest.mark.parametrize("make", [completion, chat])
def test_vllm_extensions_are_accepted_at_their_neutral_values_and_refused_otherwise(make):
    neutral = {"repetition_penalty": 1.0, "min_p": 0.0, "skip_special_tokens": True, "stop_token_ids": [],
               "include_stop_str_in_output": False, "use_beam_search": False, "bad_words": []}  # fmt: skip
    assert sampling_tensors(make(**neutral)) == sampling_tensors(make())
    for name, value in [("repetition_penalty", 1.2), ("min_p", 0.1), ("stop_token_ids", [5]),
                        ("include_stop_str_in_output", True), ("skip_special_tokens", False)]:  # fmt: skip
        with pytest.raises(OpenAIError) as e:
            sampling_tensors(make(**{name: value}))
        assert e.value.param == name and e.value.message.startswith(f"{name}={value!r}: not supported")


def test_top_logprobs_zero_without_logprobs_asks_for_nothing():
    assert sampling_tensors(chat(top_logprobs=0)) == sampling_tensors(chat())
