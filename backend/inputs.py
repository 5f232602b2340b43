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

from .conventions import (
    TRTLLM_EMPTY,
    TRTLLM_NEUTRAL,
    check_trtllm_neutral,
    parse_request_parameters,
    parse_sampling_parameters,
    stream_parameter,
)
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
    prompt_name: str = "text_input"  # the input that carried the prompt, for error messages
    add_special_tokens: bool = True  # encode a text prompt with the tokenizer's BOS


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
    """A one-element input: shape [1] (this model's dims) or [1, 1] (a batched client's)."""
    arr = get(name)
    if arr is None:
        return None
    arr = _check_dtype(name, arr)
    if arr.size != 1:
        raise ValueError(f"{name}: expected exactly one element (shape [1] or [1, 1]), got shape {list(arr.shape)}")
    return arr.reshape(-1)[0]


def _vector(name: str, arr: np.ndarray) -> np.ndarray:
    """A list input: shape [N], or [1, N] from a batched client."""
    arr = _check_dtype(name, arr)
    if arr.ndim > 2 or (arr.ndim == 2 and arr.shape[0] != 1):
        raise ValueError(f"{name}: expected shape [N] or [1, N], got shape {list(arr.shape)}")
    return arr.reshape(-1)


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
    arr = _vector("input_ids", ids)
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
    # TensorRT-LLM clients send "" for "no stop words", and its preprocessing skips a word that
    # encodes to nothing
    words = [w for w in (_decode("stop_words", w) for w in _vector("stop_words", arr)) if w]
    check_stop_strings("stop_words", words)
    return words


# (tensor, SamplingParams field, cast): the inputs that set a sampling field; two names of one
# field (LightSpec's or vLLM's and TensorRT-LLM's) may not both be sent.
_FIELD_TENSORS = (
    ("max_tokens", "max_tokens", int),
    ("temperature", "temperature", float),
    ("top_p", "top_p", float),
    ("top_k", "top_k", int),
    ("seed", "seed", int),
    ("random_seed", "seed", int),
    ("end_id", "end_id", int),
    ("priority", "priority", int),
    ("num_draft_tokens", "num_draft_tokens", int),
    ("min_tokens", "min_tokens", int),
    ("min_length", "min_tokens", int),
    ("ignore_eos", "ignore_eos", bool),
    ("stream_interval", "stream_interval", int),
    ("return_perf_metrics", "return_perf_metrics", bool),
)


def _tensor_fields(get: Getter) -> tuple[dict, dict[str, str]]:
    """SamplingParams keyword arguments from the input tensors, and the input that set each."""
    kwargs: dict = {}
    origin: dict[str, str] = {}
    for name, field, cast in _FIELD_TENSORS:
        v = _scalar(get, name)
        if v is None:
            continue
        if field in origin:
            raise ValueError(f"{name}: give either {origin[field]} or {name}, not both")
        kwargs[field], origin[field] = cast(v), name
    if kwargs.get("top_k") == -1:  # vLLM's spelling of "off" (HTTP generate's top_k key is this input)
        kwargs["top_k"] = 0
    stop = _stop_words(get)
    if stop:
        kwargs["stop"], origin["stop"] = stop, "stop_words"
    return kwargs, origin


def _refuse_unsupported(get: Getter) -> None:
    """TensorRT-LLM and vLLM-backend inputs LightSpec cannot honour, unless neutral or empty."""
    for name in TRTLLM_NEUTRAL:
        v = _scalar(get, name)
        if v is not None:
            check_trtllm_neutral(name, v)
    for name in TRTLLM_EMPTY:
        arr = get(name)
        if arr is not None and any(_is_set(v) for v in _vector(name, arr)):  # "" or [] means none, as in TRT-LLM
            raise ValueError(f"{name}: not supported by LightSpec (send it empty or not at all)")


def _is_set(value) -> bool:
    return bool(value) if isinstance(value, (bytes, str)) else True


def _merge(kwargs: dict, origin: dict[str, str], extra: dict, source: str) -> None:
    for field, value in extra.items():
        if field in origin:
            raise ValueError(f"{source}: {field} is also given by {origin[field]}; give it once")
        kwargs[field], origin[field] = value, f"{source}: {field}"


