"""The load generator: gRPC streams on one asyncio channel (:class:`GrpcClient`) or the HTTP SSE
streams of :mod:`.sse`, driven closed loop or open loop (Poisson arrivals)."""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import serialize_byte_tensor, triton_to_np_dtype

from ..client import input_array
from ..tensors import INPUT_SPECS
from .workload import Prompt

STREAM_OUTPUTS = ("output_ids", "total_draft_tokens", "total_accepted_draft_tokens")  # what the bench client reads


@dataclass
class Record:
    """What one request did, seen from the client (``perf_counter`` times)."""

    kind: str
    t_send: float
    t_first: float | None = None
    t_last: float | None = None
    t_end: float | None = None
    tokens: int = 0
    responses: int = 0  # responses with tokens: one per engine step that produced tokens
    drafted: int = 0
    accepted: int = 0
    error: str | None = None
    prompt: str = ""
    ids: list[int] = field(default_factory=list)  # the generated token ids, for the token-identity check


@dataclass
class Request:
    prompt: Prompt
    max_tokens: int
    temperature: float = 0.0

    def tensors(self) -> dict:
        return {
            "text_input": self.prompt.text,
            "max_tokens": self.max_tokens,
            "stream": True,
            "ignore_eos": True,
            "exclude_input_in_output": True,
            "temperature": self.temperature,
        }


def stream_request(model: str, req: Request):
    """``req`` as the ``ModelInferRequest`` a gRPC stream sends: its tensors, the outputs the bench
    reads, and ``triton_enable_empty_final_response`` (the last response says it is the last)."""
    msg = service_pb2.ModelInferRequest(model_name=model)
    for name, value in req.tensors().items():
        arr = input_array(name, value)
        msg.inputs.add(name=name, datatype=INPUT_SPECS[name].client_type, shape=arr.shape)
        raw = serialize_byte_tensor(arr).item() if arr.dtype == object else arr.tobytes()
        msg.raw_input_contents.append(raw)
    for name in STREAM_OUTPUTS:
        msg.outputs.add(name=name)
    msg.parameters["triton_enable_empty_final_response"].bool_param = True
    return msg


def observe(rec: Record, t: float, response) -> bool:
    """Adds one streamed ``ModelInferResponse`` (received at ``t``) to ``rec``; True when it was the
    last one."""
    for out, raw in zip(response.outputs, response.raw_output_contents):
        values = np.frombuffer(raw, triton_to_np_dtype(out.datatype))
        if out.name == "output_ids":
            if values.size:
                rec.t_first = t if rec.t_first is None else rec.t_first
                rec.t_last = t
                rec.tokens += int(values.size)
                rec.responses += 1
                rec.ids.extend(values.tolist())
        elif out.name == "total_draft_tokens":
            rec.drafted = int(values[0])
        elif out.name == "total_accepted_draft_tokens":
            rec.accepted = int(values[0])
    final = response.parameters.get("triton_final_response")
    if final is not None and final.bool_param:
        rec.t_end = t
        return True
    return False


class GrpcClient:
    """LightSpec over gRPC for the bench: one asyncio channel for every request in flight, each
    request a ``ModelStreamInfer`` stream of its own, all read by one event loop, the responses'
    protobufs read as they come.

    Why not tritonclient's clients: the client shares the machine with the server it measures. With
    one synchronous client per request in flight (a channel and a reader thread each, a thread
    handoff and an ``InferResult`` for every response) it took 0.27-0.30 ms of CPU per token at 64
    streams, over half a core at 2000 tok/s; this one takes 0.16-0.21 ms (paired,
    three rounds). tritonclient's own asyncio client cannot ask for the empty final response. The
    protobuf types and the service stub are tritonclient's."""

    def __init__(self, url: str, timeout_s: float, stub=None):
        self.timeout_s = timeout_s
        self.channel = None
        if stub is None:
            self.channel = grpc.aio.insecure_channel(url)
            stub = service_pb2_grpc.GRPCInferenceServiceStub(self.channel)
        self.stub = stub

    async def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        """One request, streamed to its final response; an error, the stream's end or ``timeout_s``
        without a response ends it with ``error`` set (a timeout also cancels the stream)."""
        rec = Record(req.prompt.kind, t_send if t_send is not None else time.perf_counter(), prompt=req.prompt.text)
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        last, expired = loop.time(), []

        def check() -> None:  # one timer per request, pushed back when responses came in time
            nonlocal timer
            due = last + self.timeout_s
            if loop.time() < due:
                timer = loop.call_at(due, check)
            else:
                expired.append(True)
                task.cancel()

        timer = loop.call_at(last + self.timeout_s, check)
        call = self.stub.ModelStreamInfer(iter([stream_request(model, req)]))
        try:
            async for msg in call:
                t = time.perf_counter()
                if msg.error_message:
                    rec.error = msg.error_message
                if rec.error or observe(rec, t, msg.infer_response):
                    # the request side is closed, so the server ends the stream now. Waiting for
                    # that instead of cancelling matters: tritonserver 2.51 keeps a model that saw
                    # a stream cancelled after its last response from ever unloading
                    await call.code()
                    break
                last = loop.time()
            else:
                rec.error = "the stream ended before the final response"
        except asyncio.CancelledError:
            if not expired:
                raise
            rec.error = f"no response for {self.timeout_s:.0f}s"
        except grpc.aio.AioRpcError as e:  # the server or the connection failed
            rec.error = e.details() or str(e.code())
        finally:
            timer.cancel()
            if not call.done():
                call.cancel()
        rec.t_end = rec.t_end if rec.t_end is not None else time.perf_counter()
        return rec

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


