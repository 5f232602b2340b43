"""The engine in a child process: :class:`EngineProcess` has :class:`LLMEngine`'s serving surface
and forwards it to an engine that runs its own step loop in a process of its own (vLLM's
engine-core layout).

Why a process: a server answers every token with interpreter work (a response's tensors, the send),
and in one process that work and the engine's forward pass take turns at the interpreter lock; at
64 requests the forward pass waits for the lock about as long as it computes. In its own process
the engine loop never waits for it, and one message a step carries all of the step's deltas.

The parent keeps what answers a request without the model: the tokenizer, so that a bad prompt is
refused at once with the engine's own error (:func:`~lightspec_core.engine.sequence.checked_prompt`),
and the statistics the child last reported. The child steps while it has work, sending
``("deltas", deltas, stats)`` after each step (``stats``, a snapshot and the drained observations,
at most every ``stats_interval_s`` and whenever it goes idle), and reads ``add``/``abort``/``threads``/``stop``
between steps. If the child dies, its requests end with an ``error`` delta and so does every later
one; ``on_exit`` is told once (a server reports it to its supervisor, which restarts it), as
soon as the child exits, whether it held requests or not: a thread waits for it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection

from ..config import EngineConfig, SamplingParams, resolve_dirs
from ..models.llama import LlamaConfig
from ..models.tokenizer import TokenizerInfo
from .outputs import RequestDelta
from .sequence import checked_prompt

log = logging.getLogger("lightspec")


def python_executable() -> str:
    """The interpreter for the child. Inside Triton's Python backend ``sys.executable`` is the
    backend's stub binary, not a Python: take the one of the environment that runs this module."""
    if os.path.basename(sys.executable).startswith("python"):
        return sys.executable
    for name in ("python3", "python"):
        path = os.path.join(sys.prefix, "bin", name)
        if os.path.exists(path):
            return path
    raise RuntimeError(f"no Python interpreter under {sys.prefix}/bin for the engine process")


class RemoteStats:
    """The child's statistics as it last reported them, plus the requests refused in this process
    (the part of :class:`~lightspec_core.engine.stats.RuntimeStats` that a server reads)."""

    def __init__(self, snapshot: dict):
        self._snapshot = snapshot
        self._observations: list = []
        self._rejected = 0
        self._lock = threading.Lock()

    def update(self, snapshot: dict, observations: list) -> None:
        self._snapshot = snapshot
        self._observations.extend(observations)

    def count_rejected(self) -> None:
        with self._lock:
            self._rejected += 1

    def snapshot(self) -> dict:
        d = dict(self._snapshot)
        with self._lock:
            d["request_failure_total"] = d.get("request_failure_total", 0) + self._rejected
        return d

    def drain_observations(self) -> list:
        out, self._observations = self._observations, []
        return out


