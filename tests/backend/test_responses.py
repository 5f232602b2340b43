"""Engine deltas -> response tensors: streaming sends only new tokens, non-streaming exactly one response."""

from __future__ import annotations

import numpy as np
from lightspec_backend.inputs import GenerateRequest
from lightspec_backend.responses import RequestState, build_response

from lightspec_core import RequestDelta, SamplingParams


def state(stream: bool, exclude: bool = False, **flags) -> RequestState:
    req = GenerateRequest("def f():", SamplingParams(), stream=stream, exclude_input_in_output=exclude, **flags)
    return RequestState("r", req, prompt_text="def f():")


def deltas():
    return [
        RequestDelta(
            "r", [10, 11], "ab", num_prompt_tokens=4, num_output_tokens=2, num_draft_tokens=3, num_accepted_tokens=1
        ),
        RequestDelta("r", [], "", num_prompt_tokens=4, num_output_tokens=2, num_draft_tokens=3, num_accepted_tokens=1),
        RequestDelta(
            "r",
            [12],
            "c",
            finished=True,
            finish_reason="length",
            num_prompt_tokens=4,
            num_output_tokens=3,
            num_draft_tokens=4,
            num_accepted_tokens=3,
        ),
    ]


def text(out) -> str:
    return out["text_output"][0].decode()


def test_streaming_sends_new_tokens_and_skips_empty_deltas():
    s = state(stream=True)
    outs = [build_response(s, d) for d in deltas()]
    assert outs[1] is None
    assert [text(o) for o in (outs[0], outs[2])] == ["ab", "c"]
    assert outs[0]["output_ids"].tolist() == [10, 11] and outs[2]["output_ids"].tolist() == [12]
    assert outs[0]["finish_reason"][0] == b"" and outs[2]["finish_reason"][0] == b"length"
    assert outs[2]["total_draft_tokens"][0] == 4 and outs[2]["total_accepted_draft_tokens"][0] == 3
    assert outs[2]["acceptance_rate"][0] == 0.75
    assert "num_input_tokens" not in outs[2] and "num_output_tokens" not in outs[2]


def test_non_streaming_sends_one_response_with_the_prompt_prepended():
    s = state(stream=False)
    outs = [build_response(s, d) for d in deltas()]
    assert outs[:2] == [None, None]
    assert text(outs[2]) == "def f():abc"
    assert outs[2]["output_ids"].tolist() == [10, 11, 12]


def test_exclude_input_in_output():
    s = state(stream=False, exclude=True)
    assert text([build_response(s, d) for d in deltas()][-1]) == "abc"


def test_token_counts_on_request():
    s = state(stream=True, return_num_input_tokens=True, return_num_output_tokens=True)
    outs = [build_response(s, d) for d in deltas()]
    assert outs[0]["num_input_tokens"][0] == 4 and outs[0]["num_output_tokens"][0] == 2
    assert outs[2]["num_output_tokens"][0] == 1  # tokens in this response
    s = state(stream=False, return_num_output_tokens=True)
    assert [build_response(s, d) for d in deltas()][-1]["num_output_tokens"][0] == 3


def test_final_delta_without_tokens_still_answers():
    s = state(stream=True)
    out = build_response(s, RequestDelta("r", [], "", finished=True, finish_reason="cancelled"))
    assert text(out) == "" and out["finish_reason"][0] == b"cancelled" and out["acceptance_rate"][0] == 0.0


def test_output_dtypes_match_the_model_config():
    from lightspec_backend.tensors import OUTPUT_SPECS

    s = state(stream=True, return_num_input_tokens=True, return_num_output_tokens=True)
    out = build_response(s, deltas()[0])
    for name, arr in out.items():
        assert arr.dtype == OUTPUT_SPECS[name].numpy_dtype, name


def test_only_the_requested_outputs_are_built():
    """A client that names its outputs gets those tensors only, in every streamed response and the
    final one; a client that names none gets all of them."""
    s = state(stream=True, return_num_output_tokens=True)
    s.wanted = frozenset({"output_ids", "finish_reason", "num_output_tokens"})
    outs = [build_response(s, d) for d in deltas()]
    assert outs[1] is None
    assert [sorted(o) for o in (outs[0], outs[2])] == [["finish_reason", "num_output_tokens", "output_ids"]] * 2
    assert outs[0]["output_ids"].tolist() == [10, 11] and outs[2]["finish_reason"][0] == b"length"
    everything = build_response(state(stream=True), deltas()[0])
    assert {
        "text_output",
        "output_ids",
        "finish_reason",
        "total_draft_tokens",
        "total_accepted_draft_tokens",
        "acceptance_rate",
        "acceptance_histogram",
    } == set(everything)


def test_acceptance_histogram_is_the_latest_cumulative_one():
    """The engine's per-request histogram (index j: verify steps that accepted exactly j drafts) is
    cumulative; a delta without one (an error or cancel delta) keeps the last."""
    s = state(stream=True)
    first = build_response(s, RequestDelta("r", [10], "a", num_draft_tokens=2, acceptance_histogram=[1, 1]))
    assert first["acceptance_histogram"].tolist() == [1, 1]
    last = build_response(s, RequestDelta("r", [], "", finished=True, finish_reason="cancelled"))
    assert last["acceptance_histogram"].tolist() == [1, 1]
    assert build_response(state(stream=True), deltas()[0])["acceptance_histogram"].tolist() == []


def test_perf_metrics_become_tensorrt_llm_outputs_with_its_dtypes_only_when_asked():
    perf = (3, 2, 5, 10**18, 10**18 + 1, 10**18 + 2, 10**18 + 3)  # times past 2**32: INT64, not INT32
    delta = RequestDelta("r", [10], "a", num_prompt_tokens=4, num_output_tokens=1, perf=perf)
    out = build_response(state(True), delta)
    got = {
        n: (a.dtype, a.tolist()) for n, a in out.items() if n.startswith(("kv_cache_", "arrival", "first_", "last_"))
    }
    assert got == {
        "kv_cache_alloc_new_blocks": (np.int32, [3]),
        "kv_cache_reused_blocks": (np.int32, [2]),
        "kv_cache_alloc_total_blocks": (np.int32, [5]),
        "arrival_time_ns": (np.int64, [10**18]),
        "first_scheduled_time_ns": (np.int64, [10**18 + 1]),
        "first_token_time_ns": (np.int64, [10**18 + 2]),
        "last_token_time_ns": (np.int64, [10**18 + 3]),
    }
    plain = build_response(state(True), RequestDelta("r", [10], "a", num_prompt_tokens=4, num_output_tokens=1))
    assert not any(n.endswith(("_ns", "_blocks")) for n in plain)
