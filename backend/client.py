"""Small tritonclient helpers for the ``lightspec`` model (used by the CLI, tests and benchmarks)."""

from __future__ import annotations

import numpy as np

from .tensors import INPUT_SPECS


def input_array(name: str, value) -> np.ndarray:
    """A request tensor with the datatype and shape the model declares: scalars become shape [1],
    strings are UTF-8 encoded (bytes pass through, so tests can send invalid UTF-8)."""
    spec = INPUT_SPECS[name]
    values = list(value) if isinstance(value, (list, tuple, np.ndarray)) else [value]
    if spec.triton_type == "STRING":
        return np.array([v.encode("utf-8") if isinstance(v, str) else v for v in values], dtype=object)
    return np.array(values, dtype=spec.numpy_dtype)


def grpc_inputs(**tensors) -> list:
    """``grpc_inputs(text_input="def f():", max_tokens=8, stream=True)`` -> ``list[InferInput]``."""
    import tritonclient.grpc as grpcclient

    return infer_inputs(tensors, grpcclient.InferInput)


def infer_inputs(tensors: dict[str, object], infer_input) -> list:
    """The ``infer_input`` class's objects (``tritonclient.grpc``'s, ``.grpc.aio``'s, ``.http``'s)
    with the datatypes and shapes the model declares."""
    out = []
    for name, value in tensors.items():
        arr = input_array(name, value)
        t = infer_input(name, list(arr.shape), INPUT_SPECS[name].client_type)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def is_final(result) -> bool:
    """Whether a gRPC stream result is the request's last response (``enable_empty_final_response``)."""
    p = result.get_response().parameters.get("triton_final_response")
    return bool(p is not None and p.bool_param)
