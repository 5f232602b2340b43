"""``lightspec openai`` (the API on its own, beside any Triton that serves LightSpec) and the API
server that ``lightspec serve`` runs in a thread next to its tritonserver."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

DEFAULT_PORT = 8080  # beside Triton's 8000-8002


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--triton-url", default="127.0.0.1:8001", help="Triton's gRPC HOST:PORT")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"default {DEFAULT_PORT}; 0 picks a free port")
    p.add_argument("--model-dir", help="checkpoint for the chat template (default: each model config's model_dir)")
    p.add_argument("--model-repository", help="resolves relative model_dir parameters (the Triton repository)")
    p.add_argument("--log-level", default="info", help="uvicorn log level")


class OpenAIServer:
    """A uvicorn server for :func:`~.app.create_app`, run in a daemon thread of this process."""

    def __init__(
        self,
        triton_url: str,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        model_dir: str | Path | None = None,
        model_repository: str | Path | None = None,
        log_level: str = "warning",
    ):
        import uvicorn

        from .app import create_app

        app = create_app(triton_url, model_dir, model_repository)
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.host = host
        self.port = port
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def start(self, timeout_s: float = 30.0) -> OpenAIServer:
        """Start serving; return once the socket listens (``port`` 0 becomes the port picked).
        Raise ``RuntimeError`` if it does not (a port in use)."""
        self._thread = threading.Thread(target=self._serve, name="lightspec-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the OpenAI API server did not start on {self.host}:{self.port} (port in use? "
                    "--openai-port 0 picks a free one, -1 turns the API off)"
                )
            time.sleep(0.05)
        sockets = [s for srv in self.server.servers for s in srv.sockets]
        if sockets:
            self.port = sockets[0].getsockname()[1]
        return self

    def _serve(self) -> None:
        try:
            self.server.run()
        except SystemExit:  # uvicorn exits when it cannot bind: start() reports it, naming the port
            pass

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, close open streams (their Triton requests are cancelled), and join."""
        if self._thread is None:
            return
        self.server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.server.force_exit = True
            self._thread.join(timeout_s)
        self._thread = None


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``lightspec serve``'s options for the API it runs beside tritonserver."""
    p.add_argument(
        "--openai-port", type=int, default=DEFAULT_PORT,
        help=f"OpenAI-compatible API port (default {DEFAULT_PORT}; 0 picks a free port; -1 turns it off)",
    )  # fmt: skip
    # loopback, as `lightspec openai --host`: the API has no authentication; Triton's own ports listen on
    # every interface, so a container passes 0.0.0.0 here to publish this one too
    p.add_argument(
        "--openai-host",
        default="127.0.0.1",
        help="address the OpenAI API listens on (default 127.0.0.1; 0.0.0.0: every interface, as tritonserver's ports)",
    )
    p.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible API")


def add_parsers(sub, serve_parser: argparse.ArgumentParser) -> None:
    """The ``openai`` command, and ``serve``'s options for the API it runs."""
    add_serve_arguments(serve_parser)
    o = sub.add_parser("openai", help="OpenAI-compatible HTTP API in front of a running Triton (LightSpec)")
    add_arguments(o)
    o.set_defaults(func=main)


def start_for_serve(args: argparse.Namespace, grpc_url: str, model_repository: Path) -> OpenAIServer | None:
    """The API server ``lightspec serve`` starts once tritonserver is ready (``None``: turned off)."""
    port = getattr(args, "openai_port", DEFAULT_PORT)
    if getattr(args, "no_openai", False) or port is None or port < 0:
        return None
    host = getattr(args, "openai_host", "127.0.0.1")
    return OpenAIServer(grpc_url, host=host, port=port, model_repository=model_repository).start()


def main(args: argparse.Namespace) -> int:
    """``lightspec openai``: serve until interrupted."""
    import uvicorn

    from .app import create_app

    app = create_app(args.triton_url, args.model_dir, args.model_repository)
    print(f"LightSpec OpenAI API on http://{args.host}:{args.port}/v1 (Triton gRPC {args.triton_url})", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except SystemExit as e:  # uvicorn exits when it cannot bind
        return int(e.code or 1)
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="lightspec openai")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
