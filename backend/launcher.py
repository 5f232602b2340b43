"""Start and stop a ``tritonserver`` that serves LightSpec.

Where the server comes from, in order: an explicit binary; ``$LIGHTSPEC_TRITONSERVER``; a
``tritonserver`` on ``PATH`` (the NGC container: backends in ``/opt/tritonserver/backends``); the
server that the ``nvidia-pytriton`` wheel ships (``pytriton/tritonserver/bin/tritonserver``, Triton
2.51, CPU-capable).

The backend directory and the stubs' ``PYTHONPATH`` are assembled by :mod:`lightspec_backend.install`.

>>> with TritonServer("model_repository") as server:      # free ports, waits until ready
...     print(server.grpc_url, server.metrics_url)
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import secrets
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .install import build_backend_directory, build_python_path, default_cache_dir, find_tritonserver, server_env

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self from Python 3.11


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports that are free right now (the OS picks; a later bind can still race)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@dataclass(frozen=True)
class StubProcess:
    pid: int
    name: str  # the model instance, e.g. "lightspec_target_0_0"
    state: str  # /proc state: R, S, D, T (stopped), Z (zombie: dead, not reaped yet)

    @property
    def alive(self) -> bool:
        return self.state not in "ZX"


def _group(server_pid: int):
    """(pid, command name, /proc state) of each process in the server's process group
    (``start_new_session`` made the server's pid the group id; the group cannot be reused while a
    member lives), zombies included."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = stat.read_text()
            state, _, pgrp = text[text.rindex(")") + 2 :].split()[:3]
            if int(pgrp) == server_pid:
                yield int(stat.parent.name), text[text.index("(") + 1 : text.rindex(")")], state


def stub_processes(server_pid: int) -> list[StubProcess]:
    """Python backend stubs in the server's process group, zombies included. The stub's command line
    is ``stub model.py shm_region shm_size growth parent_pid lib_dir ipc_handle name``."""
    out = []
    for pid, comm, state in _group(server_pid):
        if comm.startswith("triton_python"):
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
                out.append(StubProcess(pid, argv[8] if len(argv) > 8 else "?", state))
    return out


def _group_left(server_pid: int) -> list[int]:
    """Live processes still in a stopped server's process group: its Python backend stubs (they
    ignore SIGTERM) and what they started, such as an orchestrator's engine processes."""
    return [pid for pid, _, state in _group(server_pid) if state not in "ZX"]


PORT_FLAGS = ("--http-port", "--grpc-port", "--metrics-port")


def ports_in_use(ports: dict[str, int]) -> list[str]:
    """The ``name=port`` of each port another socket listens on. A server that cannot bind a port
    exits, but its readiness check would be answered by whoever holds the port."""
    taken = []
    for name, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free to a server
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                taken.append(f"{name}={port}")
    return taken


def remove_shm_regions(prefix: str) -> list[str]:
    """Unlink every ``/dev/shm`` region whose name starts with ``prefix``; returns their names."""
    removed = []
    for region in Path("/dev/shm").glob(f"{prefix}*"):
        with contextlib.suppress(OSError):
            region.unlink()
            removed.append(region.name)
    return removed


