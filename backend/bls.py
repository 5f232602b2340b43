"""The engine's :class:`~lightspec_core.stages.Executor` over Triton BLS.

Each stage call is the stage dataclass sent field by field as tensors of the same names to the stage
model, whose response tensors are named after the result dataclass's fields. One worker thread per
stage makes the blocking ``InferenceRequest.exec()``: calls to different stages overlap (pipelining),
calls to one stage queue as they would at its single model instance anyway.

Checked with the Triton 2.51 stub: ``exec()`` works from a non-main thread once ``initialize`` has
returned (BLS inside ``initialize``/``finalize`` is not allowed), including BOOL and zero-sized tensors.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from dataclasses import fields

import numpy as np

from lightspec_core.spec.calibrate import ProfileSpec
from lightspec_core.spec.cost import ProposeCost, VerifyCost
from lightspec_core.stages.contract import ModelCall, ModelResult, MTPCall, MTPResult, from_tensors, to_tensors
from lightspec_core.stages.executor import submit_timed

RESULT_TYPES = {ModelCall: ModelResult, MTPCall: MTPResult}


class StageError(RuntimeError):
    """A stage model answered with an error or without an expected output."""


class StageUnavailable(StageError):
    """A stage model's process is gone, stalled past the stage timeout, or not loaded: the requests of
    the step end UNAVAILABLE (see :func:`is_unavailable`); a dead or stalled stage's fault is reported."""


class StageNotLoaded(StageUnavailable):
    """No version of the stage model is loaded (still loading, or unloaded), or BLS is closed to this
    model (before its own initialize returned, and again once its unload began). No stage process
    failed, so no fault is reported; a profile request waits for the load (see ``profile``)."""


UNAVAILABLE_TAG = "unavailable:"  # the prefix of every StageUnavailable message, after the model name
# What Triton 2.51's Python backend answers for a stage whose stub died or missed its 1 s health
# deadline (a stall): its own health check, not the model, failed.
_STUB_DOWN = ("is not healthy", "failed to obtain the health mutex", "stub process")


def is_unavailable(message: str) -> bool:
    """Whether an engine error message comes from a :class:`StageUnavailable`."""
    return UNAVAILABLE_TAG in message


# What Triton 2.51 answers a BLS request to a model with no version loaded, while it loads or after
# its unload (core's ModelLifeCycle::GetModel), and to any request while the server itself starts
# ("Server not ready": the stage models load beside the orchestrator at start-up). A model missing
# from the repository ("... is not found") is a configuration error that no wait mends.
_NOT_LOADED = ("has no available versions", "is not at ready state", "server not ready")
# What the Python backend stub raises from exec() outside this model's execute phase: before its
# initialize has returned (BLS from other threads works once it has) and once its finalize began.
_BLS_CLOSED = "only supported during the 'execute' function"


