"""config.pbtxt parameters -> BackendConfig: defaults, conversions, and errors that name the parameter."""

from __future__ import annotations

import pytest
from lightspec_backend.params import (
    Role,
    check_checkpoints,
    check_single_instance,
    check_stage_configs,
    flatten_parameters,
    parse_backend_config,
    read_config_parameters,
)
from lightspec_backend.repository import write_model_repository

BLS = {"stages": "triton"}  # stage models over BLS: what the tests of stage configs are about


def test_empty_parameters_give_the_engine_defaults():
    cfg = parse_backend_config({})
    assert cfg.role is Role.ORCHESTRATOR
    assert cfg.metrics is True
    assert cfg.engine.speculation == "mtp" and cfg.engine.policy == "dynamic"
    assert cfg.engine.model_dir is None
    assert cfg.engine.mtp == "fused" and cfg.fused
    assert cfg.stage_models == {"target": "lightspec_target", "draft": "lightspec_draft"}


def test_strings_are_converted_to_engine_field_types():
    cfg = parse_backend_config(
        {"num_kv_blocks": "64", "block_size": "8", "kv_high_water": "0.5", "max_model_len": "128", "policy": "static:2"}
    )
    assert cfg.engine.num_kv_blocks == 64 and cfg.engine.block_size == 8
    assert cfg.engine.kv_high_water == 0.5 and cfg.engine.max_model_len == 128
    assert cfg.engine.static_k == 2


def test_empty_string_means_default():
    cfg = parse_backend_config({"model_dir": "", "num_kv_blocks": "", "max_model_len": ""})
    assert cfg.engine.model_dir is None and cfg.engine.num_kv_blocks == 1024 and cfg.engine.max_model_len is None


@pytest.mark.parametrize(
    ("params", "fragment"),
    [
        ({"speculation": "eagle"}, "speculation='eagle'"),
        ({"policy": "sometimes"}, "policy='sometimes'"),
        ({"num_kv_blocks": "lots"}, "num_kv_blocks='lots'"),
        ({"num_kv_blocks": "0"}, "num_kv_blocks=0"),
        ({"max_draft_tokens": "99"}, "max_draft_tokens=99"),
        ({"pipeline_depth": "3"}, "pipeline_depth=3"),
        ({"metrics": "maybe"}, "metrics='maybe'"),
        ({"role": "router"}, "role='router'"),
        ({"num_kv_block": "64"}, "num_kv_block='64'"),  # typo: unknown parameter
        ({"decode_threads": "-1"}, "decode_threads=-1"),
        ({"max_model_len": "-5"}, "max_model_len=-5"),
        ({"max_model_len": "0"}, "max_model_len=0"),
        ({"decode_nice": "3"}, "decode_nice=3"),
        ({"response_threads": "0"}, "response_threads='0'"),
        ({"response_threads": "two"}, "response_threads='two'"),
        ({"data_parallel_size": "0"}, "data_parallel_size='0'"),
        ({"data_parallel_size": "x"}, "data_parallel_size='x'"),
        ({"data_parallel_size": "2", "stages": "local"}, "data_parallel_size='2'"),
    ],
)
def test_bad_parameter_error_names_parameter_and_value(params, fragment):
    with pytest.raises(ValueError) as e:
        parse_backend_config(params)
    assert fragment in str(e.value)
    assert str(e.value).startswith("parameter ")


def test_engine_processes_two_for_speculation_on_cpus_one_otherwise_or_as_set(monkeypatch):
    from lightspec_backend import params

    monkeypatch.setattr(params, "available_cpus", lambda: 2)
    mtp = parse_backend_config({"speculation": "mtp"})
    assert mtp.engine_processes() == 2 and mtp.engine.decode_nice == 0  # no engine thread ahead of the front end
    assert parse_backend_config({"speculation": "ngram"}).engine_processes() == 2
    none = parse_backend_config({"speculation": "none"})
    assert none.engine_processes() == 1 and none.engine.decode_nice == -10
    assert parse_backend_config({"speculation": "mtp", "data_parallel_size": "1"}).engine_processes() == 1
    assert parse_backend_config({"speculation": "none", "data_parallel_size": "3"}).engine_processes() == 3
    assert parse_backend_config({"speculation": "mtp", "data_parallel_size": "auto"}).engine_processes() == 2
    assert parse_backend_config({"speculation": "mtp", "device": "cuda"}).engine_processes() == 1
    assert parse_backend_config({"speculation": "mtp", "stages": "local"}).engine_processes() == 1
    monkeypatch.setattr(params, "available_cpus", lambda: 1)
    assert parse_backend_config({"speculation": "mtp"}).engine_processes() == 1


