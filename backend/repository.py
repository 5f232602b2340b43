"""Generate the model repository: the ``lightspec`` orchestrator and its three stage models.

The checked-in ``model_repository/`` is ``write_model_repository(dir)`` with no overrides (a test
keeps them identical); tests and ``lightspec serve`` generate variants (another checkpoint, a smaller
KV pool) with ``overrides``. Shared keys (checkpoints, KV geometry, device, threads) are written to
the orchestrator *and* to the stages that use them, so the two cannot disagree by construction; the
orchestrator still checks at load time (:func:`lightspec_backend.params.check_stage_configs`) for
hand-edited repositories.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from lightspec_core.config import EngineConfig
from lightspec_core.stages.contract import ModelCall, ModelResult, MTPCall, MTPResult

from .params import FUSED, LOCAL, STAGE_MODEL_PARAMS, Role
from .tensors import INPUTS, OUTPUTS, TensorSpec

ORCHESTRATOR = "lightspec"
BACKEND = "lightspec"

# Stage tensors: datatype and dims per field of the stage dataclasses (a test checks the names).
STAGE_TENSORS: dict[type, list[TensorSpec]] = {
    ModelCall: [
        TensorSpec("input_ids", "INT64", (-1,), optional=False),
        TensorSpec("positions", "INT64", (-1,), optional=False),
        TensorSpec("query_lens", "INT32", (-1,), optional=False),
        TensorSpec("block_tables", "INT32", (-1, -1), optional=False),
        TensorSpec("sample_indices", "INT64", (-1,), optional=False),
        TensorSpec("return_logits", "BOOL", (-1,), optional=False),
        TensorSpec("return_hidden", "BOOL", (1,), optional=False),
        TensorSpec("mtp_drafts", "INT32", (-1,)),
        TensorSpec("mtp_conf", "BOOL", (1,)),
    ],
    ModelResult: [
        TensorSpec("top1_ids", "INT64", (-1,)),
        TensorSpec("logits", "FP32", (-1, -1)),
        TensorSpec("hidden", "FP32", (-1, -1)),
        TensorSpec("next_draft_ids", "INT64", (-1, -1)),
        TensorSpec("next_draft_conf", "FP32", (-1, -1)),
        TensorSpec("accepted", "INT32", (-1,)),
    ],
    MTPCall: [
        TensorSpec("hidden", "FP32", (-1, -1), optional=False),
        TensorSpec("last_ids", "INT64", (-1,), optional=False),
        TensorSpec("num_tokens", "INT32", (-1,), optional=False),
        TensorSpec("temperature", "FP32", (-1,), optional=False),
        TensorSpec("top_k", "INT32", (-1,), optional=False),
        TensorSpec("top_p", "FP32", (-1,), optional=False),
        TensorSpec("uniforms", "FP32", (-1, -1), optional=False),
        TensorSpec("return_probs", "BOOL", (1,), optional=False),
        TensorSpec("min_gain", "FP32", (-1,), optional=False),
        TensorSpec("calibration", "FP32", (-1, -1, -1), optional=False),
    ],
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
STAGE_PARAMS = {
    Role.TARGET: ("model_dir", "num_kv_blocks", "block_size", "device", "num_threads"),
    Role.DRAFT: ("model_dir", "draft_dir", "num_kv_blocks", "block_size", "device", "num_threads"),
    Role.MTP: ("model_dir", "mtp_dir", "device", "num_threads"),
}
ORCHESTRATOR_PARAMS = (
    "speculation", "policy", "max_draft_tokens", "num_kv_blocks", "block_size", "max_num_seqs",
    "max_num_batched_tokens", "pipeline_depth", "metrics", "target_model", "mtp_model", "draft_model",
    "model_dir", "mtp_dir", "draft_dir", "num_threads",
)  # fmt: skip


def default_parameters() -> dict[str, str]:
    """The orchestrator's documented parameters with their default values, as strings."""
    cfg = EngineConfig()
    out = {"role": Role.ORCHESTRATOR.value}
    for key in ORCHESTRATOR_PARAMS:
        if key == "metrics":
            out[key] = "on"
        elif key == "mtp_model":
            # MTP heads in the target stage (fused): a step is one BLS call, and the heads run right
            # after the target's forward. Since a lone request's heads run in numpy it beats heads in
            # the orchestrator (local) in 13 of 16 side-by-side rounds at c=1-64, by 6-8 % on average
            # (README, Benchmarks); local beats a separate stage process.
            # --set mtp_model=local|lightspec_mtp
            out[key] = FUSED
        elif key == "num_threads":
            # The orchestrator's own torch work (MTP heads at mtp_model=local, rejection sampling) is
            # many small kernels: a second intra-op thread barely speeds them up, and its spinning
            # worker takes a core from the target stage's process. Stages: one thread per CPU but one.
            out[key] = "1"
        elif key in ("target_model", "draft_model"):
            out[key] = next(d for p, d in STAGE_MODEL_PARAMS.values() if p == key)
        else:
            v = getattr(cfg, key)
            out[key] = "" if v is None else str(v)
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