def die_with_parent():
    """A ``preexec_fn`` that makes the kernel send the server SIGTERM if the launching process dies
    without stopping it (Linux ``PR_SET_PDEATHSIG``); ``None`` where libc has no ``prctl``. libc is
    loaded here, in the parent, so the child between fork and exec only makes the one call."""
    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return functools.partial(prctl, 1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


class TritonServer:
    """A tritonserver process serving ``model_repository``; a context manager.

    Ports left ``None`` are picked free (and re-picked if the server fails to bind them).
    ``model_control_mode="explicit"`` starts with only ``load_models`` loaded (tests load more
    through the client). ``log_path=None`` writes the server log to a file under the cache directory;
    ``stream_logs=True`` lets it go to this process's stdout instead. The Python backend's shared
    memory regions carry a prefix unique to this object (``shm_prefix``), so that :meth:`stop`
    removes what a crashed server or a killed stub leaves in ``/dev/shm``, and nothing else.
    """

    def __init__(
        self,
        model_repository: str | Path,
        *,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        host: str = "127.0.0.1",
        tritonserver: str | Path | None = None,
        cache_dir: str | Path | None = None,
        model_control_mode: str = "none",
        load_models: list[str] | tuple[str, ...] = (),
        log_path: str | Path | None = None,
        stream_logs: bool = False,
        log_verbose: int = 0,
        exit_timeout_s: int = 10,
        extra_args: list[str] | tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ):
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise FileNotFoundError(f"model_repository={str(model_repository)!r}: not a directory")
        self.requested_ports = (http_port, grpc_port, metrics_port)
        self.host = host
        self.install = find_tritonserver(tritonserver)
        self.cache_dir = Path(cache_dir) if cache_dir else default_cache_dir()
        self.model_control_mode = model_control_mode
        self.load_models = list(load_models)
        self.log_path = Path(log_path) if log_path else None
        self._log: Path | None = None  # the file the running server logs to (None: stream_logs)
        self.stream_logs = stream_logs
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.extra_args = list(extra_args)
        self.base_env = env
        self.process: subprocess.Popen | None = None
        self.shm_prefix = f"lightspec_{os.getpid()}_{secrets.token_hex(4)}_"
        self.http_port = self.grpc_port = self.metrics_port = 0

    # -- addresses ------------------------------------------------------------------------------
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def log_file(self) -> Path | None:
        """Where the server's log goes (``None`` with ``stream_logs``)."""
        return self._log

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    # -- lifecycle --------------------------------------------------------------------------------
    def command(self, backend_dir: Path) -> list[str]:
        cmd = [
            str(self.install.binary),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_dir}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            "--allow-gpu-metrics=false",
            f"--model-control-mode={self.model_control_mode}",
            f"--log-verbose={self.log_verbose}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        cmd += [f"--load-model={m}" for m in self.load_models]
        return cmd + self.extra_args

    def start(self, timeout_s: float = 600.0) -> Self:
        """Start the server and wait until it is ready; raise ``RuntimeError`` with the log tail if
        it exits or is not ready in ``timeout_s``."""
        backend_dir = build_backend_directory(self.install, self.cache_dir)
        env = server_env(self.install, build_python_path(self.cache_dir), self.base_env)
        pick = any(p is None for p in self.requested_ports)
        for attempt in range(3 if pick else 1):
            fresh = iter(free_ports(3))
            self.http_port, self.grpc_port, self.metrics_port = (p or next(fresh) for p in self.requested_ports)
            chosen = (self.http_port, self.grpc_port, self.metrics_port)
            asked = {flag: p for flag, p, r in zip(PORT_FLAGS, chosen, self.requested_ports) if r}
            if taken := ports_in_use(asked):
                raise RuntimeError(
                    f"port in use: {', '.join(taken)} (another server listens there; 0 picks a free one)"
                )
            self._spawn(backend_dir, env)
            try:
                self.wait_ready(timeout_s)
                return self
            except RuntimeError:
                exited = self.process.poll() is not None
                self.stop()
                if not (pick and exited and "already in use" in self.log_text().lower()) or attempt == 2:
                    raise
        return self

    def _spawn(self, backend_dir: Path, env: dict[str, str]) -> None:
        if self.stream_logs:
            out = None
        else:
            if self.log_path is None:
                (self.cache_dir / "logs").mkdir(parents=True, exist_ok=True)
                fd, path = tempfile.mkstemp(dir=self.cache_dir / "logs", prefix="tritonserver-", suffix=".log")
                os.close(fd)
                self._log = Path(path)
            else:
                self._log = self.log_path
                self._log.parent.mkdir(parents=True, exist_ok=True)
            out = open(self._log, "wb")  # noqa: SIM115 - handed to the child, closed right after
        try:
            self.process = subprocess.Popen(
                self.command(backend_dir),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - one prctl call; no other way to set it
            )
        finally:
            if out is not None:
                out.close()

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode}:\n{self.log_tail()}")
            if self.is_ready():
                return
            time.sleep(0.25)
        raise RuntimeError(f"tritonserver not ready after {timeout_s:.0f}s:\n{self.log_tail()}")

    def is_ready(self) -> bool:
        """Whether the server answers its HTTP readiness check (every model loaded)."""
        try:
            with urllib.request.urlopen(f"http://{self.http_url}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False

    def is_alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> int | None:
        """SIGINT (Triton's graceful shutdown: finishes in-flight requests, unloads models), then
        SIGKILL after ``timeout_s``. Only this server's own pid is signalled, and then whatever it
        leaves in its process group (a server that crashed or was killed orphans its stubs, which
        ignore SIGTERM, and their engine processes). Returns the exit code."""
        p = self.process
        if p is None:
            return None
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait()
        orphans = _group_left(p.pid)
        for pid in orphans:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while orphans and _group_left(p.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        # a crashed server, or one whose stub was killed, never unlinks the regions it shared
        remove_shm_regions(self.shm_prefix)
        return p.returncode

    def kill(self) -> int | None:
        """Stop at once (SIGKILL): for a server that is broken already. Cleans up as :meth:`stop`."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        return self.stop(timeout_s=0)

    def stubs(self) -> list[StubProcess]:
        """The server's Python backend stub processes (see :func:`stub_processes`)."""
        return stub_processes(self.process.pid) if self.process is not None else []

    def log_text(self) -> str:
        if self._log is None or not self._log.is_file():
            return ""
        return self._log.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def __enter__(self) -> Self:
        if not self.is_alive():
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
