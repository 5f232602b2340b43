"""The API's side of Triton: tritonclient's asyncio gRPC client, one bidirectional stream per request.

A request is written to its own stream and the stream is read until the response that carries a
``finish_reason`` (LightSpec puts it on a request's last data response; the asyncio client cannot
ask for Triton's empty final response). Leaving the iteration early, by an exception or a cancelled
task (a client that went away), cancels the gRPC call, which Triton turns into a cancelled request
that the engine drops.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import tritonclient.grpc.aio as grpcaio
from tritonclient.utils import InferenceServerException

from ..client import infer_inputs
from ..install import BACKEND_NAME
from .errors import OpenAIError, from_triton, model_not_ready

_LIST_TTL_S = 5.0


@dataclass(frozen=True)
class ServedModel:
    """A LightSpec orchestrator model Triton serves, and the checkpoint it loads (``None``: unknown)."""

    name: str
    model_dir: Path | None


@dataclass
class Chunk:
    """One data response of a request, decoded."""

    text: str
    finish_reason: str  # "" until the last response
    num_input_tokens: int | None
    num_output_tokens: int | None
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_histogram: list[int]  # cumulative; [] from a server without the output


def _scalar(result, name: str):
    arr = result.as_numpy(name)
    return None if arr is None or arr.size == 0 else arr.reshape(-1)[0]


def decode_chunk(result) -> Chunk:
    """The fields of one gRPC stream result that the API reads."""
    text = _scalar(result, "text_output")
    reason = _scalar(result, "finish_reason")
    n_in, n_out = _scalar(result, "num_input_tokens"), _scalar(result, "num_output_tokens")
    drafted, accepted = _scalar(result, "total_draft_tokens"), _scalar(result, "total_accepted_draft_tokens")
    hist = result.as_numpy("acceptance_histogram")
    return Chunk(
        text=text.decode("utf-8", errors="replace") if text is not None else "",
        finish_reason=reason.decode() if reason is not None else "",
        num_input_tokens=None if n_in is None else int(n_in),
        num_output_tokens=None if n_out is None else int(n_out),
        num_draft_tokens=int(drafted or 0),
        num_accepted_tokens=int(accepted or 0),
        acceptance_histogram=[int(v) for v in hist.reshape(-1)] if hist is not None else [],
    )


def _rpc_error(e: grpc.RpcError, renamed: dict[str, str] | None = None) -> OpenAIError:
    return from_triton(e.details() or str(e), e.code().name if e.code() else None, renamed)


def _served_model_error(err: OpenAIError) -> OpenAIError:
    # a request goes only to a model find() returned: Triton not knowing it means it was unloaded
    # since (a restart), which the client should retry, not a name the client got wrong
    return model_not_ready(err.message) if err.code == "model_not_found" else err


def _param(config, key: str) -> str | None:
    p = config.parameters.get(key)
    return None if p is None else p.string_value


class Triton:
    """The Triton server at ``url`` (gRPC ``HOST:PORT``). ``model_dir`` overrides the checkpoint
    directory that would be read from each model's config (needed when Triton runs elsewhere);
    ``model_repository`` resolves a config's relative ``model_dir``, as the backend does."""

    def __init__(self, url: str, model_dir: str | Path | None = None, model_repository: str | Path | None = None):
        self.url = url
        self.model_dir = Path(model_dir) if model_dir else None
        self.model_repository = Path(model_repository).resolve() if model_repository else None
        self._client: grpcaio.InferenceServerClient | None = None
        self._served: tuple[float, list[ServedModel]] | None = None  # (when listed, models)
        self._not_ready: dict[str, str] = {}  # as of the last listing, see _list
        # names (and checkpoint directory names) answered before: a restart's reload may drop the
        # model from the index for a moment, and a 404 then would tell clients not to retry
        self._ever_served: set[str] = set()

    @property
    def client(self) -> grpcaio.InferenceServerClient:
        # made on first use: the aio client binds to the running event loop
        if self._client is None:
            self._client = grpcaio.InferenceServerClient(self.url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def ready(self) -> bool:
        with contextlib.suppress(InferenceServerException, grpc.RpcError):
            return bool(await self.client.is_server_ready(client_timeout=5))
        return False

    async def models(self) -> list[ServedModel]:
        """Every ready model with backend ``lightspec`` and the orchestrator role; 503 when Triton
        does not answer."""
        return (await self._list())[0]

    async def _list(self) -> tuple[list[ServedModel], dict[str, str]]:
        """The ready LightSpec orchestrators, and every model of the index that is not ready (name
        -> its state and reason): Triton gives no config for one, so its backend is unknown."""
        try:
            index = await self.client.get_model_repository_index(as_json=False, client_timeout=10)
            out, not_ready = [], {}
            for m in index.models:
                if m.state != "READY":
                    not_ready[m.name] = ": ".join(filter(None, (m.state or "not loaded", m.reason)))
                    continue
                config = (await self.client.get_model_config(m.name, m.version, client_timeout=10)).config
                if config.backend == BACKEND_NAME and (_param(config, "role") or "orchestrator") == "orchestrator":
                    out.append(ServedModel(m.name, self._checkpoint(_param(config, "model_dir"))))
            self._ever_served.update(n for m in out for n in (m.name, m.model_dir and m.model_dir.name) if n)
            return out, not_ready
        except InferenceServerException as e:
            raise from_triton(e.message(), e.status()) from None
        except grpc.RpcError as e:
            raise _rpc_error(e) from None

    def _checkpoint(self, configured: str | None) -> Path | None:
        if self.model_dir is not None:
            return self.model_dir
        if not configured:  # the embedded default model
            from lightspec_core.config import default_model_dir

            return Path(default_model_dir())
        path = Path(configured).expanduser()
        if not path.is_absolute() and self.model_repository is not None:
            path = self.model_repository / path
        return path.resolve() if path.is_absolute() and path.is_dir() else None

    async def find(self, name: str) -> ServedModel:
        """The served model ``name`` (or whose checkpoint directory is named so); 503 while it is
        in Triton's index but not ready, or was served before (loading, restarting); 404 for a
        name Triton does not know. The list is reused for a few seconds (listing costs a call per
        model), and listed afresh before a name is refused."""
        stale = self._served is None or time.monotonic() - self._served[0] > _LIST_TTL_S
        known = not stale and any(m.name == name or (m.model_dir and m.model_dir.name == name) for m in self._served[1])
        if not known:
            served, self._not_ready = await self._list()
            self._served = (time.monotonic(), served)
        models = self._served[1]
        for m in models:
            if m.name == name:
                return m
        for m in models:
            if m.model_dir is not None and m.model_dir.name == name:
                return m
        if name in self._not_ready:
            raise model_not_ready(f"model {name!r} is in Triton's repository, {self._not_ready[name]}")
        if name in self._ever_served:
            raise model_not_ready(f"model {name!r} was served and is not in Triton's repository now")
        served = ", ".join(m.name for m in models) or "none"
        raise OpenAIError(f"model {name!r} does not exist (served: {served})", 404, "model", "model_not_found")

    async def generate(
        self, model: str, tensors: dict[str, object], renamed: dict[str, str] | None = None
    ) -> AsyncIterator[Chunk]:
        """The request's data responses in order, up to the one with the finish reason. Closing
        the iterator early cancels the request in Triton. An error names the request's field as
        the client called it (``renamed``, see :func:`.errors.field_of`)."""
        done = asyncio.Event()

        async def requests():
            yield {
                "model_name": model,
                "inputs": infer_inputs(tensors, grpcaio.InferInput),
                "request_id": uuid.uuid4().hex,
            }
            await done.wait()  # an open write side keeps the stream up until the last response

        responses = self.client.stream_infer(requests())
        finished = False
        try:
            async for result, error in responses:
                if error is not None:
                    raise _served_model_error(from_triton(error.message(), error.status(), renamed))
                chunk = decode_chunk(result)
                finished = bool(chunk.finish_reason)
                yield chunk
                if finished:
                    return
            raise OpenAIError("the inference server closed the stream before the last response", 503)
        except grpc.RpcError as e:
            raise _served_model_error(_rpc_error(e, renamed)) from None
        finally:
            done.set()
            if not finished:
                responses.cancel()
