"""The batched front's shape handling and the request parameters it forwards (the forwarding
itself runs in tests/e2e/test_conventions.py)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
from lightspec_backend.conventions import parse_request_parameters, stream_parameter
from lightspec_backend.front import BatchedFront, batch, bls_parameters, is_last, trtllm_inputs, unbatch

from tests.fakes import FakePbUtils, FakeResponse, FakeSender, FakeTensor


def test_unbatch_drops_a_batch_of_one_and_refuses_others_by_name():
    assert unbatch("text_input", np.array([[b"x"]], dtype=object)).shape == (1,)
    assert unbatch("input_ids", np.array([[1, 2, 3]], np.int64)).tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^max_tokens: expected a batch of one"):
        unbatch("max_tokens", np.array([[1], [2]], np.int32))


def test_batch_adds_the_dimension_and_the_final_response_is_the_one_with_a_finish_reason():
    assert batch(np.array([5, 6], np.int64)).shape == (1, 2)
    assert not is_last({"finish_reason": np.array([b""], dtype=object)})
    assert is_last({"finish_reason": np.array([b"length"], dtype=object)})
    assert not is_last({"text_output": np.array([b"x"], dtype=object)})


def test_bls_parameters_hold_only_stub_types_and_lightspec_reads_them_as_sent():
    sent = json.dumps({"temperature": 0.5, "max_tokens": 8.0, "min_p": 0.0, "seed": 3, "stop": "ss",
                       "n": 1, "stream": True, "logprobs": None})  # fmt: skip
    forwarded = bls_parameters(sent)
    assert all(type(v) in (bool, int, str) for v in forwarded.values()), forwarded
    assert forwarded["temperature"] == "0.5" and forwarded["max_tokens"] == 8 and "logprobs" not in forwarded
    assert parse_request_parameters(forwarded) == parse_request_parameters(sent)
    assert stream_parameter(forwarded) is True


def test_stream_alone_is_forwarded():
    assert bls_parameters('{"stream": true}') == {"stream": True}
    assert bls_parameters("") == bls_parameters(None) == {}


def test_bls_parameters_are_validated_as_lightspec_validates_them():
    with pytest.raises(ValueError, match=r"^temprature: unknown key"):
        bls_parameters('{"temprature": 0.5}')
    with pytest.raises(ValueError, match=r"^stream='maybe': expected true or false"):
        bls_parameters('{"stream": "maybe"}')
    with pytest.raises(ValueError, match=r"^stop=\['x'\]: a request parameter must be"):
        bls_parameters({"stop": ["x"]})


class BatchedRequest:
    """A request as the stub hands it to the front: ``inputs()`` and ``parameters()`` (JSON)."""

    def __init__(self, parameters: str):
        self._parameters = parameters

    def inputs(self) -> list[FakeTensor]:
        return [FakeTensor("text_input", np.array([[b"x"]], dtype=object))]

    def requested_output_names(self) -> list[str]:
        return []

    def parameters(self) -> str:
        return self._parameters


def test_bls_request_carries_the_parameters_in_the_form_the_stub_accepts():
    pb, seen = FakePbUtils(), {}
    make = pb.InferenceRequest  # checks parameters as the stub does
    pb.InferenceRequest = lambda *args, **kwargs: seen.update(kwargs) or make(*args, **kwargs)
    bls, _ = BatchedFront(pb, "lightspec")._bls_request(BatchedRequest('{"stream": true, "temperature": 0.5}'))
    assert bls.model_name == "lightspec" and bls.inputs["text_input"].as_numpy().shape == (1,)
    assert seen["parameters"] == {"stream": True, "temperature": "0.5"}


def _arrays(**values) -> dict[str, np.ndarray]:
    dtypes = {bool: np.bool_, int: np.int32, float: np.float32}
    return {k: np.array([v], dtypes[type(v)]) for k, v in values.items()}


def _sampling(arrays: dict[str, np.ndarray]) -> dict:
    return {k: a.item() for k, a in arrays.items() if k in ("temperature", "top_k", "top_p")}


def test_trtllm_temperature_without_top_k_or_top_p_decodes_greedily_as_tensorrt_llm_does():
    # its end-to-end client sends temperature 1.0 and nothing else; its kernels make k=0, p=0 greedy
    assert _sampling(trtllm_inputs(_arrays(temperature=1.0), {})) == {}
    assert _sampling(trtllm_inputs(_arrays(temperature=0.7, top_k=0, top_p=0.0), {})) == {"top_k": 0}
    assert _sampling(trtllm_inputs(_arrays(temperature=0.7, top_p=-1.0), {})) == {}  # top_p <= 0: unset


def test_trtllm_top_k_or_top_p_samples_at_its_temperature_or_its_default_one():
    assert _sampling(trtllm_inputs(_arrays(temperature=0.7, top_k=5), {})) == pytest.approx(
        {"temperature": 0.7, "top_k": 5}
    )
    assert _sampling(trtllm_inputs(_arrays(top_p=0.9), {})) == pytest.approx({"temperature": 1.0, "top_p": 0.9})


def test_vllm_style_sampling_on_the_batched_front_is_left_as_sent():
    assert _sampling(trtllm_inputs(_arrays(temperature=0.5), {"top_k": 3})) == {"temperature": 0.5}
    # with a top_k input and no temperature TensorRT-LLM's rule would add its default of 1.0
    sp = {"sampling_parameters": np.array([b'{"temperature": 0.5}'], dtype=object), **_arrays(top_k=5)}
    assert "temperature" not in trtllm_inputs(sp, {}) and "sampling_parameters" in trtllm_inputs(sp, {})


def test_trtllm_streaming_with_the_prompt_requested_streams_the_new_text_only():
    streamed = trtllm_inputs(_arrays(stream=True, exclude_input_in_output=False), {})
    assert "exclude_input_in_output" not in streamed  # lightspec would refuse the pair
    assert "exclude_input_in_output" not in trtllm_inputs(_arrays(exclude_input_in_output=False), {"stream": True})
    whole = trtllm_inputs(_arrays(stream=False, exclude_input_in_output=False), {})
    assert whole["exclude_input_in_output"].item() is False  # not streaming: the prompt leads the text


def test_forwarded_headers_are_not_sent_on_to_lightspec():
    pb, seen = FakePbUtils(), {}
    make = pb.InferenceRequest
    pb.InferenceRequest = lambda *args, **kwargs: seen.update(kwargs) or make(*args, **kwargs)
    front = BatchedFront(pb, "lightspec", forwarded_headers="^x-tenant")
    front._bls_request(BatchedRequest('{"stream": true, "x-tenant-id": "acme"}'))
    assert seen["parameters"] == {"stream": True}


class WatchedRequest(BatchedRequest):
    """Records the threads that read it: the stub may free a request once ``execute`` returned."""

    def __init__(self, parameters: str = '{"stream": true}'):
        super().__init__(parameters)
        self.sender, self.readers = FakeSender(), set()

    def __getattribute__(self, name):
        if name in ("inputs", "requested_output_names", "parameters", "get_response_sender"):
            object.__getattribute__(self, "readers").add(threading.current_thread().name)
        return object.__getattribute__(self, name)

    def get_response_sender(self) -> FakeSender:
        return self.sender


def streaming_front(chunks: int, gate: threading.Event | None = None):
    """A front whose BLS stream yields ``chunks`` data responses, the last with a finish reason, then
    the stream's empty final response; each waits for ``gate`` when one is given. Returns the front
    and the list of responses the stream has given."""
    pb, given = FakePbUtils(), []

    def stream():
        for i in range(chunks):
            if gate is not None:
                gate.wait(5)
                gate.clear()
            reason = b"length" if i == chunks - 1 else b""
            given.append(i)
            yield FakeResponse([FakeTensor("text_output", np.array([b"t"], dtype=object)),
                                FakeTensor("finish_reason", np.array([reason], dtype=object))])  # fmt: skip
        given.append("end")
        yield FakeResponse([])

    pb.InferenceRequest = lambda **kw: SimpleNamespace(exec=lambda decoupled: stream())
    return BatchedFront(pb, "lightspec"), given


def test_a_request_is_read_only_inside_execute_and_its_stream_reaches_the_client():
    """Read from the forwarding thread after execute returned, a request that a client had
    cancelled crashed the stub or the server under concurrent cancels."""
    front, _ = streaming_front(3)
    request = WatchedRequest()
    front.execute([request])
    assert request.sender.wait_final()
    front.finalize()
    assert request.readers == {threading.current_thread().name}
    assert [(d["text_output"].shape, f) for (r, f), d in zip(request.sender.sent, request.sender.data())] == [
        ((1, 1), 0),
        ((1, 1), 0),
        ((1, 1), 1),
    ]


def test_a_cancelled_client_gets_its_final_response_at_once_and_the_stream_is_read_to_its_end():
    gate = threading.Event()
    front, given = streaming_front(6, gate)
    request = WatchedRequest()
    front.execute([request])
    gate.set()
    while not request.sender.sent:
        time.sleep(0.01)
    request.sender.cancel()
    gate.set()
    assert request.sender.wait_final()
    assert len(request.sender.data()) == 1 and request.sender.sent[-1] == (None, 1)
    for _ in range(4):
        gate.set()
        time.sleep(0.02)
    front.finalize()
    assert given[-1] == "end" and request.sender.sends_after_final == 0


def test_an_error_lightspec_sends_in_band_reaches_the_client_as_that_error():
    """The front's BLS requests carry the prefix by which the orchestrator answers their errors in
    band (Triton 2.51 loses an error response sent to a BLS caller from a response thread)."""
    from lightspec_backend.responses import FRONT_REQUEST_PREFIX, ErrorReply, inband_error

    pb, seen = FakePbUtils(), {}
    message = "request cancelled: the server shut down (grace period over)"

    def stream():
        yield FakeResponse([FakeTensor("text_output", np.array([b"t"], dtype=object))])
        yield FakeResponse([FakeTensor(n, a) for n, a in inband_error("CANCELLED", message).items()])
        yield FakeResponse([])

    def request(**kw):
        seen.update(kw)
        return SimpleNamespace(exec=lambda decoupled: stream())

    pb.InferenceRequest = request
    front = BatchedFront(pb, "lightspec")
    client = WatchedRequest()
    front.execute([client])
    assert client.sender.wait_final()
    front.finalize()
    assert seen["request_id"].startswith(FRONT_REQUEST_PREFIX)
    error = client.sender.final.error()
    assert (error.code(), error.message()) == (pb.TritonError.CANCELLED, message)
    assert len(client.sender.data()) == 1 and client.sender.sends_after_final == 0
    # the orchestrator's side: an entry of the front's answers its errors so, any other as errors
    from lightspec_backend.responses import Entry, RequestState, send_error

    for rid, inband in ((FRONT_REQUEST_PREFIX + "x", True), ("client-id", False)):
        sender = FakeSender()
        entry = Entry(RequestState("ls-1", None), sender, SimpleNamespace(request_id=lambda r=rid: r))
        send_error(pb, entry, ErrorReply("CANCELLED", message))
        response, flags = sender.sent[-1]
        assert flags == pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL and response.has_error() is not inband