async def _with_client(url: str, timeout_s: float, body):
    client = GrpcClient(url, timeout_s)
    try:
        return await body(client)
    finally:
        await client.close()


async def _closed_loop(client, model: str, requests: list[Request], concurrency: int) -> tuple[list[Record], float]:
    records: list[Record | None] = [None] * len(requests)
    todo = iter(range(len(requests)))

    async def worker() -> None:
        for i in todo:
            records[i] = await client.run(model, requests[i])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(requests)))))
    done = [r for r in records if r is not None]
    return done, max((r.t_end for r in done), default=t0) - t0


def run_closed_loop(
    url: str, model: str, requests: list[Request], concurrency: int, timeout_s: float = 600.0, make_stream=None
) -> tuple[list[Record], float]:
    """C workers, each sending its next request when its previous one finished. Returns the records
    (in request order) and the wall time from the first send to the last answer.

    Without ``make_stream`` the workers are coroutines on one :class:`GrpcClient`. With it,
    ``make_stream(url, timeout_s)`` opens a worker's stream, a blocking object with ``run(model,
    req)`` and ``close()`` (the HTTP SSE ones in :mod:`.sse`), and each worker is a thread."""
    if make_stream is None:
        return asyncio.run(_with_client(url, timeout_s, lambda c: _closed_loop(c, model, requests, concurrency)))
    streams = [make_stream(url, timeout_s) for _ in range(min(concurrency, len(requests)))]
    records: list[Record | None] = [None] * len(requests)
    todo = iter(range(len(requests)))
    lock = threading.Lock()

    def worker(stream) -> None:
        while True:
            with lock:
                i = next(todo, None)
            if i is None:
                return
            records[i] = stream.run(model, requests[i])

    threads = [threading.Thread(target=worker, args=(s,), daemon=True) for s in streams]
    t0 = time.perf_counter()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for s in streams:
            s.close()
    done = [r for r in records if r is not None]
    return done, max((r.t_end for r in done), default=t0) - t0


async def _open_loop(client, model: str, requests: list[Request], rate: float, seed: int) -> tuple[list[Record], float]:
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests)))
    # the run's duration counts from the first send (docs/benchmarks.md): the first request goes at
    # once and the others keep their gaps, else the wait for the first arrival, idle time the client
    # made, would count in the duration and lower the throughput
    arrivals -= arrivals[0]
    t0 = time.perf_counter()
    tasks = []
    for req, at in zip(requests, arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(client.run(model, req, t0 + at)))
    records = list(await asyncio.gather(*tasks))
    return records, max(r.t_end for r in records) - t0


def run_open_loop(
    url: str, model: str, requests: list[Request], rate: float, seed: int = 0, timeout_s: float = 600.0
) -> tuple[list[Record], float]:
    """Poisson arrivals at ``rate`` requests/s over gRPC; a request's latency counts from its
    scheduled arrival (so a late send shows), and nothing caps the requests in flight."""
    return asyncio.run(_with_client(url, timeout_s, lambda c: _open_loop(c, model, requests, rate, seed)))
