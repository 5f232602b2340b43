"""The generated model repository: checked-in copy up to date, valid Triton configs, stage tensors
matching the stage dataclasses."""

from __future__ import annotations

import os
from dataclasses import fields
from pathlib import Path

import pytest
from google.protobuf import json_format, text_format
from lightspec_backend.params import Role, available_cpus, parse_backend_config, read_config_parameters
from lightspec_backend.repository import (
    STAGE_TENSORS,
    check_stage_tensors,
    render_repository,
    render_stage,
    write_model_repository,
)
from lightspec_backend.stage import stage_threads
from lightspec_backend.tensors import INPUTS, OUTPUTS
from tritonclient.grpc import model_config_pb2

ROOT = Path(__file__).resolve().parents[2]


def parse(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def test_checked_in_model_repository_is_up_to_date():
    for name, text in render_repository().items():
        path = ROOT / "model_repository" / name / "config.pbtxt"
        assert path.read_text() == text, f"{path} is stale: regenerate with write_model_repository('model_repository')"
        assert (path.parent / "1").is_dir()


def test_orchestrator_config_is_decoupled_and_declares_the_contract():
    cfg = parse(render_repository()["lightspec"])
    assert cfg.backend == "lightspec" and cfg.max_batch_size == 0 and cfg.model_transaction_policy.decoupled
    assert [i.name for i in cfg.input] == [s.name for s in INPUTS]
    assert [o.name for o in cfg.output] == [s.name for s in OUTPUTS]
    assert all(i.optional for i in cfg.input)
    assert cfg.parameters["role"].string_value == "orchestrator"
    for key in (
        "speculation",
        "policy",
        "max_draft_tokens",
        "num_kv_blocks",
        "block_size",
        "max_num_seqs",
        "max_num_batched_tokens",
        "pipeline_depth",
        "metrics",
        "target_model",
        "mtp",
        "draft_model",
        "model_dir",
        "mtp_dir",
        "draft_dir",
    ):
        assert key in cfg.parameters, key


@pytest.mark.parametrize("name", ["lightspec_target", "lightspec_mtp", "lightspec_draft"])
def test_stage_configs_are_plain_cpu_models(name):
    cfg = parse(render_repository({"mtp": "lightspec_mtp", "stages": "triton"})[name])
    assert not cfg.model_transaction_policy.decoupled and cfg.max_batch_size == 0
    assert cfg.instance_group[0].kind == model_config_pb2.ModelInstanceGroup.KIND_CPU
    assert cfg.instance_group[0].count == 1


def test_stage_tensor_tables_match_the_stage_dataclasses():
    """The stage contract is defined once, by the dataclasses: the config.pbtxt tensors follow it."""
    for cls, specs in STAGE_TENSORS.items():
        assert [s.name for s in specs] == [f.name for f in fields(cls)], cls.__name__


def test_overrides_reach_the_stages_that_use_them(tmp_path):
    repo = write_model_repository(
        tmp_path,
        {
            "model_dir": "/ckpt/target",
            "num_kv_blocks": 48,
            "num_threads": 1,
            "target_model": "big",
            "mtp": "lightspec_mtp",
            "stages": "triton",
        },
    )
    target = read_config_parameters(repo / "big" / "config.pbtxt")
    assert target["role"] == "target" and target["num_kv_blocks"] == "48" and target["model_dir"] == "/ckpt/target"
    mtp = read_config_parameters(repo / "lightspec_mtp" / "config.pbtxt")
    # the MTP stage reads the KV geometry only for its profile, which must be the orchestrator's
    assert mtp["num_kv_blocks"] == "48" and mtp["num_threads"] == "1" and mtp["mtp"] == "lightspec_mtp"
    orch = parse_backend_config(read_config_parameters(repo / "lightspec" / "config.pbtxt"))
    assert orch.stage_models["target"] == "big" and orch.engine.num_kv_blocks == 48


def test_every_stage_knows_the_draft_model_whose_pool_the_kv_budget_includes(tmp_path):
    overrides = {"model_dir": "/ckpt/target", "draft_dir": "/ckpt/small", "speculation": "draft", "stages": "triton"}
    repo = write_model_repository(tmp_path, overrides)
    for name in ("lightspec_target", "lightspec_draft"):
        assert read_config_parameters(repo / name / "config.pbtxt")["draft_dir"] == "/ckpt/small", name


def test_parameter_values_are_quoted(tmp_path):
    repo = write_model_repository(tmp_path, {"model_dir": 'we"ird\\path'})
    assert read_config_parameters(repo / "lightspec" / "config.pbtxt")["model_dir"] == 'we"ird\\path'


def test_orchestrator_runs_one_torch_thread_and_stages_leave_it_a_core():
    """The orchestrator's own torch work is small kernels (local MTP heads, rejection sampling): it
    defaults to one intra-op thread. A stage without ``num_threads`` takes one thread per CPU but
    one for small calls, so the two processes do not ask for more threads than there are CPUs, and
    every CPU for large ones (the orchestrator waits on those)."""
    repo = render_repository({"stages": "triton"})
    assert parse(repo["lightspec"]).parameters["num_threads"].string_value == "1"
    assert "num_threads" not in parse(repo["lightspec_target"]).parameters
    forced = render_repository({"num_threads": "2", "stages": "triton"})
    assert parse(forced["lightspec"]).parameters["num_threads"].string_value == "2"
    assert parse(forced["lightspec_target"]).parameters["num_threads"].string_value == "2"
    auto = [stage_threads(0, cpus) for cpus in (1, 2, 4, 16)]
    assert [(t.small, t.large) for t in auto] == [(1, 1), (1, 2), (3, 4), (15, 16)]
    assert [auto[1].for_call(n) for n in (1, 5, 63, 64, 320)] == [1, 1, 1, 2, 2]
    fixed = stage_threads(2, 2)  # an explicit setting wins for every call, even one that oversubscribes
    assert (fixed.for_call(1), fixed.for_call(1000)) == (2, 2)
    assert 1 <= available_cpus() <= (os.cpu_count() or 1)


def test_batched_front_declares_the_same_tensors_with_a_batch_dimension():
    cfg = parse(render_repository()["lightspec_batched"])
    assert cfg.backend == "lightspec" and cfg.max_batch_size == 1 and cfg.model_transaction_policy.decoupled
    assert not cfg.HasField("dynamic_batching")  # each request forwarded on its own
    assert [(i.name, list(i.dims)) for i in cfg.input] == [(s.name, list(s.dims)) for s in INPUTS]
    assert [o.name for o in cfg.output] == [s.name for s in OUTPUTS]
    assert all(i.optional for i in cfg.input)
    assert cfg.parameters["role"].string_value == "batched"
    assert cfg.parameters["orchestrator_model"].string_value == "lightspec"


def test_trtllm_and_vllm_backend_inputs_are_declared_optional():
    names = {i.name: i for i in parse(render_repository()["lightspec"]).input}
    for name in ("sampling_parameters", "min_tokens", "min_length", "random_seed", "beam_width", "bad_words",
                 "num_return_sequences", "pad_id", "return_log_probs", "repetition_penalty"):  # fmt: skip
        assert names[name].optional, name


@pytest.mark.parametrize("stages", ["local", "process"])
def test_stages_with_the_engine_render_no_stage_models_and_threads_per_cpu(stages):
    models = render_repository({"stages": stages})
    assert set(models) == {"lightspec", "lightspec_batched"}
    orch = models["lightspec"]
    assert f'{{ key: "stages" value: {{ string_value: "{stages}" }} }}' in orch
    assert '{ key: "num_threads" value: { string_value: "0" } }' in orch  # the one process that computes
    assert '{ key: "num_threads" value: { string_value: "1" } }' in render_repository({"stages": "triton"})["lightspec"]
    assert "runs its stages itself" in orch and "by BLS" in render_repository({"stages": "triton"})["lightspec"]


def test_rewrite_removes_stage_models_the_new_render_drops(tmp_path):
    """A repository written once with stage models and then with ``stages: local`` holds only the
    orchestrator and the batched front: the stale stages (with their old parameters) are gone."""
    first = write_model_repository(tmp_path, {"mtp": "lightspec_mtp", "speculation": "draft", "policy": "bogus",
                                              "stages": "triton"})  # fmt: skip
    stages = {"lightspec_target", "lightspec_mtp", "lightspec_draft"}
    assert stages <= {p.name for p in first.iterdir()}
    repo = write_model_repository(tmp_path, {"stages": "local"})
    assert sorted(p.name for p in repo.iterdir()) == ["lightspec", "lightspec_batched"]
    for name in ("lightspec", "lightspec_batched"):
        assert parse((repo / name / "config.pbtxt").read_text()).backend == "lightspec"
    assert read_config_parameters(repo / "lightspec" / "config.pbtxt")["stages"] == "local"


def test_rewrite_keeps_other_backends_models_and_folders_without_a_config(tmp_path):
    write_model_repository(tmp_path, {"mtp": "lightspec_mtp"})
    onnx = tmp_path / "my_onnx_model"
    (onnx / "1").mkdir(parents=True)
    (onnx / "config.pbtxt").write_text('name: "my_onnx_model"\nbackend: "onnxruntime"\nmax_batch_size: 0\n')
    (tmp_path / "notes" / "1").mkdir(parents=True)
    (tmp_path / "notes" / "1" / "data.txt").write_text("mine")
    broken = tmp_path / "half_edited"
    broken.mkdir()
    (broken / "config.pbtxt").write_text('backend: "lightspec"\nthis is not a config {')
    (tmp_path / "README").write_text("my models")
    repo = write_model_repository(tmp_path, {"stages": "local"})
    assert sorted(p.name for p in repo.iterdir()) == [
        "README", "half_edited", "lightspec", "lightspec_batched", "my_onnx_model", "notes",
    ]  # fmt: skip
    assert parse((onnx / "config.pbtxt").read_text()).backend == "onnxruntime" and (onnx / "1").is_dir()
    assert (tmp_path / "notes" / "1" / "data.txt").read_text() == "mine"


@pytest.mark.parametrize("role", [Role.TARGET, Role.DRAFT, Role.MTP])
def test_a_stage_config_missing_a_tensor_of_the_contract_fails_its_load_naming_it(role):
    """A repository written before ModelResult.finite existed: every BLS call would ask the stage for
    an output it does not declare and fail; the stage's load fails instead, saying what to do."""
    text = render_stage(role, "s", {})
    as_triton = json_format.MessageToDict(parse(text), preserving_proto_field_name=True)
    check_stage_tensors(role, as_triton)  # the current config declares everything
    gone = "finite" if role is not Role.MTP else "draft_conf"
    as_triton["output"] = [t for t in as_triton["output"] if t["name"] != gone]
    with pytest.raises(ValueError, match=rf"declares no output {gone}: the repository was written by an older"):
        check_stage_tensors(role, as_triton)
