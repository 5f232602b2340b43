"""``lightspec_backend.bench.configs``: run configurations and the repository that serves them."""

from __future__ import annotations

import pytest
from lightspec_backend.bench.configs import RunConfig, parse_configs, stages_for, write_bench_repository
from lightspec_backend.params import check_stage_configs, parse_backend_config, read_config_parameters


def test_configs_cross_methods_and_run_the_none_baseline_once():
    runs = parse_configs(["none", "static:2", "dynamic@2"], ["mtp", "ngram"])
    assert [(c.config, c.method, c.model_name) for c in runs] == [
        ("none", "none", "lightspec_none"),
        ("static:2", "mtp", "lightspec_mtp_static_2"),
        ("static:2", "ngram", "lightspec_ngram_static_2"),
        ("dynamic@2", "mtp", "lightspec_mtp_dynamic_d2"),
        ("dynamic@2", "ngram", "lightspec_ngram_dynamic_d2"),
    ]
    assert runs[3].pipeline_depth == 2
    assert stages_for(runs) == []  # default: stages: process, the engine runs its stages itself
    bls = {"stages": "triton"}
    assert stages_for(runs, bls) == ["lightspec_target"]  # MTP heads in the target stage
    assert stages_for(runs, {"mtp": "lightspec_mtp", **bls}) == ["lightspec_target", "lightspec_mtp"]
    assert stages_for(parse_configs(["dynamic"], ["draft", "ngram"]), bls) == ["lightspec_target", "lightspec_draft"]
    assert RunConfig("static:8", "mtp", "static:8").parameters(4)["max_draft_tokens"] == "8"
    stop = parse_configs(["dynamic", "dynamic+stop"], ["mtp"])
    assert [c.model_name for c in stop] == ["lightspec_mtp_dynamic", "lightspec_mtp_dynamic_stop"]
    assert "confidence_stop" not in stop[0].parameters(4) and stop[1].parameters(4)["confidence_stop"] == "on"
    where = parse_configs(["static:4+local", "static:4+fused", "dynamic+stop+fused"], ["mtp"])
    assert [c.model_name for c in where] == ["lightspec_mtp_static_4_local", "lightspec_mtp_static_4_fused",
                                             "lightspec_mtp_dynamic_stop_fused"]  # fmt: skip
    assert [c.parameters(4)["mtp"] for c in where] == ["local", "fused", "fused"]
    assert where[2].confidence_stop
    assert stages_for(where, {"mtp": "lightspec_mtp", **bls}) == ["lightspec_target"]


@pytest.mark.parametrize("bad", [["eagle"], ["static:x"], ["dynamic@3"], ["none", "off"], ["static:2+stop"],
                                 ["dynamic+remote"], ["dynamic+fused+stop"], ["dynamic:latency"]])  # fmt: skip
def test_bad_configs_are_refused_with_the_spec_named(bad):
    with pytest.raises(SystemExit, match="--configs"):
        parse_configs(bad, ["mtp"])
    with pytest.raises(SystemExit, match="--methods"):
        parse_configs(["dynamic"], ["eagle"])


def _backend_config(repo, c: RunConfig):
    return parse_backend_config(read_config_parameters(repo / c.model_name / "config.pbtxt"), base_dir=repo)


def _target_loads_heads(repo) -> bool:
    params = read_config_parameters(repo / "lightspec_target" / "config.pbtxt")
    return parse_backend_config(params, base_dir=repo).engine.fused_mtp


def test_repository_has_one_orchestrator_per_config_sharing_the_stage_models(tmp_path):
    configs = parse_configs(["none", "static:2", "dynamic", "dynamic+stop"], ["mtp", "draft"])
    bls = {"stages": "triton"}  # the stage models shared by the sweep's orchestrators
    repo = write_bench_repository(tmp_path / "repo", configs, {"num_kv_blocks": "96", "model_dir": "/m/t", **bls}, 4)
    for c in configs:
        cfg = _backend_config(repo, c)
        assert (cfg.engine.speculation, cfg.engine.policy) == (c.method, c.policy)
        assert cfg.engine.confidence_stop == c.confidence_stop
        assert cfg.engine.num_kv_blocks == 96
        assert check_stage_configs(cfg, repo) == []  # same KV geometry and checkpoints as the stages
    target = read_config_parameters(repo / "lightspec_target" / "config.pbtxt")
    assert target["num_kv_blocks"] == "96"
    assert _target_loads_heads(repo)  # the default: mtp fused, the target stage proposes drafts
    assert all(_backend_config(repo, c).engine.fused_mtp == (c.method == "mtp") for c in configs)
    local = write_bench_repository(tmp_path / "local", configs[:1], {"mtp": "local", **bls}, 4)
    # by default (stages: process) every orchestrator runs its own stages: no stage model, draft included
    default = write_bench_repository(tmp_path / "default", configs, {"model_dir": "/m/t"}, 4)
    assert not (default / "lightspec_target").exists() and not (default / "lightspec_draft").exists()
    assert not _target_loads_heads(local)
    # a fused configuration: the shared target stage loads the heads, the others keep theirs
    configs = parse_configs(["static:4+local", "static:4+fused"], ["mtp"])
    repo = write_bench_repository(tmp_path / "fused", configs, {"mtp": "local", **bls}, 4)
    assert _target_loads_heads(repo)
    for c, fused in zip(configs, (False, True)):
        cfg = _backend_config(repo, c)
        assert cfg.engine.fused_mtp == fused and check_stage_configs(cfg, repo) == []


def test_local_stages_load_no_stage_model_and_each_orchestrator_computes_on_every_cpu(tmp_path):
    runs = parse_configs(["none", "dynamic"], ["mtp", "draft"])
    assert stages_for(runs, {"stages": "local"}) == []
    repo = write_bench_repository(tmp_path / "repo", runs, {"stages": "local"}, 4)
    assert not (repo / "lightspec_target").exists() and not (repo / "lightspec_draft").exists()
    for run in runs:
        text = (repo / run.model_name / "config.pbtxt").read_text()
        assert '{ key: "stages" value: { string_value: "local" } }' in text
        assert '{ key: "num_threads" value: { string_value: "0" } }' in text
