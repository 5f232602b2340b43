"""``lightspec_backend.bench.client``: what a stream records, and the closed and open loops."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace
from typing import ClassVar

import numpy as np
import pytest
from lightspec_backend.bench import client
from lightspec_backend.bench.client import Record, Request, Stream, observe, run_closed_loop, run_open_loop
from lightspec_backend.bench.workload import Prompt


class FakeResult:
    """A gRPC stream result: ``ids`` streamed tokens (None: the empty final response)."""

    def __init__(self, ids: list[int] | None, drafted: int = 0, accepted: int = 0, final: bool = False):
        self.ids, self.drafted, self.accepted, self.final = ids, drafted, accepted, final

    def get_response(self):
        params = {"triton_final_response": SimpleNamespace(bool_param=True)} if self.final else {}
        return SimpleNamespace(outputs=[] if self.ids is None else ["output_ids"], parameters=params)

    def as_numpy(self, name: str):
        values = {
            "output_ids": self.ids,
            "total_draft_tokens": [self.drafted],
            "total_accepted_draft_tokens": [self.accepted],
        }
        return np.array(values[name])


def test_observe_counts_tokens_and_steps_and_keeps_the_last_draft_totals():
    rec = Record("code", t_send=0.0)
    assert not observe(rec, 0.1, FakeResult([5], drafted=0))
    assert not observe(rec, 0.2, FakeResult([6, 7, 8], drafted=4, accepted=2))
    assert not observe(rec, 0.25, FakeResult([], drafted=4, accepted=2))  # no tokens: not a step
    assert observe(rec, 0.3, FakeResult(None, final=True))
    assert (rec.t_first, rec.t_last, rec.t_end) == (0.1, 0.2, 0.3)
    assert (rec.tokens, rec.responses, rec.drafted, rec.accepted) == (4, 2, 4, 2)


class FakeGrpcClient:
    """Answers each request with the scripted (delay, result, error) items."""

    def __init__(self, q: queue.Queue, script: list[tuple]):
        self.q, self.script = q, script

    def async_stream_infer(self, model, inputs, outputs=None, enable_empty_final_response=False):
        assert enable_empty_final_response and {i.name() for i in inputs} >= {"text_input", "max_tokens", "stream"}
        for result, error in self.script:
            self.q.put((time.perf_counter(), result, error))


def _stream(script: list[tuple], timeout_s: float = 5.0) -> Stream:
    s = Stream.__new__(Stream)  # no server: the fake client feeds the stream's queue
    s.timeout_s, s._q, s.outputs = timeout_s, queue.Queue(), []
    s.client = FakeGrpcClient(s._q, script)
    return s


def test_stream_records_a_request_an_error_and_a_timeout():
    req = Request(Prompt("def f():", "shuffled"), max_tokens=4)
    rec = _stream([(FakeResult([1, 2]), None), (FakeResult(None, final=True), None)]).run("m", req)
    assert (rec.kind, rec.tokens, rec.error) == ("shuffled", 2, None) and rec.t_end >= rec.t_first >= rec.t_send
    assert _stream([(FakeResult([1]), None), (None, "boom")]).run("m", req).error == "boom"
    assert _stream([], timeout_s=0.01).run("m", req).error == "no response for 0s"


class FakeStream:
    """Answers at once with ``max_tokens`` tokens; remembers which requests it ran."""

    made: ClassVar[list[FakeStream]] = []

    def __init__(self, url: str, timeout_s: float):
        self.ran: list[str] = []
        self.closed = False
        FakeStream.made.append(self)

    def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        self.ran.append(req.prompt.text)
        t = time.perf_counter()
        return Record(req.prompt.kind, t if t_send is None else t_send, t, t, t, tokens=req.max_tokens, responses=1)

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_streams(monkeypatch):
    FakeStream.made = []
    monkeypatch.setattr(client, "Stream", FakeStream)
    return FakeStream.made


def _requests(n: int) -> list[Request]:
    return [Request(Prompt(f"p{i}"), max_tokens=i + 1) for i in range(n)]


def test_closed_loop_runs_every_request_once_on_c_streams_in_request_order(fake_streams):
    records, duration = run_closed_loop("url", "m", _requests(7), concurrency=3)
    assert [r.tokens for r in records] == list(range(1, 8))
    assert len(fake_streams) == 3 and all(s.closed for s in fake_streams)
    assert sorted(t for s in fake_streams for t in s.ran) == sorted(f"p{i}" for i in range(7))
    assert duration >= 0
    run_closed_loop("url", "m", _requests(2), concurrency=8)
    assert len(fake_streams) == 3 + 2  # never more streams than requests


def test_open_loop_sends_at_poisson_arrivals_and_counts_latency_from_them(fake_streams):
    t0 = time.perf_counter()
    records, duration = run_open_loop("url", "m", _requests(5), rate=500.0, seed=1)
    arrivals = np.cumsum(np.random.default_rng(1).exponential(1 / 500.0, 5))
    assert [r.tokens for r in records] == [1, 2, 3, 4, 5]
    sends = np.array([r.t_send for r in records])
    assert np.all(np.diff(sends) > 0) and sends[0] >= t0  # the scheduled arrival, not the actual send
    assert np.diff(sends) == pytest.approx(np.diff(arrivals))
    assert all(s.closed for s in fake_streams) and duration > 0
