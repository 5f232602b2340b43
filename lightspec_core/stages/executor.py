"""How the engine reaches its stages: in this process (``LocalExecutor``), or per stage through
another executor (``RoutingExecutor``); the Triton backend adds the BLS executor."""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

import numpy as np
import torch

from ..spec.calibrate import ProfileSpec, profile_propose, profile_verify
from ..spec.cost import ProposeCost, VerifyCost

log = logging.getLogger("lightspec")


class Executor(Protocol):
    """How the engine reaches its stages. ``submit`` must not block on the stage's work when the
    engine pipelines (depth 2); results arrive through the future, which carries ``t_done``
    (``time.perf_counter()`` when the stage's answer arrived) where the executor knows it (see
    :func:`submit_timed`)."""

    def submit(self, stage: str, call) -> Future: ...

    def profile(self, stage: str, spec: ProfileSpec) -> VerifyCost | ProposeCost:
        """The stage's cost profile for ``spec`` (see ``calibrate``): ``target`` gives a
        ``VerifyCost``, a proposer stage a ``ProposeCost``. Timed where the stage runs."""
        ...

    def close(self) -> None: ...


def submit_timed(pool: ThreadPoolExecutor, fn, *args) -> Future:
    """``pool.submit(fn, *args)``, whose future carries ``t_done``, stamped in the worker when ``fn``
    returned, before the result is set. A done-callback stamps after ``set_result`` has woken the
    waiting thread, so its time depends on which thread the interpreter runs first; this one does
    not."""
    fut: Future = Future()

    def run() -> None:
        if fut.set_running_or_notify_cancel():
            _settle(fut, fn, *args)

    # a pool shut down with cancel_futures drops ``run``: its caller must not wait for ever
    pool.submit(run).add_done_callback(lambda work: fut.cancel() if work.cancelled() else None)
    return fut


def _settle(fut: Future, fn, *args) -> None:
    """Run ``fn`` and hand its result or exception to ``fut``, stamping ``t_done`` first."""
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - handed to the waiting thread, as pool.submit does
        fut.t_done = time.perf_counter()
        fut.set_exception(e)
    else:
        fut.t_done = time.perf_counter()
        fut.set_result(result)


def decodes_only(call) -> bool:
    """Whether ``call`` is a target or draft call in which every request feeds one token (no
    prompt chunk, no drafts to verify)."""
    lens = getattr(call, "query_lens", None)
    return lens is not None and len(lens) > 0 and int(np.max(lens)) == 1


class LocalExecutor:
    """Runs stages in this process. With ``threaded=True`` each stage has one worker thread (like
    one Triton model instance), so a target call and an MTP/draft call can overlap; torch releases
    the GIL inside its kernels.

    ``decode_threads`` (0: unchanged): torch's intra-op threads for the calls in which every request
    decodes one token (:func:`decodes_only`), the others keeping the count torch had when the
    executor was made. Such a call has the least compute per token it streams: in a server, whose
    responses take a share of the same cores, a second OpenMP worker there mostly takes CPU from
    them (docs/benchmarks.md). ``decode_nice`` (0: unchanged): where such a call runs on one thread
    (``decode_threads`` 1), the nice value that thread runs it at (:class:`LoneDecodePriority`)."""

    def __init__(
        self, runners: dict[str, object], threaded: bool = False, decode_threads: int = 0, decode_nice: int = 0
    ):
        self.runners = runners
        self.threaded = threaded
        self._profiles: dict[tuple[str, str], VerifyCost | ProposeCost] = {}  # (stage, spec JSON) -> profile
        self._pools = (
            {name: ThreadPoolExecutor(1, thread_name_prefix=f"stage-{name}") for name in runners} if threaded else {}
        )
        self._threads = (decode_threads, torch.get_num_threads()) if decode_threads else None
        self._priority = LoneDecodePriority(decode_nice) if decode_nice and decode_threads == 1 else None

    def submit(self, stage: str, call) -> Future:
        runner = self.runners[stage]
        if self.threaded:
            return submit_timed(self._pools[stage], self._execute, runner, call)
        fut: Future = Future()
        _settle(fut, self._execute, runner, call)  # a failure reaches the engine through the future, like a BLS error
        return fut

    def set_threads(self, n: int) -> None:
        """torch's intra-op threads from the next call on: ``n`` for every call, or at most
        ``decode_threads`` for a decode-only one."""
        self._threads = (min(self._threads[0], n) if self._threads else n, n)

    def _execute(self, runner, call):
        if self._threads is not None:
            decode, other = self._threads
            lone = decodes_only(call)
            n = decode if lone else other
            if torch.get_num_threads() != n:  # torch's setter is not free: skip it when nothing changes
                torch.set_num_threads(n)
            if self._priority is not None:
                self._priority.apply(lone)
        return runner.execute(call)

    def profile(self, stage: str, spec: ProfileSpec) -> VerifyCost | ProposeCost:
        if stage not in self.runners:
            raise ValueError(f"stage {stage!r}: not run by this executor (runs: {sorted(self.runners)})")
        key = (stage, spec.to_json())
        if key not in self._profiles:  # a stage model takes its profile while it loads, then answers from it
            timing = profile_verify if stage == "target" else profile_propose
            self._profiles[key] = timing(self, spec, set(self.runners))
        return self._profiles[key]

    def close(self) -> None:
        for p in self._pools.values():
            p.shutdown(wait=True)


