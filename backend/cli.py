"""The ``lightspec`` command.

lightspec serve [--model-repository DIR] [--http-port P] [--grpc-port P] [--metrics-port P] ...
lightspec openai --triton-url HOST:PORT [--port P] [--host H] [--model-dir DIR]
lightspec generate "def fib(n):" [--max-tokens N] [--url HOST:PORT] [--no-stream] [--temperature T]
lightspec bench ...            (lightspec_backend.bench, when present)
lightspec train-heads --model DIR --data PATH... --out DIR [--minutes M] [--steps N] [--resume] ...
lightspec repository --model-dir DIR [--mtp-dir DIR] [--draft-dir DIR] [--set KEY=VALUE] --out REPO
"""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from .generate import generate
from .install import PACKAGE_DIR, default_cache_dir
from .launcher import TritonServer
from .openai_api.command import add_parsers as add_openai_parsers

DEFAULT_PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}  # Triton's; 0 picks free ports


def default_repository() -> Path | None:
    """The source checkout's ``model_repository/``, when running from one."""
    repo = PACKAGE_DIR.parent / "model_repository"
    return repo if (repo / "lightspec" / "config.pbtxt").is_file() else None


def _overrides(args) -> dict[str, str]:
    out = {}
    for item in args.set or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE (a config.pbtxt parameter)")
        out[key.strip()] = value.strip()
    for key in ("model_dir", "mtp_dir", "draft_dir", "speculation", "policy"):
        if getattr(args, key, None):
            out[key] = getattr(args, key)
    for key in ("model_dir", "mtp_dir", "draft_dir"):  # a repository resolves relative paths against itself
        if out.get(key):
            out[key] = str(Path(out[key]).expanduser().resolve())
    return _resolve_kv_fraction(out)


def _resolve_kv_fraction(out: dict[str, str]) -> dict[str, str]:
    """``kv_cache_memory`` as a fraction of free memory becomes bytes here, measured once, so that
    every process of the server sizes the same pool (see ``lightspec_core.engine.kv_budget``). The
    fraction is of what the weights leave, shared by every pool: each engine process (several with
    ``data_parallel_size``) loads the weights and allocates a pool of its own, and with ``speculation:
    draft`` the draft model's weights and pool come on top of the target's (with ``mtp``, the heads'
    runner)."""
    from lightspec_core.config import parse_memory, resolve_dirs

    value = out.get("kv_cache_memory")
    if value and (fraction := parse_memory(value)[1]) is not None:
        from lightspec_core.engine.kv_budget import available_memory, engine_weights_bytes
        from lightspec_core.models.llama import LlamaConfig

        from .params import check_checkpoints, parse_backend_config
        from .repository import default_parameters

        rest = {k: v for k, v in out.items() if k != "kv_cache_memory"}
        config = parse_backend_config({**default_parameters(), **rest})
        check_checkpoints(config)  # a missing model_dir is named as without a fraction
        cfg, engines = config.engine, config.engine_processes()
        target = resolve_dirs(cfg)[0]
        try:
            weights = engine_weights_bytes(cfg, LlamaConfig.from_dir(target), target)
        except OSError as e:  # the heads or the draft model the fraction must count
            raise ValueError(f"kv_cache_memory={value!r}: cannot count the weights it comes after: {e}") from None
        free = max(available_memory(cfg.device) - engines * weights, 0)
        out["kv_cache_memory"] = str(int(fraction * free / engines))
    return out


def _repository(args) -> Path:
    from .repository import write_model_repository

    overrides = _overrides(args)
    if args.model_repository:
        if overrides:
            raise ValueError(
                "--set/--model-dir/--mtp-dir/--draft-dir/--speculation/--policy generate a repository; "
                "edit config.pbtxt instead when passing --model-repository"
            )
        return Path(args.model_repository)
    if not overrides and default_repository() is not None:
        return default_repository()
    # one directory a run: another serve writing its own overrides must not rewrite this one, which
    # the supervisor loads again when it restarts the server
    (default_cache_dir() / "repositories").mkdir(parents=True, exist_ok=True)
    return write_model_repository(Path(tempfile.mkdtemp(dir=default_cache_dir() / "repositories")), overrides)


def _generated(args, repo: Path) -> bool:
    """Whether this run wrote ``repo`` (a --model-repository is the user's, wherever it lies: one
    another serve generated is that serve's to remove)."""
    return not args.model_repository and repo.parent == default_cache_dir() / "repositories"


def _remove_generated(args, repo: Path) -> None:
    if _generated(args, repo):
        shutil.rmtree(repo, ignore_errors=True)


def _named_for_serve(message: str, args, repo: Path) -> str:
    """A generated repository is gone by the time its error is read: name the model instead of its
    config.pbtxt (the parameter and value, which the message names, are what --set gave)."""
    if not _generated(args, repo):
        return message
    message = re.sub(rf"{re.escape(str(repo))}/([^/\s]+)/config\.pbtxt", r"model \1", message)
    return message.replace(str(repo), "the generated repository")


