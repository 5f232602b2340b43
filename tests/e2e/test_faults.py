"""Process faults with requests in flight, against real servers: a supervised tritonserver (what
``lightspec serve`` runs) and ``lightspec serve`` itself as a subprocess. Each fault must give every
request a final answer within a bound, tell the truth in readiness, recover within 30 s and leave
nothing of the faulty server in /dev/shm."""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient
from lightspec_backend.client import grpc_inputs, is_final
from lightspec_backend.launcher import TritonServer
from lightspec_backend.repository import write_model_repository
from lightspec_backend.supervisor import Supervisor

from tests.e2e.test_conventions import batched_inputs

pytestmark = [pytest.mark.triton, pytest.mark.faults]

STREAMS = 8
LONG = 900  # tokens: long enough to be in flight when the fault comes
# fast restarts; stage models over BLS, whose stubs the tests kill and stall
OVERRIDES = {"num_kv_blocks": "512", "block_size": "16", "num_threads": "1", "profile_stages": "off",
             "stages": "triton"}  # fmt: skip


class Streams:
    """``n`` gRPC streams, each one request; ``results[i]`` is ("ok", tokens), ("error", message) or
    ("hang",) when nothing came for 60 s; ``times[i]`` when it ended. (A gRPC stream carries an
    error's message only, not its status code: HTTP /generate maps the codes.)"""

    def __init__(self, url: str, n: int = STREAMS, max_tokens: int = LONG, model: str = "lightspec", **inputs):
        self.model = model  # lightspec_batched: every input as [1, 1], as TensorRT-LLM clients send them
        self.results: dict[int, tuple] = {}
        self.times: dict[int, float] = {}
        self.started = [threading.Event() for _ in range(n)]  # first token, or the end
        self.clients = [grpcclient.InferenceServerClient(url) for _ in range(n)]
        self.threads = [threading.Thread(target=self._one, args=(i, max_tokens, inputs), daemon=True) for i in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, i: int, max_tokens: int, extra: dict) -> None:
        client, q = self.clients[i], queue.Queue()
        client.start_stream(callback=lambda result, error: q.put((result, error)))
        make = batched_inputs if self.model == "lightspec_batched" else grpc_inputs
        inputs = make(text_input="def f(x):", max_tokens=max_tokens, stream=True, ignore_eos=True, **extra)
        client.async_stream_infer(self.model, inputs, enable_empty_final_response=True)
        tokens = 0
        try:
            while True:
                try:
                    result, error = q.get(timeout=60)
                except queue.Empty:
                    self._done(i, ("hang",))
                    return
                if error is not None:
                    self._done(i, ("error", error.message()))
                    return
                tokens += 1
                self.started[i].set()
                if is_final(result):
                    self._done(i, ("ok", tokens))
                    return
        finally:
            self.started[i].set()
            client.stop_stream()
            client.close()

    def _done(self, i: int, result: tuple) -> None:
        self.results[i], self.times[i] = result, time.monotonic()

    def wait_started(self) -> None:
        for e in self.started:
            assert e.wait(120), "no first token in 120 s"
        assert not self.results, self.results  # all in flight

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(deadline - time.monotonic(), 0))


class ReadinessLog:
    """Polls /v2/health/ready every 0.1 s in a thread; ``values`` is the list of answers."""

    def __init__(self, server: TritonServer):
        self.values: list[bool] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(server,), daemon=True)
        self._thread.start()

    def _poll(self, server: TritonServer) -> None:
        while not self._stop.wait(0.1):
            self.values.append(server.is_ready())

    def stop(self) -> list[bool]:
        self._stop.set()
        self._thread.join(5)
        return self.values


def metric_max(server: TritonServer, fragment: str) -> float:
    """The largest value of any exported metric whose name contains ``fragment``."""
    with urllib.request.urlopen(server.metrics_url, timeout=10) as r:
        body = r.read().decode()
    values = [float(m.group(2)) for m in re.finditer(r"^([^#\s{]+)(?:\{[^}]*\})? (\S+)$", body, re.MULTILINE)
              if fragment in m.group(1)]  # fmt: skip
    assert values, f"no metric named like {fragment!r}"
    return max(values)


