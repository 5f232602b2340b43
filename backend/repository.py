"""Generate the model repository: the ``lightspec`` orchestrator, its stage models, and the
``lightspec_batched`` front for batched (TensorRT-LLM style, ``[1, 1]``) clients.

The checked-in ``model_repository/`` is ``write_model_repository(dir)`` with no overrides (a test
keeps them identical); tests and ``lightspec serve`` generate variants (another checkpoint, a smaller
KV pool) with ``overrides``. Shared keys (checkpoints, KV geometry, device, threads) are written to
the orchestrator *and* to the stages that use them, so the two cannot disagree by construction; the
orchestrator still checks at load time (:func:`lightspec_backend.params.check_stage_configs`) for
hand-edited repositories.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from lightspec_core.config import EngineConfig, resolve_dirs
from lightspec_core.stages.contract import ModelCall, ModelResult, MTPCall, MTPResult, ProfileCall, ProfileResult

from .params import (
    FUSED,
    LOCAL,
    STAGE_MODEL_PARAMS,
    STAGES_IN_ORCHESTRATOR,
    STAGES_PARAM,
    STAGES_PROCESS,
    STAGES_TRITON,
    Role,
    check_checkpoints,
    check_stage_configs,
    parse_backend_config,
    read_config_parameters,
)
from .tensors import INPUTS, OUTPUTS, TensorSpec

ORCHESTRATOR = "lightspec"
BATCHED_FRONT = "lightspec_batched"
BACKEND = "lightspec"

# Stage tensors: datatype and dims per field of the stage dataclasses (a test checks the names). Every
# input is optional to Triton: a stage answers calls of two kinds (a step, or a profile request), and
# checks itself that a call has every field of its kind.
STAGE_TENSORS: dict[type, list[TensorSpec]] = {
    ModelCall: [
        TensorSpec("input_ids", "INT64", (-1,)),
        TensorSpec("positions", "INT64", (-1,)),
        TensorSpec("query_lens", "INT32", (-1,)),
        TensorSpec("block_tables", "INT32", (-1, -1)),
        TensorSpec("sample_indices", "INT64", (-1,)),
        TensorSpec("return_logits", "BOOL", (-1,)),
        TensorSpec("return_hidden", "BOOL", (1,)),
        TensorSpec("mtp_drafts", "INT32", (-1,)),
        TensorSpec("mtp_conf", "BOOL", (1,)),
        TensorSpec("draft_chain", "INT32", (-1,)),
    ],
    ModelResult: [
        TensorSpec("top1_ids", "INT64", (-1,)),
        TensorSpec("logits", "FP32", (-1, -1)),
        TensorSpec("hidden", "FP32", (-1, -1)),
        TensorSpec("next_draft_ids", "INT64", (-1, -1)),
        TensorSpec("next_draft_conf", "FP32", (-1, -1)),
        TensorSpec("accepted", "INT32", (-1,)),
        TensorSpec("finite", "BOOL", (-1,)),
    ],
    MTPCall: [
        TensorSpec("hidden", "FP32", (-1, -1)),
        TensorSpec("last_ids", "INT64", (-1,)),
        TensorSpec("num_tokens", "INT32", (-1,)),
        TensorSpec("temperature", "FP32", (-1,)),
        TensorSpec("top_k", "INT32", (-1,)),
        TensorSpec("top_p", "FP32", (-1,)),
        TensorSpec("uniforms", "FP32", (-1, -1)),
        TensorSpec("return_probs", "BOOL", (1,)),
        TensorSpec("min_gain", "FP32", (-1,)),
        TensorSpec("calibration", "FP32", (-1, -1, -1)),
        TensorSpec("noise", "FP32", (-1, -1, -1)),
    ],
    ProfileCall: [TensorSpec("profile_spec", "STRING", (1,))],
    ProfileResult: [TensorSpec("profile", "STRING", (1,))],
    MTPResult: [
        TensorSpec("draft_ids", "INT64", (-1, -1)),
        TensorSpec("draft_probs", "FP32", (-1, -1, -1)),
        TensorSpec("draft_conf", "FP32", (-1, -1)),
    ],
}
STAGE_IO = {
    Role.TARGET: (ModelCall, ModelResult),
    Role.DRAFT: (ModelCall, ModelResult),
    Role.MTP: (MTPCall, MTPResult),
}
# Which parameters each stage reads; any of them in ``overrides`` is copied to that stage.
# What a stage computes its cost profile from while it loads (``ProfileSpec.for_engine``), so that it
# is the profile the orchestrator's engine asks for (the target stage also reads ``mtp`` and
# ``speculation``: with ``mtp: fused`` it loads the MTP heads).
PROFILE_PARAMS = (
    "speculation",
    "policy",
    "max_draft_tokens",
    "max_num_seqs",
    "max_num_batched_tokens",
    "mtp",
    "profile_stages",
    "max_model_len",
    "num_kv_blocks",
    "block_size",
    "kv_cache_memory",
)
STAGE_PARAMS = {
    # every stage sizes the KV pool, which with ``speculation: draft`` includes the draft model's
    Role.TARGET: ("model_dir", "mtp_dir", "draft_dir", "device", "num_threads", "dtype", *PROFILE_PARAMS),
    Role.DRAFT: ("model_dir", "draft_dir", "device", "num_threads", "dtype", *PROFILE_PARAMS),
    Role.MTP: ("model_dir", "mtp_dir", "draft_dir", "device", "num_threads", *PROFILE_PARAMS),
}
ORCHESTRATOR_PARAMS = (
    "speculation", "policy", "max_draft_tokens", "num_kv_blocks", "block_size", "max_num_seqs",
    "max_num_batched_tokens", "pipeline_depth", "metrics", "target_model", "mtp", "draft_model",
    "model_dir", "mtp_dir", "draft_dir", "num_threads", STAGES_PARAM,
)  # fmt: skip


def default_parameters() -> dict[str, str]:
    """The orchestrator's documented parameters with their default values, as strings."""
    cfg = EngineConfig()
    out = {"role": Role.ORCHESTRATOR.value}
    for key in ORCHESTRATOR_PARAMS:
        if key == "metrics":
            out[key] = "on"
        elif key == "num_threads":
            # With stages over BLS (stages: triton) the orchestrator's own torch work (MTP heads at
            # mtp: local, rejection sampling) is many small kernels: a second intra-op thread barely
            # speeds them up, and its spinning worker takes a core from the target stage's process.
            # Stages: one thread per CPU but one. orchestrator_parameters replaces it where the
            # orchestrator's engine runs its stages itself (local, process: the default).
            out[key] = "1"
        elif key == STAGES_PARAM:
            out[key] = STAGES_PROCESS
        elif key in ("target_model", "draft_model"):
            out[key] = next(d for p, d in STAGE_MODEL_PARAMS.values() if p == key)
        else:
            v = getattr(cfg, key)
            out[key] = "" if v is None else str(v)
    return out


