"""The orchestrator model's request plumbing: Triton requests in, engine deltas out.

Threads, each with one job (after vllm_backend's layout):

- ``execute`` (Triton's thread) parses a request and queues it; it never waits for the engine.
- the engine loop is the only thread that calls ``engine.add_request`` / ``step`` / ``abort``; it is
  fed by a command queue and hands deltas to
- the response threads (a request's responses all through one), which build tensors and call
  ``response_sender.send`` (each request ends with one FINAL: data, INVALID_ARG, INTERNAL or UNAVAILABLE);
- the watcher polls ``is_cancelled()`` (an IPC round trip to the server, kept off the engine loop,
  at most ``cancel_checks_per_s`` of them) and queues aborts; on a drain
  (:mod:`lightspec_backend.control`) it cancels what is left at the deadline.

A metrics thread publishes engine statistics, which the engine loop snapshots at most every
``metrics_interval_s`` and whenever the engine goes idle (so gauges fall back to zero).

``pb_utils`` is passed in (the real ``triton_python_backend_utils`` in Triton, a fake in unit tests).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import threading
import time
import traceback

from .bls import is_unavailable
from .control import ControlDir, Drain
from .inputs import name_prompt_error, parse_request, request_parameters, requested_outputs
from .metrics import MetricsReporter
from .responses import Entry, ErrorReply, RequestState, ResponseThreads, build_response, send_error

_STOP = object()


def take_turns(items: list, turn: int, n: int) -> tuple[list, int]:
    """Up to ``n`` of ``items`` from position ``turn`` on, wrapping around; and the next turn."""
    turn = turn % len(items) if items else 0
    return (items[turn:] + items[:turn])[:n], turn + min(n, len(items))


class Orchestrator:
    def __init__(
        self,
        engine,
        pb_utils,
        reporter: MetricsReporter | None = None,
        *,
        cancel_poll_s: float = 0.05,
        cancel_checks_per_s: float = 200.0,
        metrics_interval_s: float = 0.25,
        control: ControlDir | None = None,
        restarts: int = 0,
        response_threads: int = 1,
        forwarded_headers: str = "",
    ):
        """``control``: the supervisor's drain requests; ``restarts``: its restarts before this one;
        ``forwarded_headers``: the server's header-forwarding pattern (``BackendConfig``)."""
        self.engine = engine
        self.pb = pb_utils
        self.log = pb_utils.Logger
        self.reporter = reporter
        self.cancel_poll_s = cancel_poll_s
        self.cancel_checks_per_poll = max(1, int(cancel_checks_per_s * cancel_poll_s))
        self.metrics_interval_s = metrics_interval_s
        self.forwarded_headers = forwarded_headers
        self.max_model_len = getattr(engine, "max_model_len", None)
        model_config = getattr(engine, "model_config", None)
        self.vocab_size = getattr(model_config, "vocab_size", None)
        self._ids = itertools.count()
        self._live: dict[str, Entry] = {}
        self._live_lock = threading.Lock()
        self._inbox: queue.Queue = queue.Queue()
        self._metrics_q: queue.Queue = queue.Queue()
        self._in_engine: set[str] = set()  # engine loop only
        self._held: list[tuple[Entry, object]] = []  # engine loop only: the last step's responses
        self._last_publish = 0.0
        self._stopping = threading.Event()
        self.drain = Drain(control)
        self.restarts = restarts
        self._threads = [
            threading.Thread(target=self._engine_loop, name="lightspec-engine", daemon=True),
            threading.Thread(target=self._watch_cancellation, name="lightspec-cancel", daemon=True),
        ]
        if reporter is not None:
            self._threads.append(threading.Thread(target=self._metrics_loop, name="lightspec-metrics", daemon=True))
        self._responses = ResponseThreads(response_threads, self._deliver)
        for t in self._threads:
            t.start()
        if reporter is not None:
            self._metrics_q.put((engine.stats.snapshot(), []))

    # -- called by Triton's execute thread ----------------------------------------------------

    def submit(self, request) -> None:
        """Parse one Triton request and queue it for the engine; answers bad input itself."""
        pb = self.pb
        rid = f"ls-{(n := next(self._ids))}"  # n: its response thread
        sender = request.get_response_sender()

        def get(name):
            t = pb.get_input_tensor_by_name(request, name)
            return None if t is None else t.as_numpy()

        entry = Entry(RequestState(rid, None, wanted=requested_outputs(request)), sender, request, shard=n)
        try:
            parsed = parse_request(
                get, self.max_model_len, self.vocab_size, request_parameters(request), self.forwarded_headers
            )
        except Exception as e:  # noqa: BLE001 - a request that cannot be parsed still gets its answer
            self.engine.stats.count_rejected()
            self._register(entry)
            bad = isinstance(e, ValueError)  # a parser's own refusal; anything else is a fault here
            self._post((entry, ErrorReply("INVALID_ARG" if bad else "INTERNAL", str(e) if bad else repr(e))))
            self._inbox.put(("rejected", None))  # the engine loop publishes the failure count
            return
        entry.state.request = parsed
        if not parsed.stream and not parsed.exclude_input_in_output:
            entry.state.prompt_text = (
                parsed.prompt if isinstance(parsed.prompt, str) else self.engine.tokenizer.decode(parsed.prompt)
            )
        if self._stopping.is_set():  # the response thread may be gone: answer here
            self._send(entry, ErrorReply("UNAVAILABLE", "the model is shutting down"))
            return
        if self.drain.draining:
            self._send(entry, ErrorReply("UNAVAILABLE", "the server is shutting down: not admitting new requests"))
            return
        self._register(entry)
        self._inbox.put(("add", entry))

    def _register(self, entry: Entry) -> None:
        with self._live_lock:
            self._live[entry.id] = entry

    def num_in_flight(self) -> int:
        with self._live_lock:
            return len(self._live)

    # -- engine loop: the only thread that touches the engine ---------------------------------

    def _engine_loop(self) -> None:
        if self.engine.profile_pending:
            # the stages took their profiles while loading; fetch them now, before any request
            self.engine.profile_stages()
        while True:
            busy = self.engine.has_unfinished()
            for cmd in self._take_commands(block=not busy):
                if cmd is _STOP:
                    self._drain_engine()
                    return
                kind, arg = cmd
                if kind == "add":
                    self._add(arg)
                elif kind == "abort" and arg in self._in_engine:
                    self.engine.abort(arg)
                elif kind == "rejected":
                    self._last_publish = 0.0  # publish again, even in an idle period already published
            if self.engine.has_unfinished():
                self._step()
            if not self.engine.has_unfinished():  # no next step to send them in
                self._release_held()
                self._maybe_publish(force=True)

    def _take_commands(self, block: bool) -> list:
        cmds = []
        try:
            cmds.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                cmds.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return cmds

    def _add(self, entry: Entry) -> None:
        if entry.abort_queued:  # cancelled while queued: never reaches the engine
            self._post((entry, ErrorReply("CANCELLED", "request cancelled")))
            return
        req = entry.state.request
        try:
            self.engine.add_request(
                entry.id, req.prompt, req.params, add_special_tokens=req.add_special_tokens, arrived_at=entry.arrived_at
            )
        except ValueError as e:  # prompt too long, max_tokens beyond the context, ... (the engine counts it)
            self._post((entry, ErrorReply("INVALID_ARG", name_prompt_error(req, e))))
            return
        self._in_engine.add(entry.id)

    def _step(self) -> None:
        """One engine step. Its responses are held until the next step has launched (its scheduling
        decision, drafts and target call submitted) and go to the response thread while that step
        waits for the target stage: sent earlier, they compete for the interpreter with the
        decision and the drafting, on the critical path of every request. Metrics are handed to
        their thread at the same moment, for the same reason."""
        try:
            deltas = self.engine.step(on_launched=self._after_launch)
        except Exception as e:  # noqa: BLE001 - a stage or engine failure: fail what is in flight, keep serving
            self._fail_in_flight(e)
            return
        with self._live_lock:
            entries = {d.request_id: self._live.get(d.request_id) for d in deltas}
        for d in deltas:
            entry = entries[d.request_id]
            if d.finished:
                self._in_engine.discard(d.request_id)
            # After a failed step, the aborted requests' "cancelled" finals arrive here too; the
            # response thread drops them because their error response closed them first (FIFO).
            if entry is not None:
                self._held.append((entry, d))

    def _fail_in_flight(self, error: Exception) -> None:
        """After a failed step: answer every request in the engine with INTERNAL and abort it."""
        self._release_held()
        self.log.log_error(f"[lightspec] engine step failed: {traceback.format_exc()}")
        code = "UNAVAILABLE" if is_unavailable(str(error)) else "INTERNAL"
        message = f"engine step failed: {error}"
        for rid in list(self._in_engine):
            self._finish_with_error(rid, code, message)
            # the engine may be unable to abort after a failure, which is logged above already;
            # aborted with the error, the request counts as failed, not as cancelled by its client
            with contextlib.suppress(Exception):
                self.engine.abort(rid, message)
        self._in_engine.clear()
        time.sleep(0.05)  # do not spin if every step keeps failing

    def _after_launch(self) -> None:
        """The engine waits for the target stage now: the time for the other threads' work."""
        self._release_held()
        self._maybe_publish(force=False)

    def _release_held(self) -> None:
        for item in self._held:
            self._post(item)
        self._held.clear()

    def _finish_with_error(self, rid: str, code: str, message: str) -> None:
        with self._live_lock:
            entry = self._live.get(rid)
        if entry is not None:
            self._post((entry, ErrorReply(code, message)))

    def _drain_engine(self, max_steps: int = 1000) -> None:
        """Shutdown: abort everything in the engine, flush the resulting finals, fail the queue."""
        for rid in list(self._in_engine):
            with self._live_lock:
                entry = self._live.get(rid)
            if entry is not None:
                entry.shutting_down = True
            self.engine.abort(rid)
        for _ in range(max_steps):
            if not self.engine.has_unfinished():
                break
            self._step()
        self._release_held()
        for cmd in self._take_commands(block=False):
            if cmd is not _STOP and cmd[0] == "add":
                self._post((cmd[1], ErrorReply("UNAVAILABLE", "the model is shutting down")))
        self._maybe_publish(force=True)

    def _maybe_publish(self, force: bool) -> None:
        if self.reporter is None:
            return
        now = time.monotonic()
        if force and self._last_publish < 0:
            return  # already published this idle period
        if force or now - self._last_publish >= self.metrics_interval_s:
            self._metrics_q.put((self.engine.stats.snapshot(), self.engine.stats.drain_observations()))
            self._last_publish = -1.0 if force else now

    # -- response threads -----------------------------------------------------------------------

    def _post(self, item) -> None:  # (entry, payload), to the entry's response thread
        self._responses.post(item[0].shard, item)

    def _deliver(self, item) -> None:
        entry, payload = item
        with entry.lock:
            if entry.closed:
                return
            try:
                final = self._send(entry, payload)
            except Exception as e:  # noqa: BLE001 - a broken client connection must not stop other responses
                self.log.log_error(f"[lightspec] sending a response failed: {traceback.format_exc()}")
                self._close_after_failed_send(entry, payload, e)
                final = True
            entry.closed = final
        if final:
            with self._live_lock:
                self._live.pop(entry.id, None)

    def _close_after_failed_send(self, entry: Entry, payload, error: Exception) -> None:
        """The request is closed now: it still gets a FINAL if the sender takes one, and an engine
        still generating for it stops (nothing would read its tokens, nor watch for its cancel)."""
        with contextlib.suppress(Exception):
            self._send(entry, ErrorReply("INTERNAL", f"sending a response failed: {error}"))
        if not isinstance(payload, ErrorReply) and not payload.finished and not entry.abort_queued:
            entry.abort_queued = True
            self._inbox.put(("abort", entry.id))

    def _send(self, entry: Entry, payload) -> bool:
        pb = self.pb
        final_flag = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if isinstance(payload, ErrorReply):
            send_error(pb, entry, payload)
            return True
        delta = payload
        # before the error branch: once the unload began, the stages refuse this model's calls, and a
        # step that failed for it is the unload, not an error of the request's (a drain's cancel says more)
        if delta.finished and entry.shutting_down and not entry.cancel_message:
            return self._send(entry, ErrorReply("UNAVAILABLE", "the model was unloaded before the request finished"))
        if delta.finished and delta.finish_reason == "error":
            code = "UNAVAILABLE" if is_unavailable(delta.error or "") else "INTERNAL"
            return self._send(entry, ErrorReply(code, delta.error or "generation failed"))
        if delta.finished and entry.cancel_message:
            return self._send(entry, ErrorReply("CANCELLED", entry.cancel_message))
        tensors = build_response(entry.state, delta)
        if tensors is None:
            return False
        response = pb.InferenceResponse(output_tensors=[pb.Tensor(n, a) for n, a in tensors.items()])
        entry.sender.send(response, flags=final_flag if delta.finished else 0)
        return delta.finished

    # -- cancellation watcher ---------------------------------------------------------------------

    def _watch_cancellation(self) -> None:
        """Every ``cancel_poll_s``, the next ``cancel_checks_per_poll`` live requests in turn: each
        check is an IPC round trip to the server (all 64 of a full batch every 50 ms: 1280 a second)."""
        turn = 0
        while not self._stopping.wait(self.cancel_poll_s):
            if self.drain.poll(self.num_in_flight()):
                self._cancel_all("request cancelled: the server shut down (grace period over)")
            with self._live_lock:
                entries = [e for e in self._live.values() if not e.abort_queued and not e.closed]
            due, turn = take_turns(entries, turn, self.cancel_checks_per_poll)
            for entry in due:
                if self._is_cancelled(entry):
                    entry.abort_queued = True
                    self._inbox.put(("abort", entry.id))

    def _cancel_all(self, message: str) -> None:
        with self._live_lock:
            entries = [e for e in self._live.values() if not e.abort_queued and not e.closed]
        for entry in entries:
            entry.cancel_message, entry.abort_queued = message, True
            self._inbox.put(("abort", entry.id))

    @staticmethod
    def _is_cancelled(entry: Entry) -> bool:
        with entry.lock:
            if entry.closed:
                return False
            try:
                return entry.sender.is_cancelled()
            except Exception:  # noqa: BLE001 - the request completed on the server side already
                return False

    # -- metrics thread ---------------------------------------------------------------------------

    def _metrics_loop(self) -> None:
        while True:
            items = [self._metrics_q.get()]
            try:
                while True:
                    items.append(self._metrics_q.get_nowait())
            except queue.Empty:
                pass
            stop = any(i is None for i in items)
            items = [i for i in items if i is not None]
            if items:
                observations = [o for _, obs in items for o in obs]
                try:
                    self.reporter.publish({**items[-1][0], "server_restarts_total": self.restarts}, observations)
                except Exception:  # noqa: BLE001 - metrics must never take the model down
                    self.log.log_error(f"[lightspec] publishing metrics failed: {traceback.format_exc()}")
            if stop:
                return

    # -- shutdown -----------------------------------------------------------------------------------

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """End every in-flight request with a final response, then stop all threads."""
        self._stopping.set()
        self._inbox.put(_STOP)
        engine_thread, *others = self._threads
        engine_thread.join(timeout_s)
        with self._live_lock:
            leftovers = [e for e in self._live.values() if not e.closed]
        for entry in leftovers:  # queued but never added, or the engine thread is stuck
            self._post((entry, ErrorReply("UNAVAILABLE", "the model is shutting down")))
        self._responses.stop(timeout_s)
        self._metrics_q.put(None)
        for t in others:
            t.join(timeout_s)
