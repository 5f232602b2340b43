"""The files through which ``lightspec serve``'s supervisor and the orchestrator model talk.

The supervisor (:mod:`lightspec_backend.supervisor`) runs outside Triton; the orchestrator runs in a
Python backend stub inside it. Triton 2.51 offers no channel between the two, so they share a
directory, named to the server (and inherited by its stubs) in ``$LIGHTSPEC_CONTROL_DIR``:

- ``drain``: written by the supervisor on SIGTERM; JSON ``{"deadline": <unix time>}``. The
  orchestrator then answers new requests UNAVAILABLE, lets in-flight ones finish until the deadline
  and cancels the rest;
- ``drained``: written by the orchestrator once draining and nothing is in flight;
- ``fault``: written by the orchestrator when a stage model stops answering (one JSON line per
  event, ``{"stage": ..., "message": ...}``); the supervisor restarts the server on it.

``$LIGHTSPEC_RESTARTS`` tells a restarted server how many restarts preceded it, for the
``lightspec:server_restarts_total`` counter (Triton's metrics start from zero in a new process).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

CONTROL_ENV = "LIGHTSPEC_CONTROL_DIR"
RESTARTS_ENV = "LIGHTSPEC_RESTARTS"


class ControlDir:
    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> ControlDir | None:
        value = (os.environ if env is None else env).get(CONTROL_ENV, "")
        return cls(value) if value else None

    def _write(self, name: str, text: str) -> None:
        tmp = self.path / f".{name}.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, self.path / name)  # atomic: a reader never sees half a file

    # -- drain: supervisor -> orchestrator ------------------------------------------------------
    def request_drain(self, grace_s: float) -> None:
        self._write("drain", json.dumps({"deadline": time.time() + grace_s}))

    def drain_deadline(self) -> float | None:
        """The drain deadline (unix time) once a drain was requested, else ``None``."""
        try:
            return float(json.loads((self.path / "drain").read_text())["deadline"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def mark_drained(self) -> None:
        self._write("drained", "")

    def is_drained(self) -> bool:
        return (self.path / "drained").exists()

    # -- faults: orchestrator -> supervisor -----------------------------------------------------
    def report_fault(self, stage: str, message: str) -> None:
        with open(self.path / "fault", "a") as f:
            f.write(json.dumps({"stage": stage, "message": message}) + "\n")

    def faults(self) -> list[dict]:
        try:
            lines = (self.path / "fault").read_text().splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def reset(self) -> None:
        """Forget every message: a fresh server starts from a clean directory."""
        self.path.mkdir(parents=True, exist_ok=True)
        for name in ("drain", "drained", "fault"):
            with contextlib.suppress(FileNotFoundError):
                (self.path / name).unlink()


def restarts_from_env(env: dict[str, str] | None = None) -> int:
    """How many times the supervisor restarted the server before this process started."""
    try:
        return max(int((os.environ if env is None else env).get(RESTARTS_ENV, "0")), 0)
    except ValueError:
        return 0


class Drain:
    """The orchestrator's view of a drain request, polled by its watcher thread."""

    def __init__(self, control: ControlDir | None):
        self.control = control
        self.deadline: float | None = None  # unix time, once the supervisor asked for a drain
        self._marked = False

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def poll(self, in_flight: int) -> bool:
        """Notice a drain request; mark the directory drained once nothing is in flight. Returns
        whether the deadline has passed (what is still in flight is to be cancelled)."""
        if self.control is None:
            return False
        if self.deadline is None:
            self.deadline = self.control.drain_deadline()
            if self.deadline is None:
                return False
        if not self._marked and in_flight == 0:
            self._marked = True
            self.control.mark_drained()
        return time.time() >= self.deadline