def _port(args, name: str) -> int | None:
    port = getattr(args, f"{name}_port")
    port = DEFAULT_PORTS[name] if port is None else port
    return port or None  # TritonServer picks a free port for None


def _server(args, repo: Path) -> TritonServer:
    from .repository import server_args  # here: the parser stays light

    return TritonServer(
        repo,
        http_port=_port(args, "http"),
        grpc_port=_port(args, "grpc"),
        metrics_port=_port(args, "metrics"),
        stream_logs=args.verbose,
        log_verbose=args.log_verbose,
        tritonserver=args.tritonserver,
        model_control_mode="explicit",  # the supervisor unloads the orchestrator first on shutdown
        load_models=["*"],
        extra_args=server_args(repo),
    )


def _print_endpoints(server: TritonServer, verbose: bool, openai_url: str | None = None) -> None:
    print(
        f"LightSpec is serving (tritonserver pid {server.pid}):\n"
        f'  gRPC     {server.grpc_url}    try: lightspec generate "def fib(n):" --url {server.grpc_url}\n'
        f"  HTTP     http://{server.http_url}/v2/models/lightspec/generate (and /generate_stream)\n"
        + (f"  OpenAI   {openai_url} (/completions, /chat/completions, /models)\n" if openai_url else "")
        + f"  metrics  {server.metrics_url}\n"
        + ("" if verbose else f"  log      {server.log_file}\n")
        + "Ctrl-C to stop.",
        flush=True,
    )


def _sample(args, server: TritonServer) -> int:
    print(f"\nSample completion of {args.sample!r} (gRPC stream):", flush=True)
    sample = argparse.Namespace(
        prompt=args.sample, max_tokens=args.sample_tokens, url=server.grpc_url, model="lightspec",
        no_stream=False, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=None,
        num_draft_tokens=None, timeout=300.0,
    )  # fmt: skip
    return generate(sample)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _run(args, supervisor, apis: list) -> int:
    """Start the server, print where it listens, and serve (restarting it on faults) until
    interrupted. The OpenAI API server it starts goes into ``apis``: the caller stops it once
    Triton has drained, since the API's open streams are requests the drain lets finish."""
    from .openai_api.command import start_for_serve

    server = supervisor.server
    supervisor.start(timeout_s=args.startup_timeout)
    api = start_for_serve(args, server.grpc_url, server.model_repository)
    if api is not None:
        apis.append(api)
    _print_endpoints(server, args.verbose, api.url if api else None)
    if args.sample:
        code = _sample(args, server)
        if code == 130:  # the client took serve's SIGTERM or Ctrl-C: drain, as at any other time
            raise KeyboardInterrupt
        if code != 0:
            return 1
    supervisor.run()
    return 0


def serve(args) -> int:
    """Validate the repository, then run tritonserver on it. A bad parameter is the last line printed
    (exit 2), before any server starts."""
    try:
        repo = _repository(args)
    except ValueError as e:
        print(f"lightspec serve: {e}", file=sys.stderr)
        return 2
    try:
        return _serve_repository(args, repo)
    finally:
        _remove_generated(args, repo)


