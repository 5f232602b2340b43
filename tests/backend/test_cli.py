"""The ``lightspec`` command without a server: its parser, bench hand-off, repository choice, validation."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightspec_backend import cli
from lightspec_backend.repository import validate_repository

ROOT = Path(__file__).resolve().parents[2]


def test_cli_parser_has_serve_generate_and_bench():
    p = cli.build_parser()
    args = p.parse_args(["generate", "hi", "--max-tokens", "3", "--no-stream", "--temperature", "0.5"])
    assert args.max_tokens == 3 and args.no_stream and args.temperature == 0.5
    args = p.parse_args(["serve", "--http-port", "0", "--set", "policy=off"])
    assert args.http_port == 0 and args.set == ["policy=off"]
    assert "bench" in p.format_help()


def test_cli_bench_hands_its_arguments_to_the_bench_module(monkeypatch):
    import types

    seen = {}
    fake = types.ModuleType("lightspec_backend.bench")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "lightspec_backend.bench", fake)
    cli.main(["bench", "--anything", "goes"])
    assert seen["argv"] == ["--anything", "goes"]


def test_cli_default_repository_is_the_checkout():
    assert cli.default_repository() == ROOT / "model_repository"


def test_cli_generates_a_repository_for_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    args = cli.build_parser().parse_args(["serve", "--policy", "static:2", "--set", "num_kv_blocks=8"])
    repo = cli._repository(args)
    text = (repo / "lightspec" / "config.pbtxt").read_text()
    assert repo.parent == tmp_path / "repositories" and '"static:2"' in text and '"8"' in text
    # another run's overrides go to another directory: a running server's repository stays its own
    other = cli._repository(cli.build_parser().parse_args(["serve", "--policy", "off"]))
    assert other != repo and '"static:2"' in (repo / "lightspec" / "config.pbtxt").read_text()


def test_cli_validation_leaves_other_backends_models_alone(tmp_path):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.pbtxt").write_text(
        'name: "other"\nbackend: "onnxruntime"\nparameters [ { key: "policy" value: { string_value: "bogus" } } ]\n'
    )
    assert validate_repository(tmp_path) == []
    with pytest.raises(ValueError, match="not a directory"):
        validate_repository(tmp_path / "missing")


def test_cli_repository_writes_a_validated_repository_for_a_checkpoint(tmp_path, smoke_model, capsys, monkeypatch):
    from lightspec_backend.params import parse_backend_config, read_config_parameters

    monkeypatch.chdir(smoke_model)  # a relative --model-dir is made absolute: the repository may move
    out = tmp_path / "repo"
    argv = [
        "repository",
        "--model-dir",
        "target",
        "--set",
        "num_kv_blocks=32",
        "--set",
        "kv_cache_memory=0.5",
        "--set",
        "stages=triton",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    assert "wrote" in capsys.readouterr().out
    orch = parse_backend_config(read_config_parameters(out / "lightspec" / "config.pbtxt"), base_dir=out)
    assert orch.engine.model_dir == str((smoke_model / "target").resolve())
    # a fraction of free memory became bytes once, for every model of the repository alike
    budget = orch.engine.kv_cache_memory
    assert budget.isdigit() and int(budget) > 0
    assert read_config_parameters(out / "lightspec_target" / "config.pbtxt")["kv_cache_memory"] == budget
    assert cli.main(["repository", "--model-dir", "target", "--policy", "bogus", "--out", str(tmp_path / "bad")]) == 2
    assert "parameter policy='bogus'" in capsys.readouterr().err.splitlines()[-1]
    # a bad value is refused before the repository it would replace is touched, named in it
    before = (out / "lightspec" / "config.pbtxt").read_text()
    argv = ["repository", "--model-dir", "target", "--set", "stages=triton", "--set", "max_num_seqs=abc"]
    assert cli.main([*argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert (
        err.startswith(f"lightspec repository: {out / 'lightspec' / 'config.pbtxt'}: ") and "max_num_seqs='abc'" in err
    )
    assert (out / "lightspec" / "config.pbtxt").read_text() == before


@pytest.mark.parametrize("command", ["repository", "serve"])
def test_a_missing_checkpoint_is_named_with_a_kv_fraction_too(tmp_path, capsys, command):
    argv = [command, "--model-dir", str(tmp_path / "nowhere"), "--set", "kv_cache_memory=0.5"]
    assert cli.main([*argv, *(["--out", str(tmp_path / "repo")] if command == "repository" else [])]) == 2
    assert f"parameter model_dir='{tmp_path / 'nowhere'}': no checkpoint" in capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize(("extra", "engines", "method"), [
    ({"data_parallel_size": "2", "speculation": "mtp"}, 2, "mtp"),
    ({"data_parallel_size": "1", "speculation": "draft"}, 1, "draft"),
    ({"stages": "triton", "speculation": "mtp"}, 1, "mtp"),
    ({"data_parallel_size": "2", "speculation": "ngram"}, 2, "ngram"),
])  # fmt: skip
def test_a_kv_fraction_is_shared_by_every_pool_after_every_copy_of_the_weights(
    smoke_model, monkeypatch, extra, engines, method
):
    from lightspec_core.engine import kv_budget
    from lightspec_core.models.llama import LlamaConfig

    monkeypatch.setattr(kv_budget, "available_memory", lambda device: 8 * 2**30)
    target = str(smoke_model / "target")
    weights = kv_budget.weights_bytes(target, "float32")
    if method == "draft":
        weights += kv_budget.weights_bytes(str(smoke_model / "draft"), "float32")
    if method == "mtp":  # the heads' runner, in every engine process
        weights += kv_budget.mtp_bytes(LlamaConfig.from_dir(target), smoke_model / "mtp")
    out = cli._resolve_kv_fraction({"model_dir": target, "kv_cache_memory": "0.5", **extra})
    assert int(out["kv_cache_memory"]) == int(0.5 * (8 * 2**30 - engines * weights) / engines)


class _Server:
    """What serve needs of a TritonServer, recording how it was stopped."""

    def __init__(self):
        self.process, self.calls = None, []
        self.install = type("Install", (), {"binary": "tritonserver"})()

    def kill(self):
        self.calls.append("kill")

    def stop(self):
        self.calls.append("stop")


def _started_supervisor(tmp_path, run, shutdown):
    """A Supervisor whose server started: ``run()`` is its serving, ``shutdown(grace)`` its drain."""

    class Supervisor:
        serving = True

        def __init__(self, server, control):
            self.server = server
            server.pid, server.grpc_url, server.http_url, server.metrics_url = 1, "g", "h", "m"
            server.log_file, server.model_repository = None, tmp_path

        def start(self, timeout_s):
            pass

        def run(self):
            run()

        def shutdown(self, grace_period):
            shutdown(grace_period)
            return 0

    return Supervisor


def test_a_second_signal_during_the_drain_stops_the_server_at_once_and_cleans_up(monkeypatch, tmp_path):
    import signal

    from lightspec_backend import supervisor

    class Supervisor:
        serving = True

        def __init__(self, server, control):
            self.server, self.control = server, control

        def shutdown(self, grace_period):
            assert self.control.is_dir()
            raise KeyboardInterrupt  # the second SIGTERM or Ctrl-C, while in-flight requests drain

    def first_signal(args, sup, apis):
        raise KeyboardInterrupt

    server = _Server()
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "_server", lambda args, repo: server)
    monkeypatch.setattr(cli, "_run", first_signal)
    monkeypatch.setattr(supervisor, "Supervisor", Supervisor)
    before = signal.getsignal(signal.SIGINT)
    assert cli.main(["serve"]) == 1
    assert server.calls == ["kill", "stop"]  # killed, then cleaned up (stubs, shared memory)
    assert not any((tmp_path / "control").iterdir()) and signal.getsignal(signal.SIGINT) is before


def test_the_openai_api_stops_after_tritons_drain_so_its_streams_get_the_grace_period(monkeypatch, tmp_path):
    """Its open streams are requests the drain lets finish: stopped first, uvicorn would cut them
    after its own 5 s and the drain would start only then."""
    from lightspec_backend import supervisor
    from lightspec_backend.openai_api import command

    events = []

    class Api:
        url = "http://127.0.0.1:1/v1"

        def stop(self):
            events.append("api stopped")

    def serving():
        raise KeyboardInterrupt  # SIGTERM while serving

    Supervisor = _started_supervisor(tmp_path, serving, lambda grace: events.append(f"drained {grace:g} s"))
    server = _Server()
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "_server", lambda args, repo: server)
    monkeypatch.setattr(command, "start_for_serve", lambda args, url, repo: Api())
    monkeypatch.setattr(supervisor, "Supervisor", Supervisor)
    assert cli.main(["serve"]) == 0
    assert events == ["drained 30 s", "api stopped"] and server.calls == ["stop"]


def test_a_signal_while_the_sample_streams_drains_the_server_as_at_any_other_time(monkeypatch, tmp_path):
    from lightspec_backend import supervisor

    drained = []

    def serving():
        raise AssertionError("serving on after the interrupted sample")

    Supervisor = _started_supervisor(tmp_path, serving, drained.append)
    server = _Server()
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cli, "_server", lambda args, repo: server)
    monkeypatch.setattr(cli, "generate", lambda args: 130)  # what generate returns when interrupted
    monkeypatch.setattr(supervisor, "Supervisor", Supervisor)
    assert cli.main(["serve", "--sample", "def f():", "--no-openai"]) == 0
    assert drained == [30.0] and server.calls == ["stop"]


def test_serve_names_a_bad_set_by_model_and_parameter_not_by_the_generated_file_it_removes(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    assert cli.main(["serve", "--set", "speculation=eagle", "--no-openai"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("lightspec serve: model lightspec: parameter speculation='eagle': "), err
    assert str(tmp_path) not in err and not any((tmp_path / "repositories").iterdir())


def test_serve_leaves_a_model_repository_it_was_given_even_in_the_generated_repositories_folder(
    tmp_path, capsys, monkeypatch
):
    """A repository another serve generated (its path is printed) is that serve's: passed with
    --model-repository, a failing serve must not remove it and names its file."""
    from lightspec_backend.repository import write_model_repository

    monkeypatch.setenv("LIGHTSPEC_CACHE", str(tmp_path))
    repo = write_model_repository(tmp_path / "repositories" / "other", {"speculation": "eagle"})
    assert cli.main(["serve", "--model-repository", str(repo), "--no-openai"]) == 2
    assert str(repo / "lightspec" / "config.pbtxt") in capsys.readouterr().err
    assert (repo / "lightspec" / "config.pbtxt").is_file()


def test_serve_starts_tritonserver_forwarding_the_headers_the_orchestrator_leaves_alone(tmp_path):
    from lightspec_backend.repository import write_model_repository

    args = cli.build_parser().parse_args(["serve"])
    plain = write_model_repository(tmp_path / "plain", {})
    assert cli._server(args, plain).extra_args == []
    repo = write_model_repository(tmp_path / "repo", {"header_forward_pattern": "^x-tenant"})
    assert cli._server(args, repo).extra_args == ["--grpc-header-forward-pattern=^x-tenant",
                                                  "--http-header-forward-pattern=^x-tenant"]  # fmt: skip