def wait_until(predicate, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(step)
    return predicate()


def one_request_ok(server: TritonServer) -> bool:
    s = Streams(server.grpc_url, n=1, max_tokens=8)
    s.join(60)
    return s.results.get(0, ("none",))[0] == "ok"


def unavailable_naming(message: str, stage: str) -> bool:
    return f"stage model {stage!r} unavailable" in message


def regions(prefix: str) -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"{prefix}*")}


def supervise(root: Path, smoke_model: Path, overrides: dict[str, str]):
    repo = write_model_repository(root / "repo", {"model_dir": str(smoke_model / "target"), **overrides})
    server = TritonServer(repo, cache_dir=root / "cache", model_control_mode="explicit", load_models=["*"])
    sup = Supervisor(server, root / "control")
    sup.start(timeout_s=600)
    stop = threading.Event()
    watcher = threading.Thread(target=sup.run, args=(stop,), daemon=True)
    watcher.start()
    yield sup
    stop.set()
    watcher.join(30)
    server.stop(timeout_s=60)
    assert not regions(server.shm_prefix)


@pytest.fixture(scope="module")
def supervised(tmp_path_factory, smoke_model):
    yield from supervise(tmp_path_factory.mktemp("faults"), smoke_model, OVERRIDES)


@pytest.fixture(scope="module")
def supervised_engines(tmp_path_factory, smoke_model):
    """The default deployment: the engine in child processes of the orchestrator (two of them for
    speculation on two or more CPUs)."""
    overrides = {**OVERRIDES, "stages": "process", "data_parallel_size": "2"}
    yield from supervise(tmp_path_factory.mktemp("faults_process"), smoke_model, overrides)


def stub_pid(sup: Supervisor, name: str) -> int:
    return next(s.pid for s in sup.server.stubs() if s.name == name and s.alive)


def check_recovered(sup: Supervisor, restarts_before: int, old_regions: set[str], t_fault: float, what: str) -> None:
    server = sup.server
    assert wait_until(lambda: sup.restarts > restarts_before and not sup.recovering and server.is_ready(), 30), (
        "not recovered in 30 s"
    )
    t_ready = time.monotonic()
    assert one_request_ok(server)
    assert metric_max(server, "restarts_total") == sup.restarts  # counted across restarts
    assert wait_until(lambda: metric_max(server, "kv_cache_usage") == 0.0, 10)
    assert not regions(server.shm_prefix) & old_regions  # the faulty server's regions are gone
    print(f"\n{what}: ready again {t_ready - t_fault:.1f} s after the fault")


def test_stage_killed_answers_unavailable_and_recovers(supervised):
    sup, before, old = supervised, supervised.restarts, regions(supervised.server.shm_prefix)
    streams = Streams(sup.server.grpc_url)
    streams.wait_started()
    readiness = ReadinessLog(sup.server)
    t_kill, t_wall = time.monotonic(), time.time()
    os.kill(stub_pid(sup, "lightspec_target_0_0"), signal.SIGKILL)
    streams.join(30)
    assert wait_until(lambda: sup.restarts > before, 5)
    assert sup.events[-1][1].startswith("stub process 'lightspec_target_0_0' died")
    assert sup.events[-1][0] - t_wall < 2.0  # detected within 2 s
    check_recovered(sup, before, old, t_kill, "stage killed")
    values = readiness.stop()
    print(
        f"stage killed: detected after {sup.events[-1][0] - t_wall:.1f} s, last answer after "
        f"{max(streams.times.values()) - t_kill:.1f} s, {sorted(r[0] for r in streams.results.values())}"
    )
    assert len(streams.results) == STREAMS, streams.results  # nobody hangs
    for result in streams.results.values():
        assert result[0] == "ok" or unavailable_naming(result[1], "lightspec_target"), result
    assert any(r[0] == "error" for r in streams.results.values())
    assert max(streams.times.values()) - t_kill < 10
    assert False in values and values[-1] is True  # not ready while degraded, ready again


