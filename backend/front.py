"""The batched front model (``lightspec_batched``): the ``lightspec`` model for batched clients.

TensorRT-LLM clients (its ``ensemble``/``tensorrt_llm_bls`` models have ``max_batch_size > 0``),
Triton's OpenAI frontend for non-vLLM backends and ``genai-perf --backend tensorrtllm`` send every
input with a leading batch dimension (``text_input`` as ``[1, 1]``). Triton checks shapes against
the model config before a model sees a request, so the ``lightspec`` model (``max_batch_size 0``,
vLLM-backend style dims ``[1]``) refuses them; no config accepts both ``[1]`` and ``[1, 1]``.
This model declares the same tensors with ``max_batch_size: 1`` and forwards each request to
``lightspec`` by decoupled BLS, dropping the batch dimension on the way in and adding it back to
every response (streamed responses stream through).

One thread per request iterates its BLS response stream: iterating blocks, and an ``async``
execute would block the event loop shared by every request of this model.
"""

from __future__ import annotations

import threading
import traceback
import uuid

import numpy as np

from .conventions import drop_forwarded_headers, load_parameters, parse_request_parameters, stream_parameter
from .responses import FRONT_REQUEST_PREFIX, inband_error_of
from .tensors import OUTPUTS

OUTPUT_NAMES = [s.name for s in OUTPUTS]


def unbatch(name: str, arr: np.ndarray) -> np.ndarray:
    """``[1, ...]`` -> ``[...]``; raises ``ValueError`` naming the input for another batch size."""
    if arr.ndim == 0 or arr.shape[0] != 1:
        raise ValueError(f"{name}: expected a batch of one (shape [1, ...]), got shape {list(arr.shape)}")
    return arr[0]


def batch(arr: np.ndarray) -> np.ndarray:
    return np.asarray(arr)[None, ...]


def bls_parameters(params: dict | str | None) -> dict[str, bool | int | str]:
    """Request parameters (``request.parameters()``, a JSON object) -> the ``parameters`` dict of
    the BLS request to ``lightspec``, ``stream`` included.

    They are validated here as ``lightspec`` validates them, so an error names them as the client
    sent them. ``pb_utils.InferenceRequest`` takes bool, int and str values only (the stub raises
    otherwise), while gRPC and HTTP clients send doubles: a float travels as its text, which
    ``lightspec`` reads back as the number (:mod:`.conventions` accepts numbers written as strings),
    and a whole float as an int, since an integer field refuses the text ``"8.0"``. ``None`` means
    the default and is left out.
    """
    loaded = load_parameters(params)
    parse_request_parameters(loaded)
    stream_parameter(loaded)
    out: dict[str, bool | int | str] = {}
    for key, value in loaded.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = int(value) if value.is_integer() and abs(value) < 2**63 else repr(value)
        elif not isinstance(value, (bool, int, str)):
            # Triton's gRPC and HTTP parameters are scalars; a list here has no faithful scalar form
            msg = f"{key}={value!r}: a request parameter must be a number, a string or a boolean"
            raise ValueError(msg)  # noqa: TRY004 - a bad request value: INVALID_ARG
        out[key] = value
    return out


def trtllm_inputs(arrays: dict[str, np.ndarray], params: dict) -> dict[str, np.ndarray]:
    """TensorRT-LLM's meaning of its inputs where it differs from the vLLM backend's, which
    ``lightspec`` follows (``arrays``: the unbatched inputs; ``params``: the request parameters):

    - ``top_p <= 0`` is unset (its ``tensorrt_llm`` model drops it);
    - with neither ``top_k > 0`` nor ``top_p`` it decodes greedily whatever the temperature (its
      sampling kernels turn k = 0, p = 0 into k = 1), and its clients send ``temperature`` 1.0 by
      default: the temperature is dropped, and ``lightspec`` decodes greedily as TensorRT-LLM would;
      with one of them and no temperature it samples at its default temperature, 1.0;
    - its streamed responses never carry the prompt, so ``exclude_input_in_output`` false (its
      end-to-end client's default) is dropped when streaming, where ``lightspec`` would refuse it.

    Sampling set by request parameters or ``sampling_parameters`` is the vLLM convention's and left
    as it is."""
    out = dict(arrays)

    def value(name: str):
        arr = out.get(name)
        return None if arr is None or arr.size != 1 else arr.reshape(-1)[0].item()

    top_p = value("top_p")
    if top_p is not None and top_p <= 0:
        del out["top_p"]
    vllm_style = "sampling_parameters" in out or any(k in params for k in ("temperature", "top_k", "top_p"))
    if not vllm_style:
        if (value("top_k") or 0) <= 0 and "top_p" not in out:
            out.pop("temperature", None)
        elif "temperature" not in out:  # TensorRT-LLM's default temperature; lightspec's is 0
            out["temperature"] = np.array([1.0], np.float32)
    streaming = value("stream") if "stream" in out else stream_parameter(params)
    if streaming and value("exclude_input_in_output") is False:
        del out["exclude_input_in_output"]
    return out


