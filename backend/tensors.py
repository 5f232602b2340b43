"""The orchestrator model's tensors (the user contract), in one table.

The same table generates the ``input``/``output`` sections of ``lightspec/config.pbtxt``
(:mod:`lightspec_backend.repository`), drives request parsing (:mod:`lightspec_backend.inputs`) and
response building (:mod:`lightspec_backend.responses`), and is printed in the README. Names follow
the TensorRT-LLM BLS and vLLM backends so existing clients fit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class TensorSpec:
    name: str
    triton_type: str  # config.pbtxt data_type without the TYPE_ prefix
    dims: tuple[int, ...]
    optional: bool = True
    doc: str = ""

    @property
    def numpy_dtype(self) -> np.dtype:
        return np.dtype(TRITON_TO_NUMPY[self.triton_type])

    @property
    def client_type(self) -> str:
        """The datatype name the Triton clients use (``BYTES`` for ``TYPE_STRING``)."""
        return "BYTES" if self.triton_type == "STRING" else self.triton_type


TRITON_TO_NUMPY = {
    "STRING": object,
    "BOOL": np.bool_,
    "INT32": np.int32,
    "INT64": np.int64,
    "UINT32": np.uint32,
    "UINT64": np.uint64,
    "FP32": np.float32,
}

INPUTS = [
    TensorSpec("text_input", "STRING", (1,), doc="prompt, UTF-8 (give this or `input_ids`)"),
    TensorSpec("input_ids", "INT64", (-1,), doc="prompt as token ids (give this or `text_input`)"),
    TensorSpec(
        "add_special_tokens",
        "BOOL",
        (1,),
        doc="default true: `text_input` gets the tokenizer's BOS, as in "
        "transformers and vLLM; false for a rendered chat template, which holds it already",
    ),
    TensorSpec(
        "max_tokens", "INT32", (1,), doc="tokens to generate, default 64; prompt + max_tokens must fit the context"
    ),
    TensorSpec(
        "stream", "BOOL", (1,), doc="default false: one response; true: one response per step with the new tokens"
    ),
    TensorSpec("temperature", "FP32", (1,), doc="default 0 (greedy); a finite number >= 0, at most float32's largest"),
    TensorSpec("top_p", "FP32", (1,), doc="default 1; in (0, 1]"),
    TensorSpec("top_k", "INT32", (1,), doc="default 0 (off); >= 0, or -1: off (vLLM's spelling)"),
    TensorSpec(
        "seed", "UINT64", (1,), doc="per-request sampling seed; default derived from the engine seed and the request"
    ),
    TensorSpec(
        "stop_words",
        "STRING",
        (-1,),
        doc="stop strings; the text ends before the first match; empty entries are "
        "skipped, as TensorRT-LLM's preprocessing skips them",
    ),
    TensorSpec(
        "end_id",
        "INT32",
        (1,),
        doc="the end token id in place of the tokenizer's EOS, as in TensorRT-LLM (with ignore_eos "
        "false, beside it), in [0, vocabulary size); -1: no end token (refused with ignore_eos false)",
    ),
    TensorSpec(
        "ignore_eos", "BOOL", (1,), doc="default false; true keeps generating past the tokenizer's EOS (benchmarks)"
    ),
    TensorSpec(
        "exclude_input_in_output",
        "BOOL",
        (1,),
        doc="default false: non-streaming `text_output` starts with the prompt; "
        "false with streaming is refused (`lightspec_batched` accepts it, as TensorRT-LLM: streams carry new text only)",
    ),
    TensorSpec("priority", "INT32", (1,), doc="default 0; higher is admitted first and preempted last"),
    TensorSpec(
        "num_draft_tokens", "INT32", (1,), doc="per-request cap on draft tokens per step; 0 disables speculation"
    ),
    TensorSpec("return_num_input_tokens", "BOOL", (1,), doc="default false; true adds `num_input_tokens`"),
    TensorSpec("return_num_output_tokens", "BOOL", (1,), doc="default false; true adds `num_output_tokens`"),
    TensorSpec(
        "min_tokens", "INT32", (1,), doc="default 0; EOS, `end_id` and stop strings cannot end the output earlier"
    ),
    TensorSpec(
        "stream_interval",
        "INT32",
        (1,),
        doc="streamed responses carry at least this many new tokens, "
        "the first and the last excepted; raises the model's `stream_interval`, never lowers it",
    ),
    # -- the vLLM backend's convention (see :mod:`.conventions`)
    TensorSpec("sampling_parameters", "STRING", (1,), doc="vLLM backend: JSON object of vLLM SamplingParams keys"),
    TensorSpec("return_finish_reason", "BOOL", (1,), doc="vLLM backend: accepted; `finish_reason` is always sent"),
    TensorSpec("return_cumulative_logprob", "BOOL", (1,), doc="vLLM backend: only false (no log-probabilities)"),
    TensorSpec("return_logprobs", "BOOL", (1,), doc="vLLM backend: only false (no log-probabilities)"),
    # -- TensorRT-LLM's convention (ensemble / tensorrt_llm_bls inputs)
    TensorSpec("random_seed", "UINT64", (1,), doc="TensorRT-LLM name of `seed`"),
    TensorSpec("min_length", "INT32", (1,), doc="TensorRT-LLM name of `min_tokens`"),
    TensorSpec("pad_id", "INT32", (1,), doc="TensorRT-LLM: accepted and unused (outputs are never padded)"),
    TensorSpec("bad_words", "STRING", (-1,), doc="TensorRT-LLM: only empty"),
    TensorSpec("beam_width", "INT32", (1,), doc="TensorRT-LLM: only 1"),
    TensorSpec("num_return_sequences", "INT32", (1,), doc="TensorRT-LLM: only 1"),
    TensorSpec("repetition_penalty", "FP32", (1,), doc="only 1"),
    TensorSpec("presence_penalty", "FP32", (1,), doc="only 0"),
    TensorSpec("frequency_penalty", "FP32", (1,), doc="only 0"),
    TensorSpec("length_penalty", "FP32", (1,), doc="TensorRT-LLM: accepted; it only affects beam search"),
    TensorSpec("return_log_probs", "BOOL", (1,), doc="TensorRT-LLM: only false"),
    TensorSpec("return_context_logits", "BOOL", (1,), doc="TensorRT-LLM: only false"),
    TensorSpec("return_generation_logits", "BOOL", (1,), doc="TensorRT-LLM: only false"),
    TensorSpec("embedding_bias_words", "STRING", (-1,), doc="TensorRT-LLM: only empty"),
    TensorSpec("embedding_bias_weights", "FP32", (-1,), doc="TensorRT-LLM: only empty"),
    TensorSpec(
        "return_perf_metrics",
        "BOOL",
        (1,),
        doc="TensorRT-LLM: default false; true adds the `kv_cache_*` and `*_time_ns` outputs to every response",
    ),
]

PERF_BLOCK_OUTPUTS = (
    ("kv_cache_alloc_new_blocks", "KV blocks allocated for the request: those its tokens hold beyond the reused"),
    ("kv_cache_reused_blocks", "KV blocks the prefix cache supplied at the request's admission"),
    ("kv_cache_alloc_total_blocks", "KV blocks allocated for it in all (TensorRT-LLM's count: the reused excluded)"),
)
PERF_TIME_OUTPUTS = (  # CLOCK_MONOTONIC, as TensorRT-LLM's steady clock; 0 while not yet
    ("arrival_time_ns", "when the server took the request, ns of CLOCK_MONOTONIC (TensorRT-LLM's steady clock)"),
    ("first_scheduled_time_ns", "when a step first computed the request (0: not yet), same clock"),
    ("first_token_time_ns", "when its first token was generated (0: not yet), same clock"),
    ("last_token_time_ns", "when its latest token was generated (0: not yet), same clock"),
)
PERF_OUTPUTS = tuple(name for name, _ in PERF_BLOCK_OUTPUTS + PERF_TIME_OUTPUTS)  # RequestDelta.perf's order

OUTPUTS = [
    TensorSpec("text_output", "STRING", (-1,), doc="new text (streaming) or the whole completion"),
    TensorSpec("output_ids", "INT64", (-1,), doc="new token ids (streaming) or all generated ids; never the prompt"),
    TensorSpec(
        "finish_reason", "STRING", (-1,), doc="`length`, `stop` or `cancelled` on the final response, else empty"
    ),
    TensorSpec("num_input_tokens", "UINT32", (1,), doc="prompt length (only with `return_num_input_tokens`)"),
    TensorSpec(
        "num_output_tokens", "UINT32", (1,), doc="tokens in this response (only with `return_num_output_tokens`)"
    ),
    TensorSpec("total_draft_tokens", "INT32", (1,), doc="draft tokens proposed for this request so far"),
    TensorSpec("total_accepted_draft_tokens", "INT32", (1,), doc="of which the target accepted"),
    TensorSpec("acceptance_rate", "FP32", (1,), doc="accepted / proposed (0 when nothing was proposed)"),
    TensorSpec(
        "acceptance_histogram", "INT32", (-1,), doc="[j]: verify steps of this request that accepted exactly j drafts"
    ),
    # TensorRT-LLM's request perf metrics, only with `return_perf_metrics`, each as of this response
    *(TensorSpec(name, "INT32", (1,), doc=doc) for name, doc in PERF_BLOCK_OUTPUTS),
    *(TensorSpec(name, "INT64", (1,), doc=doc) for name, doc in PERF_TIME_OUTPUTS),
]

INPUT_SPECS = {s.name: s for s in INPUTS}
OUTPUT_SPECS = {s.name: s for s in OUTPUTS}
