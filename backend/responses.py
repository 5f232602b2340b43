"""Engine deltas -> response tensors (numpy), per request, and the threads that send them. Triton-free.

Streaming: every delta with new tokens becomes one response carrying only those tokens; the final
delta's response carries ``finish_reason`` and is sent with the FINAL flag. Non-streaming: deltas
accumulate and the final one becomes the single response (HTTP ``/generate`` needs exactly one).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from lightspec_core.engine.outputs import RequestDelta

from .inputs import GenerateRequest
from .tensors import OUTPUT_SPECS, PERF_OUTPUTS

# The batched front's BLS requests carry ids with this prefix, and get their errors in band: a data
# response whose finish_reason is "error:<CODE>:<message>", which the front turns back into the
# error. In Triton 2.51 an error response sent to a decoupled BLS caller from the orchestrator's
# response thread never reaches the caller's response iterator (an error sent inside execute does),
# so a drain's CANCELLED or a failed step's INTERNAL left the front's clients waiting.
FRONT_REQUEST_PREFIX = "lightspec_batched/"
_INBAND = "error:"


def inband_error(code: str, message: str) -> dict[str, np.ndarray]:
    return {"finish_reason": np.array([f"{_INBAND}{code}:{message}".encode()], dtype=object)}


def send_error(pb, entry: Entry, reply: ErrorReply) -> None:
    """The request's final answer, an error: in band to the batched front (FRONT_REQUEST_PREFIX)."""
    final = pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL
    if entry.inband_errors:
        tensors = [pb.Tensor(n, a) for n, a in inband_error(reply.code, reply.message).items()]
        entry.sender.send(pb.InferenceResponse(output_tensors=tensors), flags=final)
    else:
        err = pb.TritonError(reply.message, getattr(pb.TritonError, reply.code))
        entry.sender.send(pb.InferenceResponse(output_tensors=[], error=err), flags=final)


def inband_error_of(outputs: dict[str, np.ndarray]) -> tuple[str, str] | None:
    """(code, message) of an in-band error response, else None."""
    reason = outputs.get("finish_reason")
    if reason is None or reason.size != 1:
        return None
    value = reason.reshape(-1)[0]
    text = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if not text.startswith(_INBAND):
        return None
    code, _, message = text[len(_INBAND) :].partition(":")
    return code, message


@dataclass
class RequestState:
    """What the backend remembers about one in-flight request besides the engine's own state."""

    request_id: str  # unique engine id (clients may reuse theirs)
    request: GenerateRequest
    prompt_text: str = ""  # prepended to non-streaming text unless exclude_input_in_output
    text: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    num_input_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_histogram: list[int] = field(default_factory=list)  # cumulative, as the engine keeps it
    # the outputs the client asked for (None: all). Building only those matters at high
    # concurrency: every streamed response's tensors are made under the interpreter lock
    wanted: frozenset[str] | None = None

    def absorb(self, delta: RequestDelta) -> None:
        """Take a delta's counters (cumulative in the engine) and, when not streaming, its tokens."""
        self.num_input_tokens = max(self.num_input_tokens, delta.num_prompt_tokens)
        self.num_draft_tokens = max(self.num_draft_tokens, delta.num_draft_tokens)
        self.num_accepted_tokens = max(self.num_accepted_tokens, delta.num_accepted_tokens)
        if delta.acceptance_histogram:
            self.acceptance_histogram = delta.acceptance_histogram
        if not self.request.stream:
            self.text.append(delta.new_text)
            self.ids.extend(delta.new_token_ids)


@dataclass
class ErrorReply:
    """A request's FINAL error response."""

    code: str  # name of a pb_utils.TritonError code: INVALID_ARG, INTERNAL, UNAVAILABLE, CANCELLED
    message: str


