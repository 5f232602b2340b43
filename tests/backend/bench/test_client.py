"""``lightspec_backend.bench.client``: the gRPC request it sends, what a stream records, and the
closed and open loops."""

from __future__ import annotations

import asyncio
import struct
import time
from typing import ClassVar

import grpc
import numpy as np
import pytest
from lightspec_backend.bench import client
from lightspec_backend.bench.client import (
    STREAM_OUTPUTS,
    GrpcClient,
    Record,
    Request,
    observe,
    run_closed_loop,
    run_open_loop,
    stream_request,
)
from lightspec_backend.bench.workload import Prompt
from tritonclient.grpc import service_pb2


def response(ids: list[int] | None, drafted: int = 0, accepted: int = 0, final: bool = False):
    """A streamed ``ModelInferResponse`` as the orchestrator sends it (None: the empty final one)."""
    msg = service_pb2.ModelInferResponse(model_name="m")
    if ids is not None:
        for name, dtype, values in (("output_ids", "INT64", np.array(ids, np.int64)),
                                    ("total_draft_tokens", "INT32", np.array([drafted], np.int32)),
                                    ("total_accepted_draft_tokens", "INT32", np.array([accepted], np.int32))):  # fmt: skip
            msg.outputs.add(name=name, datatype=dtype, shape=values.shape)
            msg.raw_output_contents.append(values.tobytes())
    if final:
        msg.parameters["triton_final_response"].bool_param = True
    return msg


def test_observe_counts_tokens_and_steps_and_keeps_the_last_draft_totals():
    rec = Record("code", t_send=0.0)
    assert not observe(rec, 0.1, response([5], drafted=0))
    assert not observe(rec, 0.2, response([6, 7, 8], drafted=4, accepted=2))
    assert not observe(rec, 0.25, response([], drafted=4, accepted=2))  # no tokens: not a step
    assert observe(rec, 0.3, response(None, final=True))
    assert (rec.t_first, rec.t_last, rec.t_end) == (0.1, 0.2, 0.3)
    assert (rec.tokens, rec.responses, rec.drafted, rec.accepted, rec.ids) == (4, 2, 4, 2, [5, 6, 7, 8])


def test_the_stream_request_carries_the_tensors_the_outputs_and_asks_for_the_final_response():
    msg = stream_request("lightspec_none", Request(Prompt("def f():"), max_tokens=16, temperature=0.5))
    assert msg.model_name == "lightspec_none"
    tensors = {t.name: (t.datatype, list(t.shape), raw) for t, raw in zip(msg.inputs, msg.raw_input_contents)}
    assert set(tensors) == {
        "text_input",
        "max_tokens",
        "stream",
        "ignore_eos",
        "exclude_input_in_output",
        "temperature",
    }
    dtype, shape, raw = tensors["text_input"]
    assert (dtype, shape) == ("BYTES", [1]) and raw == struct.pack("<I", 8) + b"def f():"  # length-prefixed
    assert tensors["max_tokens"] == ("INT32", [1], np.int32(16).tobytes())
    assert tensors["temperature"] == ("FP32", [1], np.float32(0.5).tobytes())
    assert tensors["ignore_eos"][2] == b"\x01" and tensors["stream"][2] == b"\x01"
    assert [o.name for o in msg.outputs] == list(STREAM_OUTPUTS)
    assert msg.parameters["triton_enable_empty_final_response"].bool_param


class FakeCall:
    """A ``ModelStreamInfer`` call that yields the scripted messages (an exception is raised, a
    number is a pause in seconds)."""

    def __init__(self, script: list):
        self.script, self.cancelled, self.finished = script, False, False
        self.sent = 0

    def __aiter__(self):
        return self._gen()

    async def _gen(self):
        for item in self.script:
            if isinstance(item, BaseException):
                raise item
            if isinstance(item, float):
                await asyncio.sleep(item)
                continue
            self.sent += 1
            yield item
        self.finished = True

    async def code(self):
        """The server ends the stream after the last response (the client sent its one request)."""
        self.sent = len(self.script)
        self.finished = True
        return grpc.StatusCode.OK

    def done(self) -> bool:
        return self.finished

    def cancel(self) -> bool:
        self.cancelled = not self.finished
        return self.cancelled


class FakeStub:
    def __init__(self, script: list):
        self.script, self.calls, self.requests = script, [], []

    def ModelStreamInfer(self, requests):  # the gRPC method's name
        self.requests += list(requests)
        self.calls.append(FakeCall(self.script))
        return self.calls[-1]


def _run(script: list, timeout_s: float = 5.0) -> tuple[Record, FakeStub]:
    stub = FakeStub(script)
    req = Request(Prompt("def f():", "shuffled"), max_tokens=4)
    return asyncio.run(GrpcClient("unused", timeout_s, stub=stub).run("m", req)), stub