def test_response_threads_default_and_setting():
    assert parse_backend_config({}).response_threads == 4
    assert parse_backend_config({"response_threads": "1"}).response_threads == 1


def test_upper_case_keys_are_left_to_triton():
    parse_backend_config({"EXECUTION_ENV_PATH": "/env.tar.gz"})


@pytest.mark.parametrize(("value", "expected"), [("on", True), ("off", False), ("TRUE", True), ("0", False)])
def test_metrics_switch(value, expected):
    assert parse_backend_config({"metrics": value}).metrics is expected


def test_relative_checkpoint_paths_resolve_against_the_repository(tmp_path):
    cfg = parse_backend_config({"model_dir": "ckpt/target"}, base_dir=tmp_path)
    assert cfg.engine.model_dir == str((tmp_path / "ckpt" / "target").resolve())


def test_stage_models_can_be_renamed():
    cfg = parse_backend_config({"target_model": "big", "speculation": "draft", "draft_model": "small", **BLS})
    assert cfg.stage_models["target"] == "big" and cfg.stages_in_use() == ["target", "draft"]


@pytest.mark.parametrize(
    ("params", "stages"),
    [
        ({}, ["target"]),  # mtp: fused, the default
        ({"mtp": "lightspec_mtp"}, ["target", "mtp"]),
        ({"speculation": "none"}, ["target"]),
        ({"speculation": "ngram"}, ["target"]),
        ({"policy": "off"}, ["target"]),
        ({"speculation": "draft"}, ["target", "draft"]),
    ],
)
def test_stages_in_use_follow_the_speculation_method(params, stages):
    assert parse_backend_config({**params, **BLS}).stages_in_use() == stages
    assert parse_backend_config(params).stages_in_use() == []  # the default, stages: process


def test_flatten_parameters_reads_triton_json():
    assert flatten_parameters({"parameters": {"role": {"string_value": "mtp"}}}) == {"role": "mtp"}
    assert flatten_parameters({}) == {}


def test_generated_stage_configs_agree_with_the_orchestrator(tmp_path):
    repo = write_model_repository(tmp_path, {"num_kv_blocks": "32", "model_dir": "/m/target"})
    cfg = parse_backend_config(read_config_parameters(repo / "lightspec" / "config.pbtxt"), base_dir=repo)
    assert cfg.engine.num_kv_blocks == 32
    assert check_stage_configs(cfg, repo) == []


def test_kv_geometry_mismatch_with_a_stage_is_a_load_error(tmp_path):
    repo = write_model_repository(tmp_path, BLS)
    target_cfg = repo / "lightspec_target" / "config.pbtxt"
    target_cfg.write_text(
        target_cfg.read_text().replace(
            '"num_kv_blocks" value: { string_value: "1024"', '"num_kv_blocks" value: { string_value: "512"'
        )
    )
    cfg = parse_backend_config(read_config_parameters(repo / "lightspec" / "config.pbtxt"), base_dir=repo)
    with pytest.raises(ValueError, match=r"num_kv_blocks='1024': differs from stage model 'lightspec_target'"):
        check_stage_configs(cfg, repo)


def test_missing_stage_config_is_only_a_note(tmp_path):
    repo = write_model_repository(tmp_path, BLS)
    cfg = parse_backend_config({"target_model": "elsewhere", "mtp": "local", **BLS}, base_dir=repo)
    notes = check_stage_configs(cfg, repo)
    assert len(notes) == 1 and "elsewhere" in notes[0]


def test_stage_with_wrong_role_is_rejected(tmp_path):
    repo = write_model_repository(tmp_path, BLS)
    cfg = parse_backend_config({"mtp": "lightspec_draft", **BLS}, base_dir=repo)
    with pytest.raises(ValueError, match="mtp='lightspec_draft'"):
        check_stage_configs(cfg, repo)


