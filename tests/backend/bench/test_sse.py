"""``lightspec_backend.bench.sse``: the HTTP SSE client for both servers."""

from __future__ import annotations

import http.server
import json
import threading
from typing import ClassVar

import pytest
from lightspec_backend.bench.client import Request, run_closed_loop
from lightspec_backend.bench.sse import (
    SSEStream,
    events,
    stream_factory,
    triton_body,
    triton_event,
    vllm_body,
    vllm_event,
)
from lightspec_backend.bench.workload import Prompt


def test_events_are_the_data_lines_up_to_done():
    lines = [b": comment\n", b'data: {"a": 1}\n', b"\n", b"event: x\n", b'data:{"a": 2}\r\n', b"data: [DONE]\n",
             b'data: {"a": 3}\n']  # fmt: skip
    assert list(events(iter(lines))) == [{"a": 1}, {"a": 2}]


def test_triton_events_give_ids_scalar_or_list_and_the_draft_counters():
    assert triton_event({"output_ids": 7, "total_draft_tokens": 4, "total_accepted_draft_tokens": 3}) == ([7], 4, 3)
    assert triton_event({"output_ids": [7, 8]})[0] == [7, 8] and triton_event({"finish_reason": "length"})[0] == []
    with pytest.raises(RuntimeError, match="boom"):
        triton_event({"error": "boom"})


def test_vllm_chunks_give_their_token_ids_and_refuse_a_stream_without_them():
    assert vllm_event({"choices": [{"text": "ab", "token_ids": [5, 6]}]}) == ([5, 6], None, None)
    assert vllm_event({"choices": [], "usage": {"completion_tokens": 2}}) == ([], None, None)
    with pytest.raises(RuntimeError, match="no token_ids"):
        vllm_event({"choices": [{"text": "ab"}]})
    with pytest.raises(RuntimeError, match="bad"):
        vllm_event({"error": {"message": "bad"}})


def test_both_bodies_ask_for_the_same_greedy_ignore_eos_stream():
    req = Request(Prompt("def f():"), max_tokens=128)
    t, v = triton_body(req), vllm_body(req, "vllm")
    assert (t["text_input"], t["max_tokens"], t["temperature"], t["ignore_eos"], t["stream"]) == (
        v["prompt"], v["max_tokens"], v["temperature"], v["ignore_eos"], v["stream"])  # fmt: skip
    assert t["exclude_input_in_output"] and v["return_token_ids"] and v["model"] == "vllm"


class _Completions(http.server.BaseHTTPRequestHandler):
    """Answers ``/v1/completions`` with the chunk format vLLM 0.32 streams (recorded), two tokens in
    the first chunk (an accepted draft), one in the second; 400 for a request without a prompt."""

    protocol_version = "HTTP/1.1"
    bodies: ClassVar[list[dict]] = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Completions.bodies.append(body)
        if not body.get("prompt"):
            msg = b'{"error": {"message": "prompt missing"}}'
            self.send_response(400)
            self.send_header("Content-Length", str(len(msg)))
            self.end_headers()
            self.wfile.write(msg)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for ids in ([11, 12], [13]):
            chunk = {"object": "text_completion", "choices": [{"index": 0, "text": "x", "token_ids": ids}]}
            self._chunk(f"data: {json.dumps(chunk)}\n\n".encode())
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

    def log_message(self, *args):
        pass


@pytest.fixture
def completions_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Completions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Completions.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_stream_counts_tokens_from_ids_reuses_its_connection_and_records_errors(completions_url):
    stream = SSEStream(completions_url, 10, "vllm")
    recs = [stream.run("vllm", Request(Prompt(p), 3)) for p in ("a", "b")]
    for rec in recs:
        assert (rec.error, rec.tokens, rec.responses, rec.ids) == (None, 3, 2, [11, 12, 13])
        assert rec.t_send <= rec.t_first <= rec.t_last <= rec.t_end
    bad = stream.run("vllm", Request(Prompt(""), 3))
    assert bad.error.startswith("HTTP 400") and "prompt missing" in bad.error
    assert stream.run("vllm", Request(Prompt("c"), 3)).tokens == 3  # reconnected after the error
    stream.close()
    assert [b["prompt"] for b in _Completions.bodies] == ["a", "b", "", "c"]
    records, _ = run_closed_loop(completions_url, "vllm", [Request(Prompt(str(i)), 3) for i in range(5)], 2,
                                 make_stream=stream_factory("vllm"))  # fmt: skip
    assert [r.tokens for r in records] == [3] * 5


def test_an_unknown_server_kind_is_refused():
    with pytest.raises(ValueError, match="server='tgi'"):
        SSEStream("http://127.0.0.1:1", 1, "tgi")


@pytest.mark.triton
def test_generate_stream_gives_the_same_tokens_as_the_grpc_stream(smoke_model, tmp_path, monkeypatch):
    """LightSpec over HTTP SSE and over gRPC, one real tritonserver: the same greedy tokens."""
    from lightspec_backend.bench.configs import parse_configs, stages_for, write_bench_repository
    from lightspec_backend.bench.runner import ModelSwitcher
    from lightspec_backend.launcher import TritonServer

    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path / "cache"))
    configs = parse_configs(["none"], ["mtp"])
    overrides = {"model_dir": str(smoke_model / "target"), "num_threads": "1", "num_kv_blocks": "64"}
    repo = write_bench_repository(tmp_path / "repo", configs, overrides, 4)
    with TritonServer(repo, model_control_mode="explicit", load_models=stages_for(configs, overrides)) as server:
        switcher = ModelSwitcher(server.grpc_url, ["lightspec_none"])
        switcher.activate("lightspec_none")
        req = Request(Prompt("def add(a, b):\n"), max_tokens=8)
        http_rec = SSEStream(server.http_url, 60).run("lightspec_none", req)
        grpc_recs, _ = run_closed_loop(server.grpc_url, "lightspec_none", [req] * 4, 2, 60)
        switcher.deactivate("lightspec_none", timeout_s=30)  # the streams left nothing that keeps it loaded
        switcher.close()
    assert http_rec.error is None and http_rec.tokens == 8 and http_rec.responses >= 1
    assert all(r.error is None and r.ids == http_rec.ids for r in grpc_recs) and len(http_rec.ids) == 8
