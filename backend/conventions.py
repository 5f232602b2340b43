"""Request conventions of Triton's vLLM and TensorRT-LLM backends, mapped onto LightSpec's fields.

- vLLM backend: a ``sampling_parameters`` input (a JSON object in a one-element string tensor)
  with vLLM ``SamplingParams`` keys, or the same keys as request parameters (Triton's HTTP
  ``generate`` turns every JSON key that is not a declared input into one). JSON numbers may be
  written as strings (``"0.7"``, ``"64"``) and booleans as ``"true"``/``"false"``, as the vLLM
  backend's own parser coerces them.
- TensorRT-LLM (``ensemble`` / ``tensorrt_llm_bls``): its input tensors, declared in
  :mod:`.tensors`; the ones LightSpec cannot honour are refused here when sent with a value that
  would change the result.

Everything LightSpec does not implement is refused by name (INVALID_ARG) rather than ignored: a
client that asks for a repetition penalty and silently gets none receives a different
distribution than it asked for.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

# vLLM SamplingParams key -> (SamplingParams field, converter). ``num_draft_tokens`` and
# ``priority`` are LightSpec's own, accepted in the same object.
_INT, _FLOAT, _BOOL = "int", "float", "bool"
SAMPLING_KEYS: dict[str, tuple[str, str]] = {
    "max_tokens": ("max_tokens", _INT),
    "temperature": ("temperature", _FLOAT),
    "top_p": ("top_p", _FLOAT),
    "top_k": ("top_k", _INT),
    "seed": ("seed", _INT),
    "stop": ("stop", "stop"),
    "ignore_eos": ("ignore_eos", _BOOL),
    "min_tokens": ("min_tokens", _INT),
    "num_draft_tokens": ("num_draft_tokens", _INT),
    "priority": ("priority", _INT),
    "stream_interval": ("stream_interval", _INT),
}
# vLLM keys accepted only with the value that leaves generation unchanged (None is always fine).
NEUTRAL_KEYS: dict[str, object] = {
    "n": 1,
    "best_of": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
    "stop_token_ids": [],
    "bad_words": [],
    "logprobs": None,
    "prompt_logprobs": None,
    "logit_bias": None,
    "allowed_token_ids": None,
    "truncate_prompt_tokens": None,
    "lora_name": None,
    "guided_decoding": None,
    "structured_outputs": None,
}

# TensorRT-LLM inputs accepted only with their neutral value: tensor name -> neutral value.
TRTLLM_NEUTRAL: dict[str, object] = {
    "beam_width": 1,
    "num_return_sequences": 1,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "return_log_probs": False,
    "return_context_logits": False,
    "return_generation_logits": False,
    "return_cumulative_logprob": False,  # vLLM backend: no log-probabilities are computed
    "return_logprobs": False,
}
# TensorRT-LLM list inputs accepted only when empty.
TRTLLM_EMPTY = ("bad_words", "embedding_bias_words", "embedding_bias_weights")


def _is_int_text(value: str) -> bool:
    return re.fullmatch(r"\s*[+-]?[0-9]+\s*", value) is not None


def coerce(name: str, value, kind: str):
    """One JSON value -> the Python type ``kind``; strings holding numbers or booleans are accepted."""
    if kind == _BOOL:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            return value.strip().lower() == "true"
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ValueError(f"{name}={value!r}: expected true or false")
    if isinstance(value, bool):
        raise ValueError(f"{name}={value!r}: expected a number")  # noqa: TRY004 - a bad request value: INVALID_ARG
    if kind == _INT:
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str) and _is_int_text(value):
            try:
                return int(value)
            except ValueError:  # past Python's 4300-digit limit for int(str)
                raise ValueError(f"{name}: {_shown(value)}: expected an integer") from None
        raise ValueError(f"{name}={value!r}: expected an integer")
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: expected a number") from None
    except OverflowError:  # a JSON integer of hundreds of digits
        raise ValueError(f"{name}: {_shown(value)}: expected a finite number") from None
    if not math.isfinite(out):
        raise ValueError(f"{name}={value!r}: expected a finite number")
    return out


def _shown(value) -> str:
    """A value for an error message, a long one cut (its repr alone can exceed int()'s digit limit)."""
    if isinstance(value, int):  # str() of an int past 4300 digits raises
        return f"an integer of {value.bit_length()} bits"
    text = value if isinstance(value, str) else repr(value)
    return repr(text[:40] + "...") if len(text) > 40 else repr(text)


def _stop(name: str, value) -> list[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ValueError(f"{name}={value!r}: expected a string or a list of strings")
    return items


def _neutral(name: str, value, neutral) -> None:
    if value is None:
        return
    if isinstance(neutral, list):
        ok = isinstance(value, list) and not value
    elif isinstance(neutral, bool):
        ok = coerce(name, value, _BOOL) == neutral
    elif neutral is None:
        ok = False
    else:
        ok = coerce(name, value, _FLOAT) == float(neutral)
    if not ok:
        want = "unset" if neutral is None else json.dumps(neutral)
        raise ValueError(f"{name}={value!r}: not supported by LightSpec (only {want} is accepted)")


def sampling_fields(obj: dict, label: Callable[[str], str]) -> dict:
    """vLLM SamplingParams keys -> SamplingParams keyword arguments. ``label(key)`` is how an error
    names a key (``sampling_parameters.top_k``, or the request parameter ``top_k``)."""
    out = {}
    for key, value in obj.items():
        name = label(key)
        if key in NEUTRAL_KEYS:
            _neutral(name, value, NEUTRAL_KEYS[key])
            continue
        if key not in SAMPLING_KEYS:
            known = ", ".join([*SAMPLING_KEYS, *NEUTRAL_KEYS])
            raise ValueError(f"{name}: unknown key; LightSpec accepts {known}")
        if value is None:  # as in vLLM: the default, and for max_tokens the rest of the context
            if key == "max_tokens":
                out["max_tokens"] = None
            continue
        field, kind = SAMPLING_KEYS[key]
        v = _stop(name, value) if kind == "stop" else coerce(name, value, kind)
        if key == "top_k" and v == -1:  # vLLM's spelling of "off"
            v = 0
        out[field] = v
    return out


def parse_sampling_parameters(text: str) -> dict:
    """The ``sampling_parameters`` tensor's JSON -> SamplingParams keyword arguments."""
    try:
        obj = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"sampling_parameters: invalid JSON ({e.msg} at character {e.pos})") from None
    except (ValueError, RecursionError) as e:  # a number past int()'s digit limit; nesting too deep
        raise ValueError(f"sampling_parameters: invalid JSON ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"sampling_parameters: expected a JSON object, got {type(obj).__name__}")  # noqa: TRY004
    return sampling_fields(obj, lambda k: f"sampling_parameters: {k}")


def load_parameters(params: dict | str | None) -> dict:
    """Request parameters as Triton hands them to a Python model (a JSON object string) -> dict."""
    if not params:
        return {}
    if isinstance(params, str):
        params = json.loads(params) if params.strip() else {}
    return dict(params)


def parse_request_parameters(params: dict | str | None, forwarded: str = "") -> dict:
    """Request parameters (``request.parameters()``) -> SamplingParams keyword arguments. Over
    HTTP ``generate`` these are the body's keys that are not inputs (and the keys of its
    ``"parameters"`` object), so an unknown key here is most often a misspelt input: it is refused,
    naming it, unless ``forwarded`` matches it (:func:`drop_forwarded_headers`). ``stream`` is read
    by the caller (:func:`stream_parameter`)."""
    params = drop_forwarded_headers(load_parameters(params), forwarded)
    params.pop("stream", None)
    return sampling_fields(params, lambda k: k)


def drop_forwarded_headers(params: dict, pattern: str) -> dict:
    """``params`` without the headers tritonserver forwarded as request parameters: the keys that
    ``pattern`` (the server's ``--grpc-header-forward-pattern`` / ``--http-header-forward-pattern``)
    matches, as it matches header names, and that LightSpec does not read. A sampling key it would
    match is still read: a broad pattern must not turn a client's ``temperature`` into a header."""
    if not pattern:
        return params
    known = {*SAMPLING_KEYS, *NEUTRAL_KEYS, "stream"}
    return {k: v for k, v in params.items() if k in known or re.search(pattern, k) is None}


def stream_parameter(params: dict | str | None) -> bool | None:
    """The ``stream`` request parameter (vLLM backend examples send ``"parameters": {"stream": false}``)."""
    value = load_parameters(params).get("stream")
    return None if value is None else coerce("stream", value, _BOOL)


def check_trtllm_neutral(name: str, value) -> None:
    """Refuse a TensorRT-LLM input that LightSpec cannot honour unless it has its neutral value."""
    neutral = TRTLLM_NEUTRAL[name]
    if isinstance(neutral, bool):
        if bool(value) != neutral:
            raise ValueError(f"{name}={bool(value)}: not supported by LightSpec (only {str(neutral).lower()})")
    elif float(value) != float(neutral):
        shown = f"{float(value):.6g}" if isinstance(neutral, float) else str(value)  # FP32 tensors: no float noise
        raise ValueError(f"{name}={shown}: not supported by LightSpec (only {neutral})")
