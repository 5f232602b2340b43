"""``lightspec generate``: stream a completion from a running server over gRPC, then print tokens/s
and the request's acceptance."""

from __future__ import annotations

import queue
import sys
import time
from dataclasses import dataclass


def _inputs(args) -> list:
    from .client import grpc_inputs

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    tensors = {
        "text_input": prompt,
        "max_tokens": args.max_tokens,
        "stream": not args.no_stream,
        "exclude_input_in_output": True,
        "return_num_output_tokens": True,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
    }
    if args.seed is not None:
        tensors["seed"] = args.seed
    if args.num_draft_tokens is not None:
        tensors["num_draft_tokens"] = args.num_draft_tokens
    if args.stop:
        tensors["stop_words"] = args.stop
    return grpc_inputs(**tensors)


@dataclass
class _Progress:
    """One request's stream as ``generate`` prints it: text to stdout, counts for the summary."""

    t0: float
    first: float | None = None  # when the first text arrived
    tokens: int = 0
    last: object = None  # the last result with outputs (its counters are the request's totals)

    def add(self, result) -> None:
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            if self.first is None:
                self.first = time.perf_counter()
            sys.stdout.write(text.reshape(-1)[0].decode("utf-8", errors="replace"))
            sys.stdout.flush()
        n = result.as_numpy("num_output_tokens")
        self.tokens += int(n.reshape(-1)[0]) if n is not None else 0
        self.last = result

    def summary(self, elapsed: float, streamed: bool) -> str:
        last = self.last
        reason = last.as_numpy("finish_reason").reshape(-1)[0].decode()
        drafted = int(last.as_numpy("total_draft_tokens").reshape(-1)[0])
        accepted = int(last.as_numpy("total_accepted_draft_tokens").reshape(-1)[0])
        rate = float(last.as_numpy("acceptance_rate").reshape(-1)[0])
        ttft = (
            f", first token after {1000 * (self.first - self.t0):.0f} ms" if self.first is not None and streamed else ""
        )
        return (
            f"[{self.tokens} tokens in {elapsed:.2f}s: {self.tokens / elapsed:.1f} tokens/s{ttft}; "
            f"finish_reason={reason}; acceptance rate {100 * rate:.1f}% ({accepted}/{drafted} draft tokens)]"
        )


def _receive(results: queue.Queue, timeout: float, progress: _Progress) -> str | None:
    """Read one request's stream until its final response; return the error, or ``None``."""
    from tritonclient.utils import InferenceServerException

    from .client import is_final

    while True:
        try:
            result, error = results.get(timeout=timeout)
        except queue.Empty:
            return f"no response for {timeout}s"
        if error is not None:
            return f"error: {error.message() if isinstance(error, InferenceServerException) else error}"
        if result.get_response().outputs:
            progress.add(result)
        if is_final(result):
            return None


def generate(args) -> int:
    import tritonclient.grpc as grpcclient

    client = grpcclient.InferenceServerClient(args.url)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    progress = _Progress(time.perf_counter())
    try:
        client.async_stream_infer(args.model, _inputs(args), enable_empty_final_response=True)
        error = _receive(results, args.timeout, progress)
    except KeyboardInterrupt:
        client.stop_stream(cancel_requests=True)
        print("\n[cancelled]", file=sys.stderr)
        return 130
    finally:
        client.stop_stream()
        client.close()
    if error is not None:
        print(f"\n{error}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - progress.t0
    print()
    if progress.last is not None:
        print(progress.summary(elapsed, streamed=not args.no_stream), file=sys.stderr)
    return 0
