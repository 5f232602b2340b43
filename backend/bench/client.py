"""The load generator: tritonclient gRPC streams, driven closed loop or open loop (Poisson arrivals)."""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ..client import grpc_inputs, is_final
from .workload import Prompt

STREAM_OUTPUTS = ("output_ids", "total_draft_tokens", "total_accepted_draft_tokens")  # what the bench client reads
OPEN_LOOP_STREAMS = 16  # streams opened before the first arrival; more are opened when that many are busy


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

    def inputs(self) -> list:
        return grpc_inputs(
            text_input=self.prompt.text,
            max_tokens=self.max_tokens,
            stream=True,
            ignore_eos=True,
            exclude_input_in_output=True,
            temperature=self.temperature,
        )


def observe(rec: Record, t: float, result) -> bool:
    """Adds one streamed response (received at ``t``) to ``rec``; True when it was the last one."""
    if result.get_response().outputs:
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            rec.t_first = t if rec.t_first is None else rec.t_first
            rec.t_last = t
            rec.tokens += int(ids.size)
            rec.responses += 1
            rec.ids.extend(int(i) for i in ids.reshape(-1))
        rec.drafted = int(result.as_numpy("total_draft_tokens").reshape(-1)[0])
        rec.accepted = int(result.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
    if is_final(result):
        rec.t_end = t
        return True
    return False


class Stream:
    """One gRPC client with one open stream; runs one request at a time."""

    def __init__(self, url: str, timeout_s: float):
        import tritonclient.grpc as grpcclient

        self.timeout_s = timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self._q: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self._q.put((time.perf_counter(), result, error)))
        # only what ``run`` reads: the server builds no other tensors for each streamed response
        self.outputs = [grpcclient.InferRequestedOutput(n) for n in STREAM_OUTPUTS]

    def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        inputs = req.inputs()
        rec = Record(req.prompt.kind, t_send if t_send is not None else time.perf_counter(), prompt=req.prompt.text)
        self.client.async_stream_infer(model, inputs, outputs=self.outputs, enable_empty_final_response=True)
        while True:
            try:
                t, result, error = self._q.get(timeout=self.timeout_s)
            except queue.Empty:
                rec.error, rec.t_end = f"no response for {self.timeout_s:.0f}s", time.perf_counter()
                return rec
            if error is not None:
                rec.error, rec.t_end = str(error), t
                return rec
            if observe(rec, t, result):
                return rec

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.stop_stream()
        with contextlib.suppress(Exception):
            self.client.close()


def run_closed_loop(
    url: str, model: str, requests: list[Request], concurrency: int, timeout_s: float = 600.0, make_stream=None
) -> tuple[list[Record], float]:
    """C workers, each with its own stream, send their next request when the previous one finished.
    Returns the records (in request order) and the wall time from the first send to the last answer.
    ``make_stream(url, timeout_s)`` opens a worker's stream (default: a gRPC :class:`Stream`; the
    HTTP ones are in :mod:`.sse`)."""
    make_stream = make_stream or Stream
    streams = [make_stream(url, timeout_s) for _ in range(min(concurrency, len(requests)))]
    records: list[Record | None] = [None] * len(requests)
    todo = iter(range(len(requests)))
    lock = threading.Lock()

    def worker(stream: Stream) -> None:
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


class _StreamPool:
    """Idle streams for the open loop: a request takes one (or opens a new one) and gives it back."""

    def __init__(self, url: str, timeout_s: float, size: int):
        self.url, self.timeout_s = url, timeout_s
        self.idle: queue.Queue = queue.Queue()
        for _ in range(size):
            self.idle.put(Stream(url, timeout_s))
        self.made: list[Stream] = list(self.idle.queue)

    def run(self, model: str, req: Request, t_send: float) -> Record:
        try:
            stream = self.idle.get_nowait()
        except queue.Empty:
            stream = Stream(self.url, self.timeout_s)
            self.made.append(stream)
        try:
            return stream.run(model, req, t_send)
        finally:
            self.idle.put(stream)

    def close(self) -> None:
        for s in self.made:
            s.close()


def _when_due(arrivals: np.ndarray, t0: float):
    """Each arrival's scheduled ``perf_counter`` time, yielded once it is due."""
    for at in arrivals:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        yield t0 + at


def run_open_loop(
    url: str, model: str, requests: list[Request], rate: float, seed: int = 0, timeout_s: float = 600.0
) -> tuple[list[Record], float]:
    """Poisson arrivals at ``rate`` requests/s; a request's latency counts from its scheduled arrival
    (so client-side queueing shows). Streams are pooled: one per request in flight."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests)))
    pool = _StreamPool(url, timeout_s, min(len(requests), OPEN_LOOP_STREAMS))
    t0 = time.perf_counter()
    try:
        with ThreadPoolExecutor(max_workers=len(requests)) as threads:
            futures = [threads.submit(pool.run, model, req, t) for req, t in zip(requests, _when_due(arrivals, t0))]
        records = [f.result() for f in futures]
    finally:
        pool.close()
    return records, max(r.t_end for r in records) - t0
