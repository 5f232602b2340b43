"""HTTP server-sent-event streams: LightSpec through Triton's ``generate_stream``, vLLM through
``/v1/completions``. One client for both servers, so a ratio between them compares servers, not
client libraries.

Each stream is one persistent HTTP/1.1 connection running one request at a time, on a thread of
its own: :func:`~.client.run_closed_loop` drives them with ``make_stream``.
An event is a ``data: {json}`` line; the tokens it carries are counted from its token ids (one event
may carry several tokens when a speculation step accepted several).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

from .client import Record, Request


def _ids(value) -> list[int]:
    """Triton's generate extension writes a one-element array as a scalar."""
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, list) else [int(value)]


def triton_body(req: Request) -> dict:
    """The ``generate_stream`` request for ``req``: the gRPC client's tensors as JSON fields."""
    return req.tensors()


def triton_event(event: dict) -> tuple[list[int], int | None, int | None]:
    """(token ids, drafted so far, accepted so far) of one ``generate_stream`` event."""
    if "error" in event:
        raise RuntimeError(str(event["error"]))
    return _ids(event.get("output_ids")), event.get("total_draft_tokens"), event.get("total_accepted_draft_tokens")


def vllm_body(req: Request, model: str) -> dict:
    """The ``/v1/completions`` request for ``req``: greedy at temperature 0, ``ignore_eos`` (a vLLM
    extension) so every request runs ``max_tokens``, and ``return_token_ids`` so each chunk says
    which tokens it carries."""
    return {
        "model": model,
        "prompt": req.prompt.text,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "stream": True,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def vllm_event(event: dict) -> tuple[list[int], int | None, int | None]:
    """(token ids, None, None) of one ``/v1/completions`` chunk."""
    if "error" in event:
        raise RuntimeError(str(event["error"]))
    choices = event.get("choices") or []
    if not choices:
        return [], None, None
    ids = choices[0].get("token_ids")
    if ids is None:
        raise RuntimeError("the completions stream carries no token_ids: the server ignores return_token_ids")
    return [int(i) for i in ids], None, None


def events(lines: Iterator[bytes]) -> Iterator[dict]:
    """The JSON payloads of an SSE stream's ``data:`` lines, up to ``data: [DONE]`` or the end."""
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            return
        yield json.loads(payload)


class SSEStream:
    """One HTTP connection to ``url`` (``http://host:port``) running one request at a time.

    ``server`` is ``lightspec`` (Triton's ``generate_stream`` of the model named at :meth:`run`) or
    ``vllm`` (``/v1/completions``, the model named at :meth:`run` being the served model name)."""

    def __init__(self, url: str, timeout_s: float, server: str = "lightspec"):
        if server not in ("lightspec", "vllm"):
            raise ValueError(f"server={server!r}: expected lightspec or vllm")
        parts = urlsplit(url if "://" in url else f"http://{url}")
        self.host, self.port, self.server, self.timeout_s = parts.hostname, parts.port, server, timeout_s
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout_s)

    def _post(self, model: str, req: Request) -> http.client.HTTPResponse:
        if self.server == "lightspec":
            path, body = f"/v2/models/{model}/generate_stream", triton_body(req)
        else:
            path, body = "/v1/completions", vllm_body(req, model)
        data = json.dumps(body).encode()
        self.conn.request("POST", path, data, {"Content-Type": "application/json", "Accept": "text/event-stream"})
        return self.conn.getresponse()

    def run(self, model: str, req: Request, t_send: float | None = None) -> Record:
        rec = Record(req.prompt.kind, t_send if t_send is not None else time.perf_counter(), prompt=req.prompt.text)
        parse = triton_event if self.server == "lightspec" else vllm_event
        try:
            resp = self._post(model, req)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {resp.read(500).decode(errors='replace')}")
            for event in events(iter(resp.readline, b"")):
                self._observe(rec, time.perf_counter(), *parse(event))
            resp.read()  # the connection is reused: leave nothing unread
        except (OSError, http.client.HTTPException, RuntimeError, ValueError) as e:
            rec.error = str(e) or type(e).__name__
            self._reconnect()
        rec.t_end = time.perf_counter()
        return rec

    @staticmethod
    def _observe(rec: Record, t: float, ids: list[int], drafted: int | None, accepted: int | None) -> None:
        if ids:
            rec.t_first = t if rec.t_first is None else rec.t_first
            rec.t_last = t
            rec.tokens += len(ids)
            rec.responses += 1
            rec.ids.extend(ids)
        rec.drafted = rec.drafted if drafted is None else int(drafted)
        rec.accepted = rec.accepted if accepted is None else int(accepted)

    def _reconnect(self) -> None:
        self.close()
        self.conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()


def stream_factory(server: str):
    """``make_stream`` for :func:`~.client.run_closed_loop`: SSE streams to ``server``."""
    return lambda url, timeout_s: SSEStream(url, timeout_s, server)
