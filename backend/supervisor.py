"""Keep a tritonserver that serves LightSpec serving: what ``lightspec serve`` runs.

Triton 2.51's Python backend leaves three faults to whoever started the server: it never restarts a
stub process that died (every later call to that model fails, readiness stays 200), a stub that
misses its hard-wired 1 s health deadline (a stall: SIGSTOP, swap) poisons the channel to it (a
later call can crash the whole server), and a crash leaves its shared memory in ``/dev/shm``. The
supervisor polls the server and its stubs every ``poll_s``; on a fault it restarts the server on
the same ports, which takes one model load (seconds for the embedded model):

- a stage stub died or stalled: the orchestrator's calls to it fail within ~1 s and it answers
  those requests UNAVAILABLE naming the stage, reporting the fault (:mod:`.control`); the
  supervisor waits for that report, then drains the orchestrator so those answers go out, then
  restarts;
- the orchestrator's stub died: its clients would wait forever; the restart closes their
  connections at once;
- the server exited (a crash): restart.

:meth:`shutdown` drains: the orchestrator stops admitting, in-flight requests get ``grace_s`` to
finish, then the orchestrator is unloaded ahead of the stages and the server stopped.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .control import CONTROL_ENV, RESTARTS_ENV, ControlDir
from .launcher import TritonServer


@dataclass(frozen=True)
class Fault:
    reason: str
    stage_answered: bool  # the orchestrator is alive to answer its requests before the restart


class Supervisor:
    def __init__(
        self,
        server: TritonServer,
        control_dir: str | Path,
        *,
        orchestrator: str = "lightspec",
        poll_s: float = 0.5,
        settle_s: float = 3.0,
        log=None,
    ):
        self.server = server
        self.control = ControlDir(control_dir)
        self.orchestrator = orchestrator
        self.poll_s = poll_s
        self.settle_s = settle_s
        self.log = log or (lambda msg: print(f"[lightspec serve] {msg}", file=sys.stderr, flush=True))
        self.restarts = 0
        self.events: list[tuple[float, str]] = []  # (time.time(), reason) of every restart
        self.recovering = False  # between a fault's detection and the new server's readiness
        self.serving = False  # the server came up ready and has not been stopped since
        self._stubs: set[str] = set()

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, timeout_s: float = 600.0) -> None:
        """Start the server (fresh control directory, restart count in its environment)."""
        self.serving = False
        self.control.reset()
        env = dict(self.server.base_env) if self.server.base_env is not None else None
        self.server.base_env = {**(env if env is not None else dict(os.environ)), CONTROL_ENV: str(self.control.path),
                                RESTARTS_ENV: str(self.restarts)}  # fmt: skip
        self.server.start(timeout_s=timeout_s)
        self._stubs = {s.name for s in self.server.stubs() if s.alive}
        self.serving = True

    def run(self, stop=None) -> None:
        """Watch and recover until ``stop`` (a ``threading.Event``) is set; forever without one."""
        while stop is None or not stop.is_set():
            fault = self.check()
            if fault is not None:
                self.recover(fault)
            time.sleep(self.poll_s)

    def check(self) -> Fault | None:
        """The server's fault right now, if any."""
        if not self.server.is_alive():
            return Fault(f"tritonserver exited with code {self.server.process.returncode}", False)
        alive = {s.name for s in self.server.stubs() if s.alive}
        for name in sorted(self._stubs - alive):
            orchestrator = re.fullmatch(rf"{re.escape(self.orchestrator)}_\d+_\d+", name) is not None
            return Fault(f"stub process {name!r} died", not orchestrator)
        faults = self.control.faults()
        if faults:
            return Fault(f"stage model {faults[0].get('stage')!r} stopped answering ({faults[0].get('message')})", True)
        return None

    def recover(self, fault: Fault, timeout_s: float = 600.0) -> None:
        """Restart the server on the same ports; retried until it comes up."""
        self.recovering = True
        self.restarts += 1
        self.events.append((time.time(), fault.reason))
        self.log(f"{fault.reason}: restarting tritonserver (restart {self.restarts})")
        if fault.stage_answered and self.server.is_alive():
            self._let_answers_out()
        self.server.kill()
        self.server.requested_ports = (self.server.http_port, self.server.grpc_port, self.server.metrics_port)
        for attempt in range(5):
            try:
                self.start(timeout_s)
                break
            except RuntimeError as e:
                self.log(f"restart failed ({str(e).splitlines()[0]}); retrying")
                self.server.kill()
                if attempt == 4:
                    raise
                time.sleep(1.0)
        self.recovering = False
        # a restarted server logs to a new file: the one printed at the start is the dead server's
        self.log(f"tritonserver is serving again (pid {self.server.pid}, log {self.server.log_file})")

    def _let_answers_out(self) -> None:
        """Before a restart for a stage fault: wait (at most ``settle_s`` each) for the orchestrator's
        fault report, then for it to have handed every in-flight request its final answer. The
        report comes as the stage call fails, before the orchestrator answers that step's requests:
        a restart then, or after a fixed pause on busy cores, closes the clients' streams first
        ("Socket closed" instead of UNAVAILABLE naming the stage). A drain gives the moment: the
        orchestrator marks it once nothing is in flight, and turns new requests away meanwhile;
        what is still running at its deadline is cancelled. The log says how it went."""
        deadline = time.monotonic() + self.settle_s
        while not self.control.faults() and time.monotonic() < deadline:
            time.sleep(0.05)
        t0 = time.monotonic()
        drained = self._drain(self.settle_s, 1.0)
        waited = time.monotonic() - t0
        if drained:
            self.log(f"every in-flight request answered after {waited:.1f} s")
        elif self.server.is_alive():
            self.log(f"requests still in flight after {waited:.1f} s: the restart closes their streams")
        # Handed to the server is not yet at the client: Triton's gRPC and HTTP frontends write
        # responses from their own threads, which a loaded machine runs late.
        time.sleep(0.5)

    def _drain(self, grace_s: float, extra_s: float) -> bool:
        """Ask the orchestrator to drain within ``grace_s`` (it cancels what is left then) and wait
        up to ``extra_s`` longer for its mark; whether it came."""
        self.control.request_drain(grace_s)
        deadline = time.monotonic() + grace_s + extra_s
        while not self.control.is_drained() and self.server.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.control.is_drained()

    def shutdown(self, grace_s: float = 30.0) -> int | None:
        """Drain, unload the orchestrator, stop the server; returns its exit code. A server still
        loading (the first start or a restart) is killed instead: nothing is in flight yet, and
        tritonserver heeds SIGINT only once its load is done, minutes for a large checkpoint."""
        if not self.serving:
            self.server.kill()
            return None
        if self.server.is_alive():
            self._drain(grace_s, 5.0)
            self._unload(self.orchestrator)
        return self.server.stop()

    def _unload(self, model: str) -> None:
        url = f"http://{self.server.http_url}/v2/repository/models/{model}/unload"
        request = urllib.request.Request(url, data=b"{}", method="POST")
        with contextlib.suppress(urllib.error.URLError, OSError):
            urllib.request.urlopen(request, timeout=30).close()