class BLSExecutor:
    def __init__(
        self,
        stage_models: dict[str, str],
        pb_utils,
        timeout_us: int = 0,
        load_wait_s: float = 600.0,
        *,
        stage_timeout_s: float = 0.0,
        on_fault: Callable[[str, str], None] | None = None,
    ):
        """``stage_models``: engine stage name -> Triton model name. ``pb_utils`` is the
        ``triton_python_backend_utils`` module (passed in so tests can script the stages).
        ``load_wait_s``: how long a profile request waits for a stage model that is still loading.
        ``stage_timeout_s`` (0: none): a call not answered by then fails with
        :class:`StageUnavailable` (its worker stays blocked; later calls to that stage queue behind
        it and fail the same way, and are never sent). ``on_fault(model, message)`` hears of every
        such failure and of every dead stage stub."""
        self.stage_models = dict(stage_models)
        self.pb = pb_utils
        self.timeout_us = timeout_us
        self.load_wait_s = load_wait_s
        self.stage_timeout_s = stage_timeout_s
        self.on_fault = on_fault
        self._pools = {s: ThreadPoolExecutor(1, thread_name_prefix=f"bls-{s}") for s in self.stage_models}
        # calls with a deadline, by id(outer future): (deadline, outer, model, inner future)
        self._pending: dict[int, tuple[float, Future, str, Future]] = {}
        self._pending_lock = threading.Lock()
        self._watchdog: threading.Thread | None = None
        self._closed = threading.Event()  # ends the watchdog

    def submit(self, stage: str, call) -> Future:
        if stage not in self.stage_models:
            raise ValueError(f"stage {stage!r}: no stage model configured (known: {sorted(self.stage_models)})")
        if type(call) not in RESULT_TYPES:
            raise TypeError(f"stage {stage!r}: cannot send a {type(call).__name__}")
        fut = submit_timed(self._pools[stage], self.call, self.stage_models[stage], call)
        return self._with_deadline(fut, self.stage_models[stage]) if self.stage_timeout_s > 0 else fut

    def _with_deadline(self, inner: Future, model: str) -> Future:
        """A future that follows ``inner`` but fails with :class:`StageUnavailable` once
        ``stage_timeout_s`` passes without an answer (one watchdog thread checks every deadline:
        no thread per call on the engine's hot path)."""
        outer: Future = Future()
        with self._pending_lock:
            self._pending[id(outer)] = (time.monotonic() + self.stage_timeout_s, outer, model, inner)
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="bls-deadlines", daemon=True)
                self._watchdog.start()

        def settle(f: Future) -> None:
            with self._pending_lock:
                self._pending.pop(id(outer), None)
            if outer.done() or f.cancelled():
                return  # timed out (or closed) already: the late answer is dropped
            outer.t_done = getattr(f, "t_done", time.perf_counter())
            exc = f.exception()
            with contextlib.suppress(InvalidStateError):  # the watchdog and the answer raced
                outer.set_exception(exc) if exc is not None else outer.set_result(f.result())

        inner.add_done_callback(settle)
        return outer

    def _watch(self) -> None:
        while not self._closed.wait(min(0.25, self.stage_timeout_s / 4)):
            now = time.monotonic()
            with self._pending_lock:
                expired = [k for k, (deadline, *_) in self._pending.items() if deadline <= now]
                calls = [self._pending.pop(k)[1:] for k in expired]
            for outer, model, inner in calls:
                message = f"stage model {model!r} {UNAVAILABLE_TAG} no answer in {self.stage_timeout_s:g} s"
                self._report(model, message)
                self._fail(outer, inner, StageUnavailable(message))

    @staticmethod
    def _fail(outer: Future, inner: Future, error: StageError) -> None:
        """Fail a call its caller stops waiting for. A call still queued behind a stalled one is
        never sent: sent late, it would write K/V into blocks the engine has freed and reused."""
        if not outer.done():
            outer.t_done = time.perf_counter()
        with contextlib.suppress(InvalidStateError):  # the answer came first
            outer.set_exception(error)
        inner.cancel()  # after the outer future is settled: the cancellation reaches settle()

    def _report(self, model: str, message: str) -> None:
        if self.on_fault is not None:
            # reporting must never hide the stage's own error
            with contextlib.suppress(Exception):
                self.on_fault(model, message)

    def profile(self, stage: str, spec: ProfileSpec) -> VerifyCost | ProposeCost:
        """The stage model's cost profile (it took it while loading, see ``StageModel``). Stage
        models load beside the orchestrator, so a request that finds one not loaded yet (or that
        comes before the orchestrator's own initialize returned) is retried for ``load_wait_s``,
        then fails :class:`StageUnavailable` naming the stage; any other error fails at once."""
        if stage not in self.stage_models:
            raise ValueError(f"stage {stage!r}: no stage model configured (known: {sorted(self.stage_models)})")
        model = self.stage_models[stage]
        request = np.array([spec.to_json().encode()], dtype=object)
        deadline = time.monotonic() + self.load_wait_s
        while True:
            try:
                out = self._exec(model, [self.pb.Tensor("profile_spec", request)], ["profile"])["profile"]
                break
            except StageNotLoaded as e:  # a dead stage (StageUnavailable) or any other error: at once
                if time.monotonic() >= deadline:
                    raise StageUnavailable(f"{e} (not loaded within {self.load_wait_s:g} s)") from e
                if self._closed.wait(0.2):  # unloaded while waiting
                    raise
        raw = out.reshape(-1)[0]
        d = json.loads(raw.decode() if isinstance(raw, bytes) else str(raw))
        return VerifyCost.from_dict(d) if stage == "target" else ProposeCost(**d)

    def call(self, model: str, call):
        """Blocking BLS call: dataclass in, result dataclass out."""
        result_cls = RESULT_TYPES[type(call)]
        inputs = [self.pb.Tensor(name, np.ascontiguousarray(arr)) for name, arr in to_tensors(call).items()]
        return from_tensors(result_cls, self._exec(model, inputs, [f.name for f in fields(result_cls)]))

    def _exec(self, model: str, inputs: list, names: list[str]) -> dict[str, np.ndarray]:
        pb = self.pb
        kwargs = {"timeout": self.timeout_us} if self.timeout_us else {}
        request = pb.InferenceRequest(model_name=model, inputs=inputs, requested_output_names=names, **kwargs)
        try:
            response = request.exec()
        except pb.TritonModelException as e:
            if _BLS_CLOSED in str(e):
                raise StageNotLoaded(f"stage model {model!r} {UNAVAILABLE_TAG} {e}") from e
            raise
        if response.has_error():
            raise self._error(model, response.error().message())
        tensors = {}
        for name in names:
            t = pb.get_output_tensor_by_name(response, name)
            if t is None:
                raise StageError(f"stage model {model!r}: response has no output {name!r}")
            # Copy out of the response's shared-memory buffer, which is released with the response.
            tensors[name] = np.array(t.as_numpy(), copy=True)
        return tensors

    def _error(self, model: str, message: str) -> StageError:
        """The exception for a stage model's error answer; a dead or stalled stub's is reported."""
        lower = message.lower()
        if any(m in lower for m in _NOT_LOADED):
            return StageNotLoaded(f"stage model {model!r} {UNAVAILABLE_TAG} {message}")
        if any(m in lower for m in _STUB_DOWN):
            err = StageUnavailable(f"stage model {model!r} {UNAVAILABLE_TAG} {message}")
            self._report(model, str(err))
            return err
        return StageError(f"stage model {model!r}: {message}")

    def close(self) -> None:
        """Fail the calls still waiting and return without waiting for the workers: one may be
        blocked in ``exec()`` on a stalled stage for as long as it stalls, and the model's unload
        must not wait for it. Calls still queued are never sent."""
        self._closed.set()
        with self._pending_lock:
            calls = [c[1:] for c in self._pending.values()]
            self._pending.clear()
        for outer, model, inner in calls:
            self._fail(outer, inner, StageUnavailable(f"stage model {model!r} {UNAVAILABLE_TAG} the executor closed"))
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