@dataclass
class Entry:
    """One request as the orchestrator's threads share it: its state, its sender and how far it got."""

    state: RequestState
    sender: object  # pb_utils InferenceResponseSender
    request: object  # pb_utils InferenceRequest, for is_cancelled()
    inband_errors: bool = field(init=False)  # the batched front's request (see FRONT_REQUEST_PREFIX)
    abort_queued: bool = False
    cancel_message: str = ""  # set when the drain deadline cancels it: its final is CANCELLED
    shutting_down: bool = False
    closed: bool = False  # FINAL sent (or attempted); set by its response thread only
    shard: int = 0  # which response thread sends its responses (one: they keep their order)
    # when execute() took it: the engine loop adds it between steps, and the wait counts (TTFT)
    arrived_at: float = field(default_factory=time.perf_counter)
    # Serialises is_cancelled() with send(): in Triton 2.51, is_cancelled() on a sender whose FINAL
    # response went out (or is going out) reads a freed response factory and crashes the server.
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        rid = getattr(self.request, "request_id", None)  # pb_utils requests have it; a stand-in may not
        self.inband_errors = callable(rid) and str(rid()).startswith(FRONT_REQUEST_PREFIX)

    @property
    def id(self) -> str:
        return self.state.request_id


def build_response(state: RequestState, delta: RequestDelta) -> dict[str, np.ndarray] | None:
    """Output tensors for this delta, or ``None`` when nothing should be sent yet."""
    state.absorb(delta)
    req = state.request
    if req.stream:
        if not delta.new_token_ids and not delta.finished:
            return None
        text, ids = delta.new_text, list(delta.new_token_ids)
    else:
        if not delta.finished:
            return None
        text = "".join(state.text)
        if not req.exclude_input_in_output:
            text = state.prompt_text + text
        ids = state.ids
    rate = state.num_accepted_tokens / state.num_draft_tokens if state.num_draft_tokens else 0.0
    reason = (delta.finish_reason or "") if delta.finished else ""
    make = {
        "text_output": lambda: np.array([text.encode("utf-8")], dtype=object),
        "output_ids": lambda: np.array(ids, dtype=np.int64),
        "finish_reason": lambda: np.array([reason.encode()], dtype=object),
        "total_draft_tokens": lambda: np.array([state.num_draft_tokens], dtype=np.int32),
        "total_accepted_draft_tokens": lambda: np.array([state.num_accepted_tokens], dtype=np.int32),
        "acceptance_rate": lambda: np.array([rate], dtype=np.float32),
        "acceptance_histogram": lambda: np.array(state.acceptance_histogram, dtype=np.int32),
    }
    if req.return_num_input_tokens:
        make["num_input_tokens"] = lambda: np.array([state.num_input_tokens], dtype=np.uint32)
    if req.return_num_output_tokens:
        make["num_output_tokens"] = lambda: np.array([len(ids)], dtype=np.uint32)
    if delta.perf is not None:
        for name, value in zip(PERF_OUTPUTS, delta.perf, strict=True):
            make[name] = partial(np.array, [value], dtype=OUTPUT_SPECS[name].numpy_dtype)
    wanted = state.wanted
    return {name: f() for name, f in make.items() if wanted is None or name in wanted}


class ResponseThreads:
    """``n`` threads, each calling ``deliver(item)`` on what is posted to it, in order. Items posted
    under one key all go to the same thread, so a request's responses keep their order.

    Why several: in Triton 2.51's Python backend a response the stub sends waits until the server
    has taken it, and one thread spends most of its time waiting at 64 streams (docs/benchmarks.md).
    """

    def __init__(self, n: int, deliver: Callable[[object], None], name: str = "lightspec-responses"):
        self._queues: list[queue.Queue] = [queue.Queue() for _ in range(max(1, n))]
        self._deliver = deliver
        self._threads = [threading.Thread(target=self._run, args=(q,), name=f"{name}-{i}", daemon=True)
                         for i, q in enumerate(self._queues)]  # fmt: skip
        for t in self._threads:
            t.start()

    def post(self, key: int, item) -> None:
        self._queues[key % len(self._queues)].put(item)

    def stop(self, timeout_s: float) -> None:
        """Delivers what was posted before, then ends the threads."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join(timeout_s)

    def _run(self, items: queue.Queue) -> None:
        while (item := items.get()) is not None:
            self._deliver(item)