def test_models_must_run_as_a_single_instance():
    check_single_instance({"instance_group": [{"count": 1, "kind": "KIND_CPU"}]})
    check_single_instance({})
    with pytest.raises(ValueError, match="instance_group: 2 instances"):
        check_single_instance({"instance_group": [{"count": 2, "kind": "KIND_CPU"}]})
    check_single_instance({"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [1]}]})
    # Triton makes count instances on every GPU listed, and lists every visible one where none was named
    with pytest.raises(ValueError, match="instance_group: 2 instances"):
        check_single_instance({"instance_group": [{"count": 1, "kind": "KIND_GPU", "gpus": [0, 1]}]})


@pytest.mark.parametrize("key, value, speculation", [("dtype", "bfloat16", "mtp"), ("max_model_len", "256", "mtp"),
                                                     ("speculation", "none", "draft")])  # fmt: skip
def test_a_stage_that_would_size_or_index_its_pool_differently_is_a_load_error(tmp_path, key, value, speculation):
    # with kv_cache_memory the blocks are bytes / block size: dtype and a draft pool change it
    repo = write_model_repository(tmp_path, {**BLS, "kv_cache_memory": "8MiB", "speculation": speculation})
    target_cfg = repo / "lightspec_target" / "config.pbtxt"
    # appended after the list, a key's second value is the one the parser keeps
    target_cfg.write_text(
        target_cfg.read_text() + f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    )
    cfg = parse_backend_config(read_config_parameters(repo / "lightspec" / "config.pbtxt"), base_dir=repo)
    with pytest.raises(ValueError, match=rf"{key}=.*differs from stage model 'lightspec_target'"):
        check_stage_configs(cfg, repo)


def test_missing_checkpoint_names_the_parameter(tmp_path, smoke_model):
    check_checkpoints(parse_backend_config({"model_dir": str(smoke_model / "target")}))
    check_checkpoints(parse_backend_config({"model_dir": str(smoke_model / "target"), "role": "mtp"}))
    with pytest.raises(ValueError, match=r"parameter model_dir='.*nowhere': no checkpoint"):
        check_checkpoints(parse_backend_config({"model_dir": str(tmp_path / "nowhere")}))
    with pytest.raises(ValueError, match=r"parameter mtp_dir='.*nowhere'"):
        check_checkpoints(
            parse_backend_config(
                {"model_dir": str(smoke_model / "target"), "role": "mtp", "mtp_dir": str(tmp_path / "nowhere")}
            )
        )
    with pytest.raises(ValueError, match=r"parameter draft_dir="):
        check_checkpoints(parse_backend_config({"model_dir": str(tmp_path / "t"), "role": "draft"}))


def test_local_mtp_runs_in_the_orchestrator_and_needs_no_stage_model():
    from lightspec_backend.repository import render_repository

    cfg = parse_backend_config({"mtp": "local", "speculation": "mtp", **BLS})
    assert cfg.stages_in_use() == ["target"] and cfg.local_stage("mtp")
    assert set(render_repository({"mtp": "local", **BLS})) == {
        "lightspec",
        "lightspec_target",
        "lightspec_draft",
        "lightspec_batched",
    }
    heads_stage = parse_backend_config({"speculation": "mtp", "mtp": "lightspec_mtp", **BLS})
    assert heads_stage.stages_in_use() == ["target", "mtp"]
    assert parse_backend_config({"speculation": "mtp", **BLS}).stages_in_use() == ["target"]  # fused: the default


def test_fused_mtp_loads_the_heads_into_the_target_stage(tmp_path, smoke_model):
    """``mtp: fused`` (the default): the engine gets fused drafts from the target stage (which loads
    the heads from the same ``mtp`` and ``speculation`` the generated repository gives it), no MTP
    stage model is needed, and a target stage without the heads is a load error naming ``mtp``."""
    from lightspec_backend.repository import render_repository

    cfg = parse_backend_config({"mtp": "fused", "speculation": "mtp", **BLS})
    assert cfg.engine.fused_mtp and cfg.fused and cfg.local_stage("mtp") and cfg.stages_in_use() == ["target"]
    assert not parse_backend_config({"mtp": "local"}).engine.fused_mtp
    assert set(render_repository({"mtp": "fused", **BLS})) == {
        "lightspec",
        "lightspec_target",
        "lightspec_draft",
        "lightspec_batched",
    }
    repo = write_model_repository(tmp_path / "fused", {"mtp": "fused", "model_dir": str(smoke_model / "target"), **BLS})
    target = parse_backend_config(read_config_parameters(repo / "lightspec_target" / "config.pbtxt"), base_dir=repo)
    assert target.loads_heads
    check_checkpoints(target)  # the smoke family has heads
    orch = parse_backend_config(read_config_parameters(repo / "lightspec" / "config.pbtxt"), base_dir=repo)
    assert check_stage_configs(orch, repo) == []
    plain = write_model_repository(tmp_path / "plain",
                                   {"model_dir": str(smoke_model / "target"), "mtp": "local", **BLS})  # fmt: skip
    with pytest.raises(ValueError, match=r"mtp='fused': stage model 'lightspec_target' does not load the MTP heads"):
        check_stage_configs(
            parse_backend_config({"mtp": "fused", "model_dir": str(smoke_model / "target"), **BLS}, base_dir=plain),
            plain,
        )
    assert not parse_backend_config({"role": "draft", "mtp": "fused"}).loads_heads  # only a target stage
    assert not parse_backend_config({"mtp": "fused", "speculation": "ngram"}).engine.fused_mtp
    with pytest.raises(ValueError, match=r"parameter mtp_dir='.*nowhere'"):
        check_checkpoints(
            parse_backend_config(
                {"role": "target", "model_dir": str(smoke_model / "target"), "mtp_dir": str(tmp_path / "nowhere")}
            )
        )


@pytest.mark.parametrize("old", ["mtp_model", "mtp_heads", "fused_mtp"])
def test_a_parameter_folded_into_mtp_fails_naming_its_replacement(old):
    with pytest.raises(ValueError, match=rf"parameter {old}='on': replaced by mtp \(fused, local or"):
        parse_backend_config({old: "on"})


def test_a_kv_budget_is_bytes_in_a_repository():
    assert parse_backend_config({"kv_cache_memory": "64MiB"}).engine.kv_cache_memory == "64MiB"
    with pytest.raises(ValueError, match=r"parameter kv_cache_memory='0.5': a fraction of free memory would differ"):
        parse_backend_config({"kv_cache_memory": "0.5"})


def test_stages_is_triton_local_or_process_and_only_triton_calls_stage_models():
    assert parse_backend_config({}).stages == "process"  # the default: one device serves the most tokens so
    assert parse_backend_config(BLS).stages_in_use() == ["target"]
    for stages in ("local", "process"):
        cfg = parse_backend_config({"stages": stages, "speculation": "draft"})
        assert cfg.stages == stages and cfg.stages_in_use() == []
    with pytest.raises(ValueError, match=r"parameter stages='bls': expected triton .*, local .* or process"):
        parse_backend_config({"stages": "bls"})


def test_an_engine_in_the_orchestrator_decodes_with_a_core_left_to_serving(monkeypatch):
    from lightspec_backend import params

    monkeypatch.setattr(params, "available_cpus", lambda: 4)
    for stages in ("local", "process"):
        assert parse_backend_config({"stages": stages}).engine.decode_threads == 3
        assert parse_backend_config({"stages": stages, "num_threads": "2"}).engine.decode_threads == 1
        assert parse_backend_config({"stages": stages, "decode_threads": "4"}).engine.decode_threads == 4
    monkeypatch.setattr(params, "available_cpus", lambda: 1)
    assert parse_backend_config({"stages": "process"}).engine.decode_threads == 1
    # stage models over BLS pick their threads per call themselves (stage_threads)
    assert parse_backend_config(BLS).engine.decode_threads == 0
    # the lone decoding thread runs ahead of the frontend's processes (LoneDecodePriority)
    assert parse_backend_config({"stages": "process"}).engine.decode_nice == -10
    assert parse_backend_config({"stages": "local", "decode_nice": "0"}).engine.decode_nice == 0
    assert parse_backend_config(BLS).engine.decode_nice == 0


def test_header_forward_pattern_is_a_regular_expression_reaching_both_front_models(tmp_path):
    assert parse_backend_config({"header_forward_pattern": "^x-tenant"}).header_forward_pattern == "^x-tenant"
    assert parse_backend_config({}).header_forward_pattern == ""
    with pytest.raises(ValueError, match=r"parameter header_forward_pattern='\(x': not a regular expression"):
        parse_backend_config({"header_forward_pattern": "(x"})
    repo = write_model_repository(tmp_path, {"header_forward_pattern": "^x-tenant"})
    for model in ("lightspec", "lightspec_batched"):
        cfg = parse_backend_config(read_config_parameters(repo / model / "config.pbtxt"), base_dir=repo)
        assert cfg.header_forward_pattern == "^x-tenant"