def test_stage_stalled_for_5_s_ends_with_a_clear_error_and_recovers(supervised):
    sup, before, old = supervised, supervised.restarts, regions(supervised.server.shm_prefix)
    streams = Streams(sup.server.grpc_url)
    streams.wait_started()
    pid = stub_pid(sup, "lightspec_target_0_0")
    t_stop = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(5)
    finally:
        with contextlib.suppress(ProcessLookupError):  # the supervisor may have replaced it already
            os.kill(pid, signal.SIGCONT)
    streams.join(30)
    assert len(streams.results) == STREAMS, streams.results
    for result in streams.results.values():
        assert result[0] == "ok" or unavailable_naming(result[1], "lightspec_target"), result
    print(f"\nstage stalled: last answer after {max(streams.times.values()) - t_stop:.1f} s")
    check_recovered(sup, before, old, t_stop, "stage stalled")


def test_orchestrator_killed_no_client_hangs_and_recovers(supervised):
    sup, before, old = supervised, supervised.restarts, regions(supervised.server.shm_prefix)
    streams = Streams(sup.server.grpc_url)
    streams.wait_started()
    t_kill = time.monotonic()
    os.kill(stub_pid(sup, "lightspec_0_0"), signal.SIGKILL)
    streams.join(30)
    assert len(streams.results) == STREAMS, streams.results
    assert all(r[0] in ("ok", "error") for r in streams.results.values()), streams.results
    assert max(streams.times.values()) - t_kill < 10
    print(f"\norchestrator killed: last answer after {max(streams.times.values()) - t_kill:.1f} s")
    check_recovered(sup, before, old, t_kill, "orchestrator killed")


def engine_pids(sup: Supervisor) -> list[int]:
    """The engine processes the orchestrator's stub started (``stages: process``)."""
    parent, pids = stub_pid(sup, "lightspec_0_0"), []
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if ppid == parent and b"lightspec_core.engine.process" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
    return pids


def cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def computing_engine(sup: Supervisor, window_s: float = 0.3) -> int | None:
    """An engine process that used the CPU in the last ``window_s``: one that holds requests (an
    idle one waits on its socket). Chosen this way because a client can lag its server by seconds
    on two busy cores, so a first token seen is no proof that the server still computes."""
    pids = engine_pids(sup)
    assert len(pids) == 2, pids
    before = {pid: cpu_ticks(pid) for pid in pids}
    time.sleep(window_s)
    used = {pid: cpu_ticks(pid) - before[pid] for pid in pids}
    pid = max(used, key=used.get)
    return pid if used[pid] > 0 else None


def test_engine_process_killed_answers_its_requests_and_recovers(supervised_engines):
    """One of two engine processes killed: its requests end UNAVAILABLE naming it; the other's are
    drained before the restart (they finish or end cancelled within the drain's 3 s), so no stream
    ends with a closed connection."""
    sup, before, old = supervised_engines, supervised_engines.restarts, regions(supervised_engines.server.shm_prefix)
    for _ in range(3):  # the streams are short on this model: again if both engines were done
        streams = Streams(sup.server.grpc_url)
        streams.wait_started()
        victim = computing_engine(sup)
        if victim is not None:
            break
        streams.join(60)
    assert victim is not None, "no engine process was computing while 8 streams were in flight"
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    streams.join(30)
    assert wait_until(lambda: sup.restarts > before, 5), (streams.results, sup.control.faults(), sup.server.log_tail())
    assert sup.events[-1][1].startswith("stage model 'engine' stopped answering")
    check_recovered(sup, before, old, t_kill, "engine process killed")
    assert len(streams.results) == STREAMS, streams.results  # nobody hangs
    errors = [r[1] for r in streams.results.values() if r[0] != "ok"]
    print(f"engine process killed: {len(errors)} errors, {sorted(set(errors))}")
    assert all("the engine process is unavailable" in e or "the server shut down" in e for e in errors), errors
    assert any("the engine process is unavailable" in e for e in errors), errors  # its requests were there
    assert max(streams.times.values()) - t_kill < 10


