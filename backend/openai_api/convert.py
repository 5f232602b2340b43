"""OpenAI requests -> the ``lightspec`` model's tensors, and its responses -> OpenAI objects.

Defaults follow OpenAI: ``temperature`` 1, ``top_p`` 1, ``max_tokens`` 16 for completions; a chat
without a length generates to the end of the context, as in vLLM. Values are checked with the engine's own
``SamplingParams`` before anything reaches Triton, so a bad value is a 400 naming the field.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from lightspec_core.config import SamplingParams

from ..tensors import INPUT_SPECS
from .errors import OpenAIError, field_of
from .protocol import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest
from .triton import Chunk


def _length(req: CompletionRequest | ChatCompletionRequest) -> tuple[str, int] | None:
    if isinstance(req, ChatCompletionRequest):
        return req.length_limit
    return "max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens


def renamed_fields(req: CompletionRequest | ChatCompletionRequest) -> dict[str, str]:
    """The fields this request names otherwise than a completion does, for errors to name what the
    client sent (see :func:`.errors.field_of`)."""
    if not isinstance(req, ChatCompletionRequest):
        return {}
    length = req.length_limit
    return {"prompt": "messages"} | ({"max_tokens": length[0]} if length else {})


def _check_values(tensors: dict[str, object], stop: list[str], renamed: dict[str, str]) -> None:
    """The engine's own checks (``SamplingParams``), as a 400 naming the field."""
    try:
        SamplingParams(**{k: v for k, v in tensors.items() if k != "stop_words"}, stop=stop)
    except ValueError as e:
        name = field_of(str(e).split("=")[0].split(":")[0].strip(), renamed)
        raise OpenAIError(str(e) if str(e).startswith(name) else f"{name}: {e}", param=name) from None


def _check_ranges(tensors: dict[str, object], renamed: dict[str, str]) -> None:
    """A 400 naming the field for an integer its tensor's datatype cannot hold: numpy would wrap it
    silently (``top_k=2**32+5`` becomes 5) or fail the request with a 500."""
    for name, value in tensors.items():
        spec = INPUT_SPECS[name]
        if spec.numpy_dtype.kind not in "iu":
            continue
        info = np.iinfo(spec.numpy_dtype)
        bad = [v for v in (value if isinstance(value, list) else [value]) if not info.min <= v <= info.max]
        if bad:
            field = field_of(name, renamed)
            what = f"{field}: {bad[0]}" if isinstance(value, list) else f"{field}={bad[0]}"
            raise OpenAIError(
                f"{what}: out of range (the {name} tensor is {spec.triton_type}, {info.min} to {info.max})", param=field
            )


def sampling_tensors(req: CompletionRequest | ChatCompletionRequest) -> dict[str, object]:
    """The request's sampling tensors, validated; raises a 400 naming the OpenAI field."""
    req.refuse_unsupported()
    tensors: dict[str, object] = {
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "top_p": 1.0 if req.top_p is None else req.top_p,
    }
    length = _length(req)
    if length is not None:
        tensors["max_tokens"] = length[1]
    for name in ("top_k", "seed", "num_draft_tokens", "priority", "ignore_eos", "stream_interval", "min_tokens"):
        if getattr(req, name) is not None:
            tensors[name] = getattr(req, name)
    if tensors.get("top_k") == -1:  # vLLM's "off", which many clients send; the backend's vLLM convention agrees
        tensors["top_k"] = 0
    if -(1 << 63) <= tensors.get("seed", 0) < 0:  # vLLM takes any int64: the same 64 bits as a UINT64
        tensors["seed"] += 1 << 64
    if req.stop_list:
        tensors["stop_words"] = req.stop_list
    renamed = renamed_fields(req)
    _check_values(tensors, req.stop_list, renamed)
    _check_ranges(tensors, renamed)
    return tensors


def request_tensors(prompt: str | list[int], req: CompletionRequest | ChatCompletionRequest) -> dict[str, object]:
    """Every tensor of the Triton request for ``prompt`` (text, or token ids; a text prompt carries
    the request's ``add_special_tokens``, which token ids ignore)."""
    if isinstance(prompt, str):
        tensors: dict[str, object] = {"text_input": prompt, "add_special_tokens": req.add_special_tokens}
    else:
        tensors = {"input_ids": prompt}
    _check_ranges(tensors, renamed_fields(req))
    tensors |= sampling_tensors(req)
    if "max_tokens" not in tensors:  # a chat without a length: the rest of the context, as vLLM's
        tensors["sampling_parameters"] = '{"max_tokens": null}'
    tensors |= {
        "stream": bool(req.stream),
        "exclude_input_in_output": True,
        "return_num_input_tokens": True,
        "return_num_output_tokens": True,
    }
    return tensors