class LoneDecodePriority:
    """The nice value of the thread that runs a stage call: ``nice`` (negative: a higher priority)
    for a decode-only call on one thread, the thread's own for every other call.

    Why: a server's engine decodes on one thread and leaves the other cores to Triton's frontend,
    the stub's responses and local clients, but the scheduler still gives that thread's core to
    them whenever they all wake at once. At c=64 without speculation on two cores it was preempted
    about 2000 times a second and ran 0.78 of a core, with a fifth of the CPU idle; at nice -10 it
    ran 0.93 of a core and the server made 1.08-1.14x the tokens (docs/benchmarks.md). Not for a
    call on several threads: there the OpenMP workers, at the process's priority, are the ones the
    serving side takes, and the raised thread waits for them at each loop's end (0.91x at MTP c=64).

    Per thread (Linux's ``setpriority`` of a thread id). Raising a priority needs ``CAP_SYS_NICE``
    (root outside a container; ``docker run --cap-add SYS_NICE``): without it the calls keep the
    thread's priority and the first refusal is logged."""

    def __init__(self, nice: int):
        self.nice = nice
        self._own: dict[int, int] = {}  # thread id -> its nice before the first call
        self._now: dict[int, int] = {}  # thread id -> its nice now
        self._refused = False

    def apply(self, raised: bool) -> None:
        if self._refused:
            return
        tid = threading.get_native_id()
        if tid not in self._own:
            self._own[tid] = self._now[tid] = os.getpriority(os.PRIO_PROCESS, 0)  # 0: this thread
        want = min(self.nice, self._own[tid]) if raised else self._own[tid]
        if self._now[tid] == want:
            return
        try:
            os.setpriority(os.PRIO_PROCESS, 0, want)
        except PermissionError:
            self._refused = True
            log.warning(
                "decode_nice %d: raising the decoding thread's priority is not permitted (needs "
                "CAP_SYS_NICE, e.g. docker run --cap-add SYS_NICE); decoding keeps nice %d",
                self.nice,
                self._own[tid],
            )
            return
        self._now[tid] = want


class RoutingExecutor:
    """Sends each stage to its own executor, e.g. MTP heads in this process and the target over BLS
    (saves one inter-process round trip per step where the heads are cheap)."""

    def __init__(self, routes: dict[str, Executor]):
        self.routes = routes

    def submit(self, stage: str, call) -> Future:
        if stage not in self.routes:
            raise ValueError(f"stage {stage!r}: no executor configured (known: {sorted(self.routes)})")
        return self.routes[stage].submit(stage, call)

    def profile(self, stage: str, spec: ProfileSpec) -> VerifyCost | ProposeCost:
        if stage not in self.routes:
            raise ValueError(f"stage {stage!r}: no executor configured (known: {sorted(self.routes)})")
        return self.routes[stage].profile(stage, spec)

    def close(self) -> None:
        for ex in {id(e): e for e in self.routes.values()}.values():
            ex.close()