def orchestrator_parameters(overrides: dict[str, str]) -> dict[str, str]:
    """An orchestrator's parameters: the defaults with ``overrides``. At ``stages: local`` or
    ``process`` (the default) the orchestrator's engine is the one that computes, so its
    ``num_threads`` defaults to torch's own (a thread per CPU) instead of 1."""
    out = {**default_parameters(), **overrides}
    if out[STAGES_PARAM] in STAGES_IN_ORCHESTRATOR and "num_threads" not in overrides:
        out["num_threads"] = "0"
    return out


def _tensor_block(kind: str, specs: list[TensorSpec], optional_allowed: bool) -> str:
    rows = []
    for s in specs:
        dims = ", ".join(str(d) for d in s.dims)
        opt = " optional: true" if optional_allowed and s.optional else ""
        rows.append(f'  {{ name: "{s.name}" data_type: TYPE_{s.triton_type} dims: [ {dims} ]{opt} }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def _quote(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"')


def _params_block(params: dict[str, str]) -> str:
    rows = [f'  {{ key: "{k}" value: {{ string_value: "{_quote(v)}" }} }}' for k, v in params.items()]
    return "parameters [\n" + ",\n".join(rows) + "\n]\n"


def _decoupled_model(comment: str, name: str, max_batch_size: int, params: dict[str, str]) -> str:
    """A decoupled model that declares the request tensors (the orchestrator, the batched front)."""
    return (
        f"# {comment}\n"
        f'name: "{name}"\nbackend: "{BACKEND}"\nmax_batch_size: {max_batch_size}\n'
        "model_transaction_policy { decoupled: true }\n"
        + _tensor_block("input", INPUTS, True)
        + _tensor_block("output", OUTPUTS, False)
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        + _params_block(params)
    )