def render_orchestrator(params: dict[str, str], name: str = ORCHESTRATOR) -> str:
    return (
        f"# LightSpec orchestrator: owns the engine, reaches the stage models by BLS. See docs/README_triton.md.\n"
        f'name: "{name}"\nbackend: "{BACKEND}"\nmax_batch_size: 0\n'
        "model_transaction_policy { decoupled: true }\n"
        + _tensor_block("input", INPUTS, True)
        + _tensor_block("output", OUTPUTS, False)
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        + _params_block(params)
    )


def render_stage(role: Role, name: str, params: dict[str, str]) -> str:
    call_cls, result_cls = STAGE_IO[role]
    return (
        f"# LightSpec {role.value} stage: tensors are the fields of lightspec_core.stages."
        f"{call_cls.__name__} / {result_cls.__name__}.\n"
        f'name: "{name}"\nbackend: "{BACKEND}"\nmax_batch_size: 0\n'
        + _tensor_block("input", STAGE_TENSORS[call_cls], True)
        + _tensor_block("output", STAGE_TENSORS[result_cls], False)
        + "instance_group [ { count: 1 kind: KIND_CPU } ]\n"
        + _params_block({"role": role.value, **params})
    )


def render_repository(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Model name -> config.pbtxt text, for the orchestrator and all three stages."""
    overrides = {k: str(v) for k, v in (overrides or {}).items()}
    orch = {**default_parameters(), **overrides}
    out = {ORCHESTRATOR: render_orchestrator(orch)}
    for role in (Role.TARGET, Role.MTP, Role.DRAFT):
        param, _ = STAGE_MODEL_PARAMS[role.value]
        if orch[param] in (LOCAL, FUSED):  # run inside the orchestrator (or the target stage): no stage model
            continue
        # a stage's num_threads only from overrides: the orchestrator's default of 1 is its own
        shared = {k: v for k, v in orch.items() if k != "num_threads" or k in overrides}
        stage_params = {k: shared[k] for k in STAGE_PARAMS[role] if k in shared}
        if role is Role.TARGET and orch["mtp_model"] == FUSED:  # the target stage proposes MTP drafts too
            stage_params.update(mtp_heads="on", mtp_dir=orch.get("mtp_dir", ""))
        out[orch[param]] = render_stage(role, orch[param], stage_params)
    return out


def write_model_repository(dst: str | Path, overrides: dict[str, str] | None = None) -> Path:
    """Write ``dst/<model>/config.pbtxt`` and ``dst/<model>/1/`` for every model; return ``dst``."""
    dst = Path(dst)
    for name, text in render_repository(overrides).items():
        (dst / name / "1").mkdir(parents=True, exist_ok=True)
        (dst / name / "1" / ".gitkeep").touch()
        (dst / name / "config.pbtxt").write_text(text)
    return dst


def stage_field_names() -> dict[str, tuple[list[str], list[str]]]:
    """For tests: (table names, dataclass field names) per stage dataclass."""
    return {c.__name__: ([s.name for s in specs], [f.name for f in fields(c)]) for c, specs in STAGE_TENSORS.items()}
