"""The dynamic policy's stage profile is taken while the models load, through a real tritonserver
serving stage models over BLS (``stages: triton``): the first request after "ready" does not wait
for it."""

from __future__ import annotations

import queue
import time
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend.client import grpc_inputs, is_final
from lightspec_backend.launcher import TritonServer
from lightspec_backend.repository import write_model_repository

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]


def time_to_first_token(url: str, prompt: str) -> float:
    client = grpcclient.InferenceServerClient(url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        t0 = time.perf_counter()
        client.async_stream_infer(
            "lightspec", grpc_inputs(text_input=prompt, max_tokens=8, stream=True), enable_empty_final_response=True
        )
        first = None
        while True:
            result, error = results.get(timeout=120)
            assert error is None, error
            if first is None and result.get_response().outputs:
                first = time.perf_counter() - t0
            if is_final(result):
                return first
    finally:
        client.stop_stream()
        client.close()


def test_the_first_request_after_ready_pays_no_stage_profile(tmp_path):
    repo = write_model_repository(tmp_path / "repo", {"stages": "triton"})
    with TritonServer(repo, cache_dir=tmp_path / "cache") as srv:
        log = srv.log_text()
        # the target stage timed itself before the server reported ready
        assert "target stage: profiled in" in log, srv.log_tail(40)
        first = time_to_first_token(srv.grpc_url, "def fibonacci(n):")
        second = time_to_first_token(srv.grpc_url, "import os\n")
        log = srv.log_text()
    assert "stage profile failed" not in log and "profile failed" not in log, log[-4000:]
    # A profile taken on the first request costs seconds (a grid of synthetic steps per stage); a
    # first token takes tens of milliseconds. The floor keeps a slow first call (cold caches on a
    # busy host) from failing the comparison when no profile ran.
    assert first < max(2 * second, 0.5), (first, second)
