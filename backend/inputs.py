"""Request tensors -> :class:`GenerateRequest`. Triton-free: the caller passes a ``get(name)`` that
returns the tensor as a numpy array, or ``None`` when the client did not send it.

Every problem is a ``ValueError`` whose message starts with the tensor's name; the backend answers
it with an ``INVALID_ARG`` final response. Triton itself already rejects a wrong datatype or shape
for a declared input before the model sees it; the checks here make the parser safe on its own
(and give the same kind of message when the backend is driven some other way).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from lightspec_core.config import SamplingParams, check_stop_strings

from .tensors import INPUT_SPECS

Getter = Callable[[str], "np.ndarray | None"]


@dataclass
class GenerateRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    exclude_input_in_output: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False


def _check_dtype(name: str, arr: np.ndarray) -> np.ndarray:
    spec = INPUT_SPECS[name]
    arr = np.asarray(arr)
    if spec.triton_type == "STRING":
        ok = arr.dtype == object or arr.dtype.kind in "SU"
    else:
        ok = arr.dtype == spec.numpy_dtype
    if not ok:
        raise ValueError(f"{name}: expected datatype {spec.client_type}, got {arr.dtype}")
    return arr


def _scalar(get: Getter, name: str):
    arr = get(name)
    if arr is None:
        return None
    arr = _check_dtype(name, arr)
    if arr.size != 1:
        raise ValueError(f"{name}: expected exactly one element (shape [1]), got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _decode(name: str, value) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{name}: invalid UTF-8 at byte {e.start}") from None


def _flag(get: Getter, name: str, default: bool = False) -> bool:
    v = _scalar(get, name)
    return default if v is None else bool(v)


def _prompt(get: Getter, vocab_size: int | None) -> str | list[int]:
    text, ids = get("text_input"), get("input_ids")
    if text is not None and ids is not None:
        raise ValueError("text_input: give either text_input or input_ids, not both")
    if text is None and ids is None:
        raise ValueError("text_input: missing prompt (send text_input, or input_ids)")
    if text is not None:
        prompt = _decode("text_input", _scalar(get, "text_input"))
        if not prompt:
            raise ValueError("text_input: the prompt is empty")
        return prompt
    arr = _check_dtype("input_ids", ids).reshape(-1)
    if arr.size == 0:
        raise ValueError("input_ids: the prompt is empty")
    if vocab_size is not None and (arr.min() < 0 or arr.max() >= vocab_size):
        bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
        raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {vocab_size})")
    return [int(t) for t in arr]


def _stop_words(get: Getter) -> list[str]:
    arr = get("stop_words")
    if arr is None:
        return []
    words = [_decode("stop_words", w) for w in _check_dtype("stop_words", arr).reshape(-1)]
    if any(not w for w in words):
        raise ValueError(f"stop_words={words!r}: stop strings must be non-empty")
    check_stop_strings("stop_words", words)
    return words


def parse_request(get: Getter, max_model_len: int | None = None, vocab_size: int | None = None) -> GenerateRequest:
    """Parse and validate one request's tensors. Defaults are documented in :mod:`.tensors`."""
    prompt = _prompt(get, vocab_size)
    kwargs = {}
    for name, cast in (
        ("max_tokens", int),
        ("temperature", float),
        ("top_p", float),
        ("top_k", int),
        ("seed", int),
        ("end_id", int),
        ("priority", int),
        ("num_draft_tokens", int),
    ):
        v = _scalar(get, name)
        if v is not None:
            kwargs[name] = cast(v)
    kwargs["ignore_eos"] = _flag(get, "ignore_eos")
    kwargs["stop"] = _stop_words(get)
    max_tokens = kwargs.get("max_tokens", SamplingParams.max_tokens)
    if max_model_len is not None and max_tokens > max_model_len:
        raise ValueError(f"max_tokens={max_tokens}: exceeds the model's context length ({max_model_len} tokens)")
    params = SamplingParams(**kwargs)  # its ValueErrors already start with the field (= tensor) name
    return GenerateRequest(
        prompt=prompt,
        params=params,
        stream=_flag(get, "stream"),
        exclude_input_in_output=_flag(get, "exclude_input_in_output"),
        return_num_input_tokens=_flag(get, "return_num_input_tokens"),
        return_num_output_tokens=_flag(get, "return_num_output_tokens"),
    )