def _stream_msg(resp=None, error: str = ""):
    return service_pb2.ModelStreamInferResponse(error_message=error, infer_response=resp)


def test_a_request_runs_to_its_final_response_and_waits_for_the_stream_to_end():
    rec, stub = _run([_stream_msg(response([1, 2])), _stream_msg(response([3], 1, 1)),
                      _stream_msg(response(None, final=True)), _stream_msg(response([9]))])  # fmt: skip
    assert (rec.kind, rec.tokens, rec.responses, rec.ids, rec.error) == ("shuffled", 3, 2, [1, 2, 3], None)
    assert rec.t_end >= rec.t_last >= rec.t_first >= rec.t_send
    assert stub.requests[0].model_name == "m"
    assert stub.calls[0].finished and not stub.calls[0].cancelled  # ended by the server, never cancelled


def test_errors_an_early_end_and_a_silent_server_end_the_request_with_a_reason():
    rec, stub = _run([_stream_msg(response([1])), _stream_msg(error="boom")])
    assert rec.error == "boom" and not stub.calls[0].cancelled
    assert _run([_stream_msg(response([1]))])[0].error == "the stream ended before the final response"
    failed = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "gone")
    assert _run([_stream_msg(response([1])), failed])[0].error == "gone"
    rec, stub = _run([_stream_msg(response([1])), 0.02, _stream_msg(response([2])), 60.0], timeout_s=0.1)
    assert (rec.error, rec.tokens) == ("no response for 0s", 2) and stub.calls[0].cancelled  # 0.02 s: in time


class FakeClient:
    """Answers each request after a short pause with ``max_tokens`` tokens; records how many
    requests were in flight at once."""

    made: ClassVar[list[FakeClient]] = []

    def __init__(self, url: str, timeout_s: float):
        self.ran: list[str] = []
        self.in_flight = self.most = 0
        self.closed = False
        FakeClient.made.append(self)

    async def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        t = time.perf_counter()
        self.in_flight += 1
        self.most = max(self.most, self.in_flight)
        await asyncio.sleep(0.005)
        self.in_flight -= 1
        self.ran.append(req.prompt.text)
        return Record(req.prompt.kind, t if t_send is None else t_send, t, t, time.perf_counter(),
                      tokens=req.max_tokens, responses=1)  # fmt: skip

    async def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_clients(monkeypatch):
    FakeClient.made = []
    monkeypatch.setattr(client, "GrpcClient", FakeClient)
    return FakeClient.made


def _requests(n: int) -> list[Request]:
    return [Request(Prompt(f"p{i}"), max_tokens=i + 1) for i in range(n)]


def test_closed_loop_runs_every_request_once_c_at_a_time_in_request_order(fake_clients):
    records, duration = run_closed_loop("url", "m", _requests(7), concurrency=3)
    assert [r.tokens for r in records] == list(range(1, 8))
    (c,) = fake_clients
    assert sorted(c.ran) == sorted(f"p{i}" for i in range(7)) and c.most == 3 and c.closed
    assert duration >= 0.005 * 3  # three rounds of at most three
    run_closed_loop("url", "m", _requests(2), concurrency=8)
    assert fake_clients[1].most == 2


def test_open_loop_sends_at_poisson_arrivals_and_counts_latency_from_them(fake_clients):
    t0 = time.perf_counter()
    records, duration = run_open_loop("url", "m", _requests(5), rate=500.0, seed=1)
    arrivals = np.cumsum(np.random.default_rng(1).exponential(1 / 500.0, 5))
    assert [r.tokens for r in records] == [1, 2, 3, 4, 5]
    sends = np.array([r.t_send for r in records])
    assert np.all(np.diff(sends) > 0) and sends[0] >= t0  # the scheduled arrival, not the actual send
    assert np.diff(sends) == pytest.approx(np.diff(arrivals))
    assert fake_clients[0].most > 1 and fake_clients[0].closed and duration > 0  # nothing caps the requests in flight


def test_an_open_loop_runs_duration_counts_from_its_first_send(fake_clients):
    """The first Poisson arrival is not at 0: a duration taken from before it counts a wait the
    client made, and the run's throughput comes out low (docs: from the first send to the last
    final response)."""
    rate, seed = 20.0, 1
    gaps = np.random.default_rng(seed).exponential(1 / rate, 4)
    assert gaps[0] > 0.01  # the wait the duration must leave out
    records, duration = run_open_loop("url", "m", _requests(4), rate=rate, seed=seed)
    sends = np.array([r.t_send for r in records])
    assert duration == pytest.approx(max(r.t_end for r in records) - sends[0], abs=1e-6)
    assert np.diff(sends) == pytest.approx(gaps[1:])  # the later arrivals keep their gaps