def test_closed_grpc_stream_stops_its_request(supervised):
    server = supervised.server
    assert wait_until(lambda: not supervised.recovering and server.is_ready(), 60)
    client, q = grpcclient.InferenceServerClient(server.grpc_url), queue.Queue()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    inputs = grpc_inputs(text_input="def f(x):", max_tokens=LONG, stream=True, ignore_eos=True)
    client.async_stream_infer("lightspec", inputs)
    for _ in range(3):
        _, error = q.get(timeout=60)
        assert error is None
    assert wait_until(lambda: metric_max(server, "num_requests_running") >= 1, 2.0)  # it is running
    client.stop_stream(cancel_requests=True)  # what a client that goes away does to its stream
    client.close()
    t_close = time.monotonic()
    assert wait_until(lambda: metric_max(server, "num_requests_running") == 0, 2.0)
    print(f"\nclosed stream: request stopped within {time.monotonic() - t_close:.2f} s")
    assert wait_until(lambda: metric_max(server, "kv_cache_usage") == 0.0, 2.0)


# ---- lightspec serve: SIGTERM drains -------------------------------------------------------------


def serve(smoke_model, tmp_path, grace: float) -> tuple[subprocess.Popen, str, str]:
    env = {**os.environ, "LIGHTSPEC_CACHE": str(tmp_path / "cache")}
    cmd = [sys.executable, "-c", "import sys; from lightspec_backend.cli import main; sys.exit(main())", "serve",
           "--model-dir", str(smoke_model / "target"), "--http-port", "0", "--grpc-port", "0", "--metrics-port", "0",
           "--grace-period", str(grace), *[a for k, v in OVERRIDES.items() for a in ("--set", f"{k}={v}")]]  # fmt: skip
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = ""
    deadline = time.monotonic() + 600
    while "Ctrl-C to stop" not in out and time.monotonic() < deadline and proc.poll() is None:
        out += proc.stdout.readline()
    grpc = re.search(r"gRPC\s+(\S+)", out)
    assert grpc, out
    return proc, grpc.group(1), out


def test_sigterm_drains_then_cancels_and_exits_0(smoke_model, tmp_path):
    proc, url, banner = serve(smoke_model, tmp_path, grace=2.0)
    try:
        short = Streams(url, n=4, max_tokens=16)
        # six streams of 1000 tokens share the engine (and fit its 8192 KV slots together): 1000
        # steps, seconds past the grace period on any machine that serves the smoke model. Without
        # speculation: with it their pace follows the smoke heads' acceptance (3 tokens a step
        # finished them inside the grace period)
        long = Streams(url, n=6, max_tokens=1000, num_draft_tokens=0)
        # through the batched front too: its inner requests' CANCELLED reaches it in band (Triton 2.51
        # loses an error sent to a BLS caller from the orchestrator's response thread)
        batched = Streams(url, n=2, max_tokens=1000, model="lightspec_batched", num_draft_tokens=0)
        long.wait_started()
        batched.wait_started()
        t_term = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        late = Streams(url, n=1, max_tokens=8)
        late.join(30)
        short.join(30)
        long.join(30)
        batched.join(30)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out
    print(f"\nSIGTERM: exit 0 after {time.monotonic() - t_term:.1f} s (grace 2 s)")
    assert time.monotonic() - t_term < 2.0 + 20
    assert late.results[0][0] == "error" and "shutting down" in late.results[0][1], late.results
    assert all(r[0] == "ok" for r in short.results.values()), short.results
    assert all(r[0] == "ok" or "cancelled" in r[1] for r in long.results.values()), long.results
    assert any(r[0] == "error" for r in long.results.values()), long.results  # still running at 2 s
    assert all(r[0] == "ok" or "cancelled" in r[1] for r in batched.results.values()), batched.results
    assert any(r[0] == "error" for r in batched.results.values()), batched.results
    log = re.search(r"log\s+(\S+\.log)", banner)
    text = Path(log.group(1)).read_text() if log else ""
    assert log and "Exit timeout expired" not in text
    # the orchestrator is unloaded first (nothing in flight any more), the stages after it
    assert text.index("successfully unloaded 'lightspec' ") < text.index("successfully unloaded 'lightspec_target' ")
    assert not list(Path("/dev/shm").glob(f"lightspec_{proc.pid}_*"))