def choice_tensors(tensors: dict[str, object], j: int) -> dict[str, object]:
    """The tensors of a prompt's ``j``-th choice (``n``): a seeded request's choice j has seed + j,
    as vLLM seeds it, so that its choices differ and each is reproducible."""
    if j == 0 or "seed" not in tensors:
        return tensors
    return tensors | {"seed": (tensors["seed"] + j) % (1 << 64)}


def finish_reason(reason: str) -> str | None:
    """OpenAI's finish reason for LightSpec's (``length``, ``stop``; others are not OpenAI's)."""
    return reason if reason in ("length", "stop") else (reason or None)


@dataclass
class Accumulator:
    """What one request's responses add up to: text, counts and speculation totals."""

    text: list[str] = field(default_factory=list)
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)

    def add(self, chunk: Chunk) -> None:
        self.text.append(chunk.text)
        self.finish_reason = chunk.finish_reason or self.finish_reason
        self.prompt_tokens = max(self.prompt_tokens, chunk.num_input_tokens or 0)
        self.completion_tokens += chunk.num_output_tokens or 0
        self.num_draft_tokens = max(self.num_draft_tokens, chunk.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, chunk.num_accepted_tokens)
        if chunk.acceptance_histogram:
            self.acceptance_histogram = chunk.acceptance_histogram

    @classmethod
    def total(cls, accs: list[Accumulator], n: int) -> Accumulator:
        """What a request's choices add up to; ``n`` choices share each prompt, counted once."""
        out = cls(prompt_tokens=sum(a.prompt_tokens for a in accs[::n]))
        for a in accs:
            out.completion_tokens += a.completion_tokens
            out.num_draft_tokens += a.num_draft_tokens
            out.num_accepted_tokens += a.num_accepted_tokens
            hist = out.acceptance_histogram
            hist.extend([0] * (len(a.acceptance_histogram) - len(hist)))
            for j, v in enumerate(a.acceptance_histogram):
                hist[j] += v
        return out

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }

    def metrics(self) -> dict:
        """Per-request speculative-decoding statistics in vLLM's ``metrics.speculative_decoding``
        form (vLLM's ``--per-request-spec-decode-metrics summary``, which aiperf reads).
        ``acceptance_histogram[j]``: verify steps that accepted exactly j drafts, so the steps are
        its sum. ``num_spec_tokens`` (vLLM's fixed k) is left out: LightSpec's k varies per step."""
        hist = list(self.acceptance_histogram) or [0]
        steps = sum(hist)
        rate = self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
        return {
            "speculative_decoding": {
                "mean_acceptance_length": 1.0 + self.num_accepted_tokens / steps if steps else 1.0,
                "draft_acceptance_rate": rate,
                "acceptance_histogram": hist,
                "num_spec_steps": steps,
                "num_accepted_draft_tokens": self.num_accepted_tokens,
                "num_draft_tokens": self.num_draft_tokens,
            }
        }


def new_id(endpoint: str) -> str:
    return ("chatcmpl-" if endpoint == "chat" else "cmpl-") + uuid.uuid4().hex


def envelope(endpoint: str, rid: str, model: str, created: int | None = None, chunk: bool = False) -> dict:
    obj = "chat.completion.chunk" if chunk else "chat.completion"
    return {
        "id": rid,
        "object": obj if endpoint == "chat" else "text_completion",
        "created": created or int(time.time()),
        "model": model,
    }


def choice(
    endpoint: str, text: str, reason: str | None, delta: bool = False, first: bool = False, index: int = 0
) -> dict:
    """One ``choices`` entry: a text completion's, a chat message, or a chat stream delta."""
    if endpoint != "chat":
        return {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
    if delta:
        d = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
        return {"index": index, "delta": d, "logprobs": None, "finish_reason": reason}
    message = {"role": "assistant", "content": text}
    return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}


def full_response(endpoint: str, rid: str, model: str, accs: list[Accumulator], n: int) -> dict:
    """A non-streamed answer: choice i is prompt i // n's (i % n)-th."""
    body = envelope(endpoint, rid, model)
    body["choices"] = [
        choice(endpoint, "".join(a.text), finish_reason(a.finish_reason), index=i) for i, a in enumerate(accs)
    ]
    total = Accumulator.total(accs, n)
    body["usage"] = total.usage()
    body["metrics"] = total.metrics()
    return body