def render_orchestrator(params: dict[str, str], name: str = ORCHESTRATOR) -> str:
    where = ("reaches the stage models by BLS" if params.get(STAGES_PARAM) == STAGES_TRITON
             else "runs its stages itself (stages: local or process)")  # fmt: skip
    comment = f"LightSpec orchestrator: owns the engine, {where}. See docs/serving.md."
    return _decoupled_model(comment, name, 0, params)


def render_front(name: str = BATCHED_FRONT, target: str = ORCHESTRATOR, forwarded_headers: str = "") -> str:
    """The batched front: the orchestrator's tensors with a batch dimension (``max_batch_size: 1``,
    no dynamic batching: each request is forwarded on its own); the server's header-forwarding
    pattern where the orchestrator has one."""
    comment = f"LightSpec batched front: [1, 1]-shaped (TensorRT-LLM style) requests, forwarded to {target}."
    params = {"role": Role.BATCHED.value, "orchestrator_model": target}
    if forwarded_headers:
        params["header_forward_pattern"] = forwarded_headers
    return _decoupled_model(comment, name, 1, params)


def stage_tensors(role: Role) -> dict[str, list[TensorSpec]]:
    """The inputs and outputs a stage model of ``role`` declares: its call's and result's fields."""
    call_cls, result_cls = STAGE_IO[role]
    return {"input": STAGE_TENSORS[call_cls] + STAGE_TENSORS[ProfileCall],
            "output": STAGE_TENSORS[result_cls] + STAGE_TENSORS[ProfileResult]}  # fmt: skip


def check_stage_tensors(role: Role, model_config: dict) -> None:
    """Fail a stage model's load when its config (Triton's JSON form) lacks a tensor of this version's
    contract: a repository written by an older LightSpec, whose every call would fail on the output
    the orchestrator asks for and the stage does not declare."""
    for kind, specs in stage_tensors(role).items():
        have = {t.get("name") for t in model_config.get(kind, [])}
        missing = [s.name for s in specs if s.name not in have]
        if missing:
            raise ValueError(
                f"config.pbtxt: the {role.value} stage declares no {kind} {', '.join(missing)}: the "
                "repository was written by an older LightSpec; write it again with `lightspec "
                "repository` (or let `lightspec serve` write it)"
            )


def render_stage(role: Role, name: str, params: dict[str, str]) -> str:
    call_cls, result_cls = STAGE_IO[role]
    tensors = stage_tensors(role)
    return (
        f"# LightSpec {role.value} stage: tensors are the fields of lightspec_core.stages."
        f"{call_cls.__name__} / {result_cls.__name__}.\n"
        f'name: "{name}"\nbackend: "{BACKEND}"\nmax_batch_size: 0\n'
        + _tensor_block("input", tensors["input"], True)
        + _tensor_block("output", tensors["output"], False)
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        + _params_block({"role": role.value, **params})
    )


