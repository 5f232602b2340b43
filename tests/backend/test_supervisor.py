"""When the supervisor restarts the server for a stage fault. The server here is a stand-in that
records when it was killed (tests/e2e/test_faults.py holds a real tritonserver to the same
contract); the orchestrator's side is the real ``Drain`` over the real control directory, polled
the way its watcher thread polls it."""

from __future__ import annotations

import threading
import time

from lightspec_backend.control import ControlDir, Drain
from lightspec_backend.supervisor import Fault, Supervisor


class RecordingServer:
    base_env = None
    http_port = grpc_port = metrics_port = 0
    pid = 0
    log_file = "/logs/tritonserver-1.log"

    def __init__(self):
        self.killed_at: float | None = None
        self.requested_ports = None

    def is_alive(self) -> bool:
        return self.killed_at is None

    def kill(self) -> None:
        self.killed_at = time.monotonic()

    def stop(self) -> int | None:
        return None

    def start(self, timeout_s: float) -> None:
        pass

    def stubs(self) -> list:
        return []


def orchestrator(control: ControlDir, answer_s: float | None, stop: threading.Event) -> dict:
    """Reports a stage fault at once, then hands its 8 requests their final answers one by one over
    ``answer_s`` (never, with ``None``); ``times['answered']``: when the last one went out."""
    times: dict[str, float] = {}

    def run() -> None:
        drain, t0 = Drain(control), time.monotonic()
        control.report_fault("lightspec_target", "stage model 'lightspec_target' unavailable: not healthy")
        while not stop.wait(0.05):
            if answer_s is None:
                continue
            in_flight = max(0, 8 - int(8 * (time.monotonic() - t0) / answer_s))
            if in_flight == 0:
                times.setdefault("answered", time.monotonic())
            drain.poll(in_flight)

    threading.Thread(target=run, daemon=True).start()
    return times


def test_a_stage_fault_restarts_the_server_only_after_the_orchestrator_answered_everyone(tmp_path):
    server = RecordingServer()
    sup = Supervisor(server, tmp_path / "control", log=lambda msg: None)
    sup.start()
    stop = threading.Event()
    times = orchestrator(sup.control, answer_s=0.8, stop=stop)
    try:
        sup.recover(Fault("stage model 'lightspec_target' stopped answering", stage_answered=True))
    finally:
        stop.set()
    assert "answered" in times and server.killed_at is not None
    assert server.killed_at >= times["answered"]  # a fixed pause after the report killed at ~0.25 s
    assert sup.restarts == 1 and not sup.recovering


def test_a_restart_names_the_new_servers_log(tmp_path):
    server, lines = RecordingServer(), []
    sup = Supervisor(server, tmp_path / "control", log=lines.append)
    sup.start()
    server.log_file = "/logs/tritonserver-2.log"  # each start writes a new file
    sup.recover(Fault("tritonserver exited", stage_answered=False))
    assert lines[-1] == "tritonserver is serving again (pid 0, log /logs/tritonserver-2.log)"


def test_an_orchestrator_that_never_answers_delays_the_restart_by_a_bounded_time(tmp_path):
    server = RecordingServer()
    sup = Supervisor(server, tmp_path / "control", settle_s=0.3, log=lambda msg: None)
    sup.start()
    stop = threading.Event()
    orchestrator(sup.control, answer_s=None, stop=stop)
    t0 = time.monotonic()
    try:
        sup.recover(Fault("stage model 'lightspec_target' stopped answering", stage_answered=True))
    finally:
        stop.set()
    assert server.killed_at is not None
    assert server.killed_at - t0 < 0.3 + 1.0 + 0.5 + 1.0  # the drain's wait (settle_s + 1 s), the pause, slack


class LoadingServer(RecordingServer):
    """A server still loading its models when the user's Ctrl-C arrives (raised from ``start``, as
    serve's signal handler raises it from the readiness wait)."""

    def start(self, timeout_s: float) -> None:
        raise KeyboardInterrupt


def test_a_signal_while_the_server_loads_stops_it_at_once_without_a_drain(tmp_path):
    """Nothing is in flight before the first readiness, and tritonserver heeds SIGINT only once its
    load is done: the drain would wait its whole grace for an orchestrator that is not there yet."""
    server = LoadingServer()
    sup = Supervisor(server, tmp_path / "control", log=lambda msg: None)
    try:
        sup.start()
    except KeyboardInterrupt:
        pass
    t0 = time.monotonic()
    sup.shutdown(grace_s=30.0)
    assert server.killed_at is not None and server.killed_at - t0 < 1.0
    assert sup.control.drain_deadline() is None  # no drain was asked of anyone