def _end_id_replaces_eos(kwargs: dict, origin: dict[str, str]) -> None:
    """TensorRT-LLM's ``end_id`` is the one token that ends the output, in place of the tokenizer's
    EOS, and -1 means none ends it. ``ignore_eos`` false, sent with it, keeps EOS ending the output
    too; with -1 that contradicts it. After the merges: ``ignore_eos`` may come from any source."""
    if "end_id" not in kwargs:
        return
    keep_eos = kwargs.get("ignore_eos") is False
    if kwargs["end_id"] == -1:
        if keep_eos:
            name = origin.get("ignore_eos", "ignore_eos")
            raise ValueError(f"end_id=-1: means no end token, and {name}=false asks for one; send either")
        del kwargs["end_id"]
    if not keep_eos:
        kwargs["ignore_eos"] = True


def _sampling_params(kwargs: dict, origin: dict[str, str]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:  # SamplingParams names its field; name the input the client sent instead
        msg = str(e)
        field = msg.split("=", 1)[0].split(":", 1)[0]
        name = origin.get(field, field)
        raise ValueError(name + msg[len(field) :] if msg.startswith(field) else msg) from None


def parse_request(
    get: Getter,
    max_model_len: int | None = None,
    vocab_size: int | None = None,
    parameters: dict | str | None = None,
    forwarded_headers: str = "",
) -> GenerateRequest:
    """Parse and validate one request's tensors and request parameters (see :mod:`.conventions`).
    Defaults are documented in :mod:`.tensors`. A sampling field given twice (as a tensor, in
    ``sampling_parameters``, as a request parameter) is refused: no precedence rule to guess.
    ``forwarded_headers``: the server's header-forwarding pattern (``BackendConfig``)."""
    prompt = _prompt(get, vocab_size)
    kwargs, origin = _tensor_fields(get)
    _refuse_unsupported(get)
    text = _scalar(get, "sampling_parameters")
    if text is not None:
        _merge(kwargs, origin, parse_sampling_parameters(_decode("sampling_parameters", text)), "sampling_parameters")
    _merge(kwargs, origin, parse_request_parameters(parameters, forwarded_headers), "parameter")
    _end_id_replaces_eos(kwargs, origin)
    kwargs.setdefault("ignore_eos", False)
    max_tokens = kwargs.get("max_tokens", SamplingParams.max_tokens)
    if max_model_len is not None and max_tokens is not None and max_tokens > max_model_len:
        name = origin.get("max_tokens", "max_tokens")
        raise ValueError(f"{name}={max_tokens}: exceeds the model's context length ({max_model_len} tokens)")
    params = _sampling_params(kwargs, origin)
    stream = _stream(get, parameters)
    exclude = _scalar(get, "exclude_input_in_output")
    if stream and exclude is not None and not exclude:
        # vLLM's backend refuses it too: streamed responses carry only the new text
        raise ValueError("exclude_input_in_output=False: not supported when streaming; send true or leave it out")
    return GenerateRequest(
        prompt=prompt,
        params=params,
        stream=stream,
        exclude_input_in_output=bool(exclude),
        return_num_input_tokens=_flag(get, "return_num_input_tokens"),
        return_num_output_tokens=_flag(get, "return_num_output_tokens"),
        prompt_name="text_input" if isinstance(prompt, str) else "input_ids",
        add_special_tokens=_flag(get, "add_special_tokens", default=True),
    )


def _stream(get: Getter, parameters: dict | str | None) -> bool:
    tensor, param = _scalar(get, "stream"), stream_parameter(parameters)
    if tensor is not None and param is not None:
        raise ValueError("stream: given both as an input and as a request parameter; give it once")
    return bool(tensor) if tensor is not None else bool(param)


def request_parameters(request) -> str | None:
    """The request's parameters as JSON (HTTP ``generate`` puts the body's non-input keys there)."""
    get = getattr(request, "parameters", None)
    return get() if get is not None else None


def requested_outputs(request) -> frozenset[str] | None:
    """The output names a request asked for; ``None`` (all of them) when it named none."""
    names = request.requested_output_names()
    return frozenset(names) if names else None


def name_prompt_error(request: GenerateRequest, error: ValueError) -> str:
    """The engine names a prompt problem ``prompt: ...``; the client sent ``text_input`` or ``input_ids``."""
    msg = str(error)
    return request.prompt_name + msg[len("prompt") :] if msg.startswith("prompt:") else msg