def _serve_repository(args, repo: Path) -> int:
    from .repository import validate_repository

    try:
        for note in validate_repository(repo):
            print(_named_for_serve(note, args, repo), flush=True)
    except ValueError as e:
        print(f"lightspec serve: {_named_for_serve(str(e), args, repo)}", file=sys.stderr)
        return 2
    try:
        server = _server(args, repo)
    except RuntimeError as e:  # no tritonserver found
        print(f"lightspec serve: {e}", file=sys.stderr)
        return 1
    from .supervisor import Supervisor

    # SIGINT too, explicitly: a process started with SIGINT ignored (a background job of a script)
    # keeps Python from installing its handler, and then Ctrl-C or `kill -INT` would not stop it
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    (default_cache_dir() / "control").mkdir(parents=True, exist_ok=True)
    control = Path(tempfile.mkdtemp(dir=default_cache_dir() / "control"))
    supervisor = Supervisor(server, control)
    print(f"Starting tritonserver ({server.install.binary}) with {repo} ...", flush=True)
    apis: list = []
    try:
        return _run(args, supervisor, apis)
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: drain; a second one stops at once
        if supervisor.serving:
            print(f"\nStopping tritonserver (in-flight requests get {args.grace_period:g} s to finish) ...", flush=True)
        else:
            print("\nStopping tritonserver (it was still loading) ...", flush=True)
        try:
            return 0 if supervisor.shutdown(args.grace_period) in (0, None) else 1
        except KeyboardInterrupt:
            print("Stopping tritonserver now ...", flush=True)
            server.kill()
            return 1
    except RuntimeError as e:
        print(str(e), file=sys.stderr)
        return 1
    finally:
        # from here a signal kills the server instead of cutting the cleanup short (its orphaned
        # stubs, its shared memory, the control directory)
        for sig in previous:
            signal.signal(sig, lambda *_: server.process is not None and server.process.kill())
        for api in apis:  # after the drain: until then its streams were requests finishing
            api.stop()
        server.stop()
        shutil.rmtree(control, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def bench(args) -> int:
    try:
        module = importlib.import_module("lightspec_backend.bench")
    except ModuleNotFoundError as e:
        if e.name != "lightspec_backend.bench":
            raise
        print("lightspec bench is not available in this version", file=sys.stderr)
        return 2
    return module.main(args.bench_args)


def repository(args) -> int:
    """Write the model repository ``serve --model-dir`` would generate, validated the same way."""
    from .repository import validate_repository, write_model_repository

    try:
        overrides = _overrides(args)
        with tempfile.TemporaryDirectory() as scratch:  # validated before --out is touched
            try:
                notes = validate_repository(write_model_repository(Path(scratch), overrides))
            except ValueError as e:  # named as the file it would have been
                raise ValueError(str(e).replace(scratch, str(Path(args.out)))) from None
        repo = write_model_repository(Path(args.out), overrides)
    except ValueError as e:
        print(f"lightspec repository: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(note)
    models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
    print(
        f"wrote {repo}: {', '.join(models)}; serve it with lightspec serve --model-repository {repo}, or copy "
        "the models into a Triton repository (backend: lightspec, see docs/serving.md)"
    )
    return 0


def train_heads(args) -> int:
    # torch comes with the training package: only this command pays for importing it
    from lightspec_core.training.train_heads import main as train_heads_main

    return train_heads_main(args.train_args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lightspec", description="Dynamic MTP speculative decoding on Triton")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="start tritonserver with the LightSpec models")
    s.add_argument("--model-repository", help="default: the checkout's model_repository/, else a generated one")
    for name, port in DEFAULT_PORTS.items():
        s.add_argument(f"--{name}-port", type=int, help=f"default {port}; 0 picks a free port")
    s.add_argument("--model-dir", help="target checkpoint (generates a repository; MTP/draft are its siblings)")
    s.add_argument("--mtp-dir", help="MTP heads (default: the target's sibling mtp/)")
    s.add_argument("--draft-dir", help="draft model with the target's tokenizer (default: the sibling draft/)")
    s.add_argument("--speculation", help="mtp | draft | ngram | none")
    s.add_argument("--policy", help="dynamic | off | static | static:K")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config.pbtxt parameter (repeatable)")
    s.add_argument("--tritonserver", help="tritonserver binary (default: PATH, then the nvidia-pytriton wheel)")
    s.add_argument("--startup-timeout", type=float, default=600.0)
    s.add_argument("--verbose", action="store_true", help="print the server log here instead of to a file")
    s.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    s.add_argument("--sample", metavar="PROMPT", help="once ready, stream a completion of PROMPT (then keep serving)")
    s.add_argument("--sample-tokens", type=int, default=64, help="tokens for --sample")
    s.add_argument("--grace-period", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    s.set_defaults(func=serve)
    add_openai_parsers(sub, s)  # lightspec openai, and serve's --openai-port

    g = sub.add_parser("generate", help="stream a completion from a running server (gRPC)")
    g.add_argument("prompt", help='prompt text, or "-" to read it from stdin')
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--url", default=f"127.0.0.1:{DEFAULT_PORTS['grpc']}", help="gRPC HOST:PORT")
    g.add_argument("--model", default="lightspec")
    g.add_argument("--no-stream", action="store_true", help="one response at the end instead of streaming")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--num-draft-tokens", type=int, help="cap on draft tokens per step (0: no speculation)")
    g.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each response")
    g.set_defaults(func=generate)

    # Arguments after "bench" belong to lightspec_backend.bench; main() hands them over untouched.
    b = sub.add_parser("bench", help="benchmark (see lightspec_backend.bench)", add_help=False)
    b.set_defaults(func=bench, bench_args=[])

    r = sub.add_parser("repository", help="write a model repository for a checkpoint (to copy into a Triton)")
    r.add_argument("--model-dir", required=True, help="target checkpoint (Hugging Face layout)")
    r.add_argument("--mtp-dir", help="MTP heads (default: the target's sibling mtp/, or lightspec train-heads')")
    r.add_argument("--draft-dir", help="draft model for speculation draft (default: the sibling draft/)")
    r.add_argument("--speculation", help="mtp | draft | ngram | none")
    r.add_argument("--policy", help="dynamic | off | static | static:K")
    r.add_argument("--set", action="append", metavar="KEY=VALUE", help="any config.pbtxt parameter (repeatable)")
    r.add_argument("--out", required=True, help="the repository directory to write")
    r.set_defaults(func=repository)

    # Likewise for "train-heads": lightspec_core.training.train_heads parses them (and prints its --help).
    t = sub.add_parser("train-heads", help="train MTP heads for a target checkpoint", add_help=False)
    t.set_defaults(func=train_heads, train_args=[])
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        args = build_parser().parse_args(["bench"])
        args.bench_args = argv[1:]
    elif argv[:1] == ["train-heads"]:
        args = build_parser().parse_args(["train-heads"])
        args.train_args = argv[1:]
    else:
        args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