def is_last(outputs: dict[str, np.ndarray]) -> bool:
    """``lightspec`` sets ``finish_reason`` on its final data response only."""
    reason = outputs.get("finish_reason")
    return reason is not None and reason.size > 0 and bool(reason.reshape(-1)[0])


class BatchedFront:
    """Forwards batched requests to ``target`` (the ``lightspec`` model). ``pb_utils`` passed in.
    ``forwarded_headers``: the server's header-forwarding pattern; the headers it forwarded as
    request parameters are not sent on (``BackendConfig``)."""

    def __init__(self, pb_utils, target: str, forwarded_headers: str = ""):
        self.pb = pb_utils
        self.target = target
        self.forwarded_headers = forwarded_headers
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()

    def execute(self, requests: list) -> None:
        """Everything a request holds is read here, while Triton keeps it alive; its thread gets
        plain data and the response sender only. Read from the thread after ``execute`` returned, a
        request a client had cancelled crashed the stub (a segfault in libpython) or corrupted the
        server's heap (``malloc(): unaligned tcache chunk``, then SIGABRT) under concurrent cancels."""
        for request in requests:
            sender = request.get_response_sender()
            try:
                bls, wanted = self._bls_request(request)
            except ValueError as e:
                self._fail(sender, str(e), "INVALID_ARG")
                continue
            except Exception as e:  # noqa: BLE001 - every request must end with a final response
                self.pb.Logger.log_error(f"[lightspec] batched front: {traceback.format_exc()}")
                self._fail(sender, f"forwarding to {self.target} failed: {e}", "INTERNAL")
                continue
            t = threading.Thread(target=self._run, args=(bls, wanted, sender), name="lightspec-front", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def finalize(self, timeout_s: float = 30.0) -> None:
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout_s)

    def _run(self, bls, wanted: set[str], sender) -> None:
        try:
            self._forward(bls, wanted, sender)
        except Exception as e:  # noqa: BLE001 - every request must end with a final response
            self.pb.Logger.log_error(f"[lightspec] batched front: {traceback.format_exc()}")
            self._fail(sender, f"forwarding to {self.target} failed: {e}", "INTERNAL")
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())

    def _fail(self, sender, message: str, code: str) -> None:
        err = self.pb.TritonError(message, getattr(self.pb.TritonError, code))
        sender.send(self.pb.InferenceResponse(output_tensors=[], error=err),
                    flags=self.pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL)  # fmt: skip

    def _bls_request(self, request) -> tuple[object, set[str]]:
        """(the BLS request to ``target``, the output names the client wants), from copies of
        everything the request holds."""
        pb = self.pb
        sent = request.parameters() if hasattr(request, "parameters") else None
        sent = drop_forwarded_headers(load_parameters(sent), self.forwarded_headers)
        copies = {t.name(): np.array(unbatch(t.name(), t.as_numpy())) for t in request.inputs()}
        inputs = [pb.Tensor(name, arr) for name, arr in trtllm_inputs(copies, sent).items()]
        wanted = list(request.requested_output_names() or [])
        names = sorted(set(wanted) | {"finish_reason"}) if wanted else OUTPUT_NAMES
        params = bls_parameters(sent)
        kwargs = {"parameters": params} if params else {}
        rid = FRONT_REQUEST_PREFIX + uuid.uuid4().hex  # its errors come in band (see FRONT_REQUEST_PREFIX)
        bls = pb.InferenceRequest(
            model_name=self.target, inputs=inputs, requested_output_names=names, request_id=rid, **kwargs
        )
        return bls, set(wanted or OUTPUT_NAMES)

    def _forward(self, bls, wanted: set[str], sender) -> None:
        """Stream ``target``'s responses to the client, with the batch dimension back. A client
        that cancels gets its final response at once; the request inside runs to its end, its
        responses dropped: Triton 2.51's BLS response iterator cannot cancel (no ``cancel``)."""
        pb = self.pb
        final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        open_ = True
        for response in bls.exec(decoupled=True):
            if not open_:
                continue  # drained: the stream must be read to its end
            if response.has_error():
                sender.send(pb.InferenceResponse(output_tensors=[], error=response.error()), flags=final)
                open_ = False
                continue
            outputs = {t.name(): t.as_numpy() for t in response.output_tensors()}
            if not outputs:
                continue  # the stream's empty final response
            if (error := inband_error_of(outputs)) is not None:
                code, message = error
                err = pb.TritonError(message, getattr(pb.TritonError, code, pb.TritonError.INTERNAL))
                sender.send(pb.InferenceResponse(output_tensors=[], error=err), flags=final)
                open_ = False
                continue
            last = is_last(outputs)
            if sender.is_cancelled():
                sender.send(flags=final)
                open_ = False
                continue
            tensors = [pb.Tensor(n, batch(a)) for n, a in outputs.items() if n in wanted]
            sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final if last else 0)
            open_ = not last
        if open_:
            sender.send(flags=final)
