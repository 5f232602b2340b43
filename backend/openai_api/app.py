"""The ASGI app: OpenAI's ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` and a
``/health`` check, over a Triton server that serves LightSpec.

A client that goes away cancels its Triton request: a non-streamed answer is awaited in a race
with the connection's disconnect message, and a stream listens for it beside the sending (the
stream's generator closing cancels the gRPC call, see :mod:`.triton`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from .chat_template import render_chat
from .convert import (
    Accumulator,
    choice,
    choice_tensors,
    envelope,
    finish_reason,
    full_response,
    new_id,
    renamed_fields,
    request_tensors,
    sampling_tensors,
)
from .errors import OpenAIError, validation_error
from .protocol import ChatCompletionRequest, CompletionRequest
from .triton import Chunk, Triton


class _Gone(Exception):
    """The client disconnected before its answer was ready."""


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, as soon as the client disconnects
    (Starlette's own response only notices on the next send under ASGI 2.4)."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_gone(request: Request, awaitable):
    """``await awaitable``, cancelled (and ``_Gone`` raised) if the client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise _Gone
    finally:
        for t in (task, watcher):
            t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _collect(chunks: AsyncIterator[Chunk]) -> Accumulator:
    acc = Accumulator()
    async for chunk in chunks:
        acc.add(chunk)
    return acc


async def _all(awaitables) -> list:
    """``asyncio.gather``, except that the first failure (or a cancel) cancels the others and
    waits for them: each reads a choice's stream, which must not be left running."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _merged(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(choice index, chunk) from every stream, in the order they arrive."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, chunks: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in chunks:
                await queue.put((i, chunk))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the reader, which ends the answer with it
            await queue.put((i, e))

    pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        for _ in range(len(streams)):
            while True:
                i, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield i, item
    finally:
        for t in pumps:
            t.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


def _event(obj: dict) -> bytes:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n".encode()


async def _events(endpoint: str, rid: str, model: str, body, firsts: list[Chunk], streams, n: int):
    """The SSE body: one event per response with text (its choice's index), the finish reason on
    each choice's last, then (with ``include_usage``) a usage event with empty ``choices``; the
    speculation metrics ride on the event that ends the last choice, as vLLM's do; ``data: [DONE]``
    ends it."""
    created, accs = int(time.time()), [Accumulator() for _ in streams]
    head = [endpoint == "chat"] * len(streams)
    continuous = body.include_usage and body.stream_options.continuous_usage_stats  # both, as vLLM asks
    left = len(streams)
    merged = _merged([_rest(first, s) for first, s in zip(firsts, streams)])
    try:
        async for i, chunk in merged:
            accs[i].add(chunk)
            reason = finish_reason(chunk.finish_reason) if chunk.finish_reason else None
            left -= bool(reason)
            if chunk.text or reason or head[i]:
                event = envelope(endpoint, rid, model, created, chunk=True)
                event["choices"] = [choice(endpoint, chunk.text, reason, delta=True, first=head[i], index=i)]
                if continuous:
                    event["usage"] = Accumulator.total(accs, n).usage()
                if reason and not left and not body.include_usage:
                    event["metrics"] = Accumulator.total(accs, n).metrics()
                head[i] = False
                yield _event(event)
        if body.include_usage:
            total = Accumulator.total(accs, n)
            event = envelope(endpoint, rid, model, created, chunk=True)
            event |= {"choices": [], "usage": total.usage(), "metrics": total.metrics()}
            yield _event(event)
    except OpenAIError as e:
        yield _event(e.body())
    finally:
        await merged.aclose()
        await _close(streams)
    yield b"data: [DONE]\n\n"


async def _rest(first: Chunk, chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """A stream whose first chunk was read already."""
    yield first
    async for chunk in chunks:
        yield chunk


async def _answer(request: Request, triton: Triton, endpoint: str, model: str, body, prompts: list[dict]):
    """Every prompt's ``n`` choices, each a request of its own (``choice_tensors``)."""
    rid, n = new_id(endpoint), body.n or 1
    streams = [triton.generate(model, choice_tensors(t, j), renamed_fields(body)) for t in prompts for j in range(n)]
    try:
        if not body.stream:
            accs = await _unless_gone(request, _all(_collect(s) for s in streams))
            return JSONResponse(full_response(endpoint, rid, body.model, accs, n))
        # the first responses decide the HTTP status: Triton answers a bad request with an error first
        firsts = await _unless_gone(request, _all(anext(s) for s in streams))
    except _Gone:
        await _close(streams)
        return JSONResponse(OpenAIError("client disconnected", 499, code="cancelled").body(), 499)
    except BaseException:
        await _close(streams)
        raise
    return EventStream(_events(endpoint, rid, body.model, body, firsts, streams, n))


async def _close(streams) -> None:
    for s in streams:
        await s.aclose()


def _error_handlers(app: FastAPI) -> None:
    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, e: OpenAIError):
        return JSONResponse(e.body(), e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        err = validation_error(list(e.errors()))
        return JSONResponse(err.body(), err.status)


def _info_routes(app: FastAPI, triton: Triton) -> None:
    started = int(time.time())

    def card(m) -> dict:
        root = str(m.model_dir) if m.model_dir else None
        return {"id": m.name, "object": "model", "created": started, "owned_by": "lightspec", "root": root}

    @app.get("/health")
    async def health():
        if not await triton.ready():
            raise OpenAIError(f"the inference server at {triton.url} is not ready", 503, code="unavailable")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card(m) for m in await triton.models()]}

    @app.get("/v1/models/{name}")
    async def model(name: str):
        return card(await triton.find(name))


def _generation_routes(app: FastAPI, triton: Triton) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        tensors = [request_tensors(prompt, body) for prompt in body.prompts()]
        served = await triton.find(body.model)
        return await _answer(request, triton, "completions", served.name, body, tensors)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        sampling_tensors(body)  # a bad value is a 400 before the model or its template is looked at
        messages = [m.for_template(i) for i, m in enumerate(body.messages)]
        served = await triton.find(body.model)
        prompt = render_chat(
            served.model_dir, messages, body.add_generation_prompt, body.continue_final_message,
            body.chat_template_kwargs,
        )  # fmt: skip
        return await _answer(request, triton, "chat", served.name, body, [request_tensors(prompt, body)])


def create_app(
    triton_url: str, model_dir: str | Path | None = None, model_repository: str | Path | None = None
) -> FastAPI:
    """The app for the Triton server at ``triton_url`` (gRPC ``HOST:PORT``). ``model_dir``: the
    checkpoint whose chat template to use, when the model configs' ``model_dir`` is not readable
    here (Triton on another machine); ``model_repository``: where relative ``model_dir`` values
    point into."""
    triton = Triton(triton_url, model_dir, model_repository)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await triton.close()

    app = FastAPI(title="LightSpec OpenAI-compatible API", lifespan=lifespan)
    app.state.triton = triton
    _error_handlers(app)
    _info_routes(app, triton)
    _generation_routes(app, triton)
    return app