def render_repository(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Model name -> config.pbtxt text, for the orchestrator, its stages and the batched front."""
    overrides = {k: str(v) for k, v in (overrides or {}).items()}
    orch = orchestrator_parameters(overrides)
    front = render_front(forwarded_headers=orch.get("header_forward_pattern", ""))
    out = {ORCHESTRATOR: render_orchestrator(orch), BATCHED_FRONT: front}
    for role, name in _stage_models(orch).items():
        # a stage's num_threads only from overrides: the orchestrator's default of 1 is its own
        shared = {k: v for k, v in orch.items() if k != "num_threads" or k in overrides}
        out[name] = render_stage(role, name, {k: shared[k] for k in STAGE_PARAMS[role] if k in shared})
    return out


def _stage_models(orch: dict[str, str]) -> dict[Role, str]:
    """The stage models a repository needs: the target stage; an MTP stage unless the heads run in
    the target stage (``fused``) or the orchestrator (``local``); a draft stage for draft-model
    speculation, or wherever the target has a draft model beside it (the embedded family does, so
    its repository can switch to ``speculation: draft``); a user's model without one gets none,
    which would fail its load."""
    if orch.get(STAGES_PARAM) in STAGES_IN_ORCHESTRATOR:
        return {}  # the orchestrator runs them itself
    names = {Role.TARGET: orch["target_model"]}
    if orch["mtp"] not in (LOCAL, FUSED):
        names[Role.MTP] = orch["mtp"]
    dirs = EngineConfig(model_dir=orch.get("model_dir") or None, draft_dir=orch.get("draft_dir") or None)
    draft = resolve_dirs(dirs)[2]
    if orch.get("speculation") == "draft" or (Path(draft) / "config.json").is_file():
        names[Role.DRAFT] = orch["draft_model"]
    return names


def write_model_repository(dst: str | Path, overrides: dict[str, str] | None = None) -> Path:
    """Write ``dst/<model>/config.pbtxt`` and ``dst/<model>/1/`` for every model; return ``dst``.

    Then remove the LightSpec models under ``dst`` that this render does not produce: an earlier
    write with other overrides may have left stage models there, which would fail validation with
    their old parameters or, if valid, make Triton load stages nobody calls. Only folders whose
    config.pbtxt names ``backend: "lightspec"`` are removed; other backends' models, and folders
    without a config.pbtxt, are a user's and stay."""
    dst = Path(dst)
    rendered = render_repository(overrides)
    for name, text in rendered.items():
        (dst / name / "1").mkdir(parents=True, exist_ok=True)
        (dst / name / "1" / ".gitkeep").touch()
        (dst / name / "config.pbtxt").write_text(text)
    for folder in sorted(dst.iterdir()):
        if folder.name not in rendered and _written_by_lightspec(folder):
            shutil.rmtree(folder)
    return dst


def backend_of(config_pbtxt: Path) -> str:
    """The ``backend`` a config.pbtxt names, parsed with Triton's own protobuf schema; a
    ``ValueError`` naming the file when it does not parse."""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(config_pbtxt.read_text(), model_config_pb2.ModelConfig()).backend
    except text_format.ParseError as e:
        raise ValueError(f"{config_pbtxt}: {e}") from None


def _written_by_lightspec(folder: Path) -> bool:
    """Whether ``folder`` is a real directory whose config.pbtxt names the LightSpec backend. A
    link, or a config that does not parse, is left to its owner."""
    config = folder / "config.pbtxt"
    if folder.is_symlink() or not folder.is_dir() or not config.is_file():
        return False
    try:
        return backend_of(config) == BACKEND
    except ValueError:
        return False


def server_args(repo: str | Path) -> list[str]:
    """tritonserver's arguments for what ``repo``'s orchestrator is configured with: header
    forwarding on both frontends for its ``header_forward_pattern`` (the server forwards the headers
    as request parameters; the orchestrator and the batched front leave them alone)."""
    path = Path(repo) / ORCHESTRATOR / "config.pbtxt"
    pattern = read_config_parameters(path).get("header_forward_pattern", "").strip() if path.is_file() else ""
    return [f"--grpc-header-forward-pattern={pattern}", f"--http-header-forward-pattern={pattern}"] if pattern else []


def validate_repository(repo: Path) -> list[str]:
    """Check every LightSpec model in ``repo`` as the backend does when Triton loads it: parameters,
    checkpoints, and the orchestrator's stage models. Raise ``ValueError`` naming the file, the
    parameter and the value; return notes about stage models that could not be checked.

    Every model's parameters are parsed before any checkpoint is looked at, so a bad value fails
    before anything heavier than the parser is imported."""
    if not repo.is_dir():
        raise ValueError(f"--model-repository {str(repo)!r}: not a directory")
    configs = {}
    for path in sorted(repo.glob("*/config.pbtxt")):
        if backend_of(path) == BACKEND:
            try:
                configs[path] = parse_backend_config(read_config_parameters(path), base_dir=repo)
            except ValueError as e:
                raise ValueError(f"{path}: {e}") from None
    notes = []
    for path, config in configs.items():
        try:
            check_checkpoints(config)
            if config.role is Role.ORCHESTRATOR:
                notes += check_stage_configs(config, repo)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
    return notes