class EngineProcess:
    """An :class:`LLMEngine` in a child process. One thread drives it (the server's engine loop),
    as with the engine itself; ``stats.count_rejected`` may be called from any thread."""

    profile_pending = False  # the child profiles its stages while it loads

    def __init__(
        self,
        config: EngineConfig,
        *,
        stats_interval_s: float = 0.25,
        on_exit: Callable[[str], None] | None = None,
        start_timeout_s: float = 600.0,
        stall_timeout_s: float = 0.0,
    ):
        """``stall_timeout_s`` (0: none): a child holding requests that sends nothing for this long is
        hung (a deadlock, a stopped process): it is killed, and handled as a child that died."""
        # a fresh interpreter running this module, not multiprocessing's spawn, which re-runs the
        # parent's main module (a user's script, or whatever Triton's stub calls its main)
        ours, theirs = socket.socketpair()
        self._proc = subprocess.Popen(
            [python_executable(), "-m", __name__, "--fd", str(theirs.fileno())], pass_fds=[theirs.fileno()]
        )
        theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send((config, stats_interval_s))
        self._on_exit = None  # a child that fails to load is the load's error, not a fault to report
        self._dead: str | None = None
        self._unfinished: set[str] = set()
        self._failed: list[tuple[str, str]] = []
        self._step_error: str | None = None  # a child's step failure, raised once its deltas are out
        self.stall_timeout_s = stall_timeout_s
        self._heard = time.monotonic()  # the child's last message, or when it was given work while idle
        ready = self._wait_ready(start_timeout_s)
        self.config, self.max_model_len = ready["config"], ready["max_model_len"]
        target_dir = resolve_dirs(config)[0]
        self.model_config = LlamaConfig.from_dir(target_dir)
        self.tok = TokenizerInfo.from_dir(target_dir)
        self.tokenizer = self.tok.tokenizer
        self.stats = RemoteStats(ready["snapshot"])
        self.pid = self._proc.pid
        self._on_exit = on_exit
        self._closing = False
        self._exit_told = threading.Lock()  # taken once, by whoever finds the exit first
        # An idle child is not read from: without this thread its exit would be found only when a
        # request is given to it, which would then fail instead of waiting for the restart.
        threading.Thread(target=self._watch, name="engine-process-watch", daemon=True).start()

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while not self._conn.poll(0.5):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"the engine process did not start (exit code {self._proc.returncode})")
        try:
            kind, payload = self._conn.recv()
        except EOFError:
            kind, payload = "error", f"the engine process exited (code {self._proc.wait()})"
        if kind != "ready":
            self.close()
            raise RuntimeError(payload)
        return payload

    # ---- LLMEngine's serving surface ------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        arrived_at: float | None = None,
    ) -> None:
        params = params or SamplingParams()
        arrived_at = time.perf_counter() if arrived_at is None else arrived_at  # not when the child reads it
        if request_id in self._unfinished:
            raise ValueError(f"request_id={request_id!r}: already in use")
        try:  # the child gets token ids: the text is encoded here, once
            ids = checked_prompt(
                self.tok, self.model_config.vocab_size, self.max_model_len, prompt, params, add_special_tokens
            )
        except ValueError:
            self.stats.count_rejected()
            raise
        if not self._unfinished:
            self._heard = time.monotonic()  # an idle child is silent: its clock starts with the work
        self._unfinished.add(request_id)
        if self._dead is not None:
            self._failed.append((request_id, self._dead))  # answered by the next step
        else:
            self._send(("add", request_id, ids, params, arrived_at))  # if the child is gone, the next step fails it

    def abort(self, request_id: str, error: str | None = None) -> None:
        if request_id in self._unfinished:
            self._send(("abort", request_id, error))

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def num_unfinished(self) -> int:
        return len(self._unfinished)

    @property
    def alive(self) -> bool:
        """Whether the child still runs (False once it is found gone, or has exited unread)."""
        return self._dead is None and self._proc.poll() is None

    def waits_for_child(self) -> bool:
        """Whether :meth:`step` would wait for the child (False: it answers from what it knows,
        or finds it hung)."""
        return self._dead is None and not self._failed and self._step_error is None and not self._stalled()

    def _stalled(self) -> bool:
        quiet = time.monotonic() - self._heard
        return self.stall_timeout_s > 0 and bool(self._unfinished) and quiet > self.stall_timeout_s

    def set_threads(self, n: int) -> None:
        """The child's engine computes its next calls on ``n`` intra-op threads (see
        ``LocalExecutor.set_threads``)."""
        self._send(("threads", n))

    def profile_stages(self) -> None:
        """Nothing to do: the child took the stage profile while it loaded."""

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestDelta]:
        """The deltas of every step the child finished since the last call (waiting for one when
        there are none yet). ``on_launched`` is called first: the child computes meanwhile."""
        if on_launched is not None:
            on_launched()
        if self._step_error is not None:
            message, self._step_error = self._step_error, None
            self._fail_step(message)
        deltas = self._receive() if self._unfinished and not self._failed else []
        deltas += [error_delta(rid, message) for rid, message in self._failed]
        self._failed.clear()
        for d in deltas:
            if d.finished:
                self._unfinished.discard(d.request_id)
        if self._dead is not None:  # what the child held and did not finish
            deltas += [error_delta(rid, self._dead) for rid in sorted(self._unfinished)]
            self._unfinished.clear()
        return deltas

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        self._send(("stop",))
        try:
            self._proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(timeout_s)
        self._conn.close()

    # ---- the pipe ----------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        if self._dead is None:
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                self._died()

    def _receive(self) -> list[RequestDelta]:
        """What the child sent since the last call, waiting for its next message if it sent none
        (or until it is found dead)."""
        deltas: list[RequestDelta] = []
        while not self._conn.poll(min(1.0, self.stall_timeout_s or 1.0)):
            if self._proc.poll() is not None:
                self._died()
                return deltas
            if self._stalled():
                self._kill_hung()
                return deltas
        self._heard = time.monotonic()
        try:
            while self._step_error is None:
                kind, *payload = self._conn.recv()
                if kind == "deltas":
                    deltas += payload[0]
                    if payload[1] is not None:
                        self.stats.update(*payload[1])
                elif kind == "failed":
                    deltas.append(error_delta(*payload))
                elif kind == "step_error":
                    log.error("engine process step failed: %s", payload[1])
                    self._step_error = payload[0]
                if not self._conn.poll(0):
                    break
        except (EOFError, OSError):
            self._died()
        if self._step_error is not None and not deltas:
            message, self._step_error = self._step_error, None
            self._fail_step(message)
        return deltas

    def _fail_step(self, message: str) -> None:
        """Raise the child's step failure, which fails every request in flight (the caller answers
        them): the child aborts what it still holds and none is waited for any more. A request
        aborted just before the failed step has no final coming (the step built it, then raised),
        and waiting for it would block every later step."""
        for rid in sorted(self._unfinished):
            self._send(("abort", rid, f"engine step failed: {message}"))
        self._unfinished.clear()
        raise RuntimeError(message)

    def _died(self) -> None:
        """The child is gone: what it held and every later request end with an error delta (see
        :meth:`step`); ``on_exit`` is told once."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(1.0)
        self._dead = _exit_message(self._proc.returncode)
        self._tell_exit(self._dead)

    def _kill_hung(self) -> None:
        """The child sent nothing for ``stall_timeout_s`` while it held requests: killed, it ends
        them UNAVAILABLE (see :meth:`step`) and is reported, as a child that died."""
        self._dead = f"the engine process is unavailable: it sent nothing in {self.stall_timeout_s:g} s (hung: killed)"
        log.error("%s", self._dead)
        self._tell_exit(self._dead)
        self._proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(5.0)

    def _watch(self) -> None:
        code = self._proc.wait()
        if not self._closing:
            self._tell_exit(_exit_message(code))

    def _tell_exit(self, message: str) -> None:
        if self._on_exit is not None and self._exit_told.acquire(blocking=False):
            with contextlib.suppress(Exception):
                self._on_exit(message)


def _exit_message(code: int | None) -> str:
    # "unavailable:" as in a stage's StageUnavailable: a server answers UNAVAILABLE (retry later)
    return f"the engine process is unavailable: it exited (code {code})"


def error_delta(request_id: str, message: str) -> RequestDelta:
    return RequestDelta(request_id, [], "", finished=True, finish_reason="error", error=message)


def _child_main(conn: Connection) -> None:
    import gc

    from ..stages.memory import keep_freed_memory
    from .engine import LLMEngine

    config, stats_interval_s = conn.recv()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches the process group: the parent drains
    keep_freed_memory()  # as in a stage process: a step's large temporaries reuse freed memory
    try:
        engine = LLMEngine(config)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", f"the engine process failed to load: {type(e).__name__}: {e}"))
        return
    conn.send(
        ("ready", {"config": engine.config, "max_model_len": engine.max_model_len, "snapshot": engine.stats.snapshot()})
    )
    # What the engine loaded (modules, weights' wrappers, tokenizer) is never scanned again: without
    # this, the collections that the steps' short-lived objects trigger walked it, about 4 % of
    # the process's time at c=16 (py-spy), as the stub's freeze in backend/model.py avoids there.
    gc.collect()
    gc.freeze()
    try:
        _child_loop(conn, engine, stats_interval_s)
    except (EOFError, OSError):  # the parent is gone
        pass
    finally:
        engine.close()


def _child_loop(conn, engine, stats_interval_s: float) -> None:
    last_stats = 0.0
    while True:
        busy = engine.has_unfinished()
        while not busy or conn.poll(0):
            message = conn.recv()  # blocks while idle
            if message[0] == "stop":
                return
            if message[0] == "threads":
                engine.executor.set_threads(message[1])
            elif message[0] == "add":
                try:
                    rid, ids, params, arrived_at = message[1:]
                    engine.add_request(rid, ids, params, arrived_at=arrived_at)
                except Exception as e:  # noqa: BLE001 - the parent checked the prompt; answer, keep serving
                    conn.send(("failed", message[1], f"the engine refused the request: {e}"))
            else:
                engine.abort(message[1], message[2])
            busy = engine.has_unfinished()
        try:
            deltas = engine.step()
        except Exception as e:  # noqa: BLE001 - the parent fails what is in flight and aborts it
            conn.send(("step_error", str(e), traceback.format_exc()))
            time.sleep(0.05)  # do not spin if every step keeps failing
            continue
        now = time.monotonic()
        stats = None
        if now - last_stats >= stats_interval_s or not engine.has_unfinished():
            stats, last_stats = (engine.stats.snapshot(), engine.stats.drain_observations()), now
        conn.send(("deltas", deltas, stats))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an LLMEngine serving EngineProcess over a socket (internal)")
    parser.add_argument("--fd", type=int, required=True, help="the socket inherited from the parent")
    _child_main(Connection(parser.parse_args().fd))
