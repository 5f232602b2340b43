"""config.pbtxt ``parameters`` -> one validated :class:`BackendConfig`, parsed once at model load.

Every error is a ``ValueError`` naming the parameter and its value; ``model.py`` lets it escape
``initialize`` so Triton refuses to load the model and logs the message.

Any :class:`~lightspec_core.EngineConfig` field is also a parameter of the same name (string-valued,
as Triton requires; an empty string means "default"). The backend adds ``role``, ``metrics`` and the
target and draft stage model names; where the MTP heads run is the engine's ``mtp`` parameter
(``fused``, ``local`` or the MTP stage model's name).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

from lightspec_core.config import MTP_FUSED, MTP_LOCAL, EngineConfig, SpecMethod, parse_memory


class Role(str, Enum):
    ORCHESTRATOR = "orchestrator"  # decoupled; owns the engine, reaches the stages by BLS
    TARGET = "target"  # stage: the target LM and its KV pool
    DRAFT = "draft"  # stage: the draft LM and its KV pool
    MTP = "mtp"  # stage: MTP heads (no KV)
    BATCHED = "batched"  # max_batch_size 1 front for batched ([1, 1]) clients; forwards to the orchestrator


# Engine stage name -> (parameter naming the Triton model, default model name). The MTP stage's
# model is named by the engine's ``mtp`` parameter itself when it is neither fused nor local.
STAGE_MODEL_PARAMS = {
    "target": ("target_model", "lightspec_target"),
    "draft": ("draft_model", "lightspec_draft"),
}
MTP_STAGE_MODEL = "lightspec_mtp"  # the generated repository's MTP stage model (``mtp: lightspec_mtp``)
FRONT_TARGET_PARAM = ("orchestrator_model", "lightspec")  # the batched front's target model
BACKEND_PARAMS = ("role", "metrics", FRONT_TARGET_PARAM[0], *(p for p, _ in STAGE_MODEL_PARAMS.values()))
BACKEND_PARAMS += ("stage_timeout_s",)  # the orchestrator's deadline for one stage call (lightspec_backend.bls)
BACKEND_PARAMS += ("response_threads",)  # the orchestrator's threads sending responses (see BackendConfig)
BACKEND_PARAMS += ("data_parallel_size",)  # engine processes with ``stages: process`` (engine_processes)
BACKEND_PARAMS += ("header_forward_pattern",)  # tritonserver's header forwarding (BackendConfig)
# Where the orchestrator's engine runs its stages: ``triton``, the stage models reached by BLS (each
# replaceable by another engine, e.g. TensorRT on a GPU); ``local``, in the orchestrator's own
# process, as the library does: no BLS round trip and no tensor copies through the stub per step,
# for stages that share the orchestrator's device (docs/benchmarks.md); ``process``, as ``local`` but
# with the engine in a child process of the orchestrator's (vLLM's engine-core layout), so that
# sending responses does not hold the interpreter lock the engine's step needs. ``process`` is the
# default: on one device it serves the most tokens.
STAGES_PARAM, STAGES_TRITON, STAGES_LOCAL, STAGES_PROCESS = "stages", "triton", "local", "process"
STAGES_IN_ORCHESTRATOR = (STAGES_LOCAL, STAGES_PROCESS)  # no stage models: the orchestrator runs them
BACKEND_PARAMS += (STAGES_PARAM,)
ENGINE_PARAMS = tuple(f.name for f in dataclasses.fields(EngineConfig))
# Parameters that were folded into ``mtp``: a config that still sets them fails naming the new one.
REPLACED_PARAMS = {"mtp_model": "mtp", "mtp_heads": "mtp", "fused_mtp": "mtp"}
# The KV geometry every KV-owning stage must share with the orchestrator, which allocates blocks.
KV_PARAMS = ("num_kv_blocks", "block_size", "kv_cache_memory")
PATH_PARAMS = ("model_dir", "mtp_dir", "draft_dir")
_TRUE, _FALSE = ("on", "true", "1", "yes"), ("off", "false", "0", "no")
LOCAL, FUSED = MTP_LOCAL, MTP_FUSED


@dataclass
class BackendConfig:
    role: Role
    engine: EngineConfig
    metrics: bool
    stage_models: dict[str, str]  # engine stage name ("target", "mtp", "draft") -> Triton model name
    orchestrator_model: str = FRONT_TARGET_PARAM[1]  # role batched: the model it forwards to
    stage_timeout_s: float = 30.0  # a stage call unanswered this long fails its step UNAVAILABLE
    stages: str = STAGES_PROCESS  # ``local``/``process``: every stage with the orchestrator's engine
    response_threads: int = 4  # the orchestrator's sending threads (why several: responses.ResponseThreads)
    data_parallel_size: int = 0  # engine processes with ``stages: process``; 0: engine_processes decides
    # tritonserver's --grpc/--http-header-forward-pattern: it forwards the headers it matches as
    # request parameters, which are not sampling keys (conventions.drop_forwarded_headers)
    header_forward_pattern: str = ""

    def engine_processes(self) -> int:
        """How many engine processes serve with ``stages: process`` (lightspec_core.engine.shards):
        ``data_parallel_size`` if set; else two on a CPU of at least two cores for a speculative
        configuration, whose steps' compute one engine splits among threads that the front end's
        processes keep preempting (MTP ``dynamic`` at c=64 1.11-1.18x the tokens here,
        docs/benchmarks.md), and one otherwise: a decode-only step already runs on one thread, and
        a second engine there takes the core the front end needs (``none`` 0.91x at c=64)."""
        if self.stages != STAGES_PROCESS:
            return 1
        if self.data_parallel_size:
            return self.data_parallel_size
        on_cpu = self.engine.device == "cpu" and available_cpus() >= 2
        return 2 if on_cpu and self.engine.speculative else 1

    def stages_in_use(self) -> list[str]:
        """The stages the orchestrator's engine calls by BLS with this speculation method."""
        if self.stages in STAGES_IN_ORCHESTRATOR:
            return []
        method = self.engine.speculation
        remote = method in ("mtp", "draft") and self.engine.speculative and not self.local_stage(method)
        return ["target", *([method] if remote else [])]

    def local_stage(self, stage: str) -> bool:
        """``mtp: local`` runs the MTP heads inside the orchestrator's process; so does ``fused``
        for sampled requests, whose greedy requests get their drafts from the target stage."""
        return stage == "mtp" and self.engine.mtp in (LOCAL, FUSED)

    @property
    def fused(self) -> bool:
        return self.engine.mtp == FUSED

    @property
    def loads_heads(self) -> bool:
        """A target stage loads the MTP heads and proposes fused drafts with its results."""
        return self.role is Role.TARGET and self.engine.fused_mtp


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, e.g. a container's cpuset), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def flatten_parameters(model_config: dict) -> dict[str, str]:
    """Triton's ``{"key": {"string_value": "v"}}`` -> ``{"key": "v"}``."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


def _bad(name: str, value: str, why: str) -> ValueError:
    return ValueError(f"parameter {name}={value!r}: {why}")


def _convert(name: str, value: str, annotation: str):
    """Convert a string parameter to the type of the EngineConfig field it sets."""
    kinds = {t.strip() for t in str(annotation).split("|")}
    if "bool" in kinds:
        return parse_bool(name, value)
    try:
        if "int" in kinds:
            return int(value)
        if "float" in kinds:
            return float(value)
    except ValueError:
        raise _bad(name, value, f"expected {'an integer' if 'int' in kinds else 'a number'}") from None
    return value


def parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise _bad(name, value, "expected on or off")


def parse_backend_config(params: dict[str, str], base_dir: str | Path | None = None) -> BackendConfig:
    """Validate every parameter; unknown lower-case keys are rejected (they are almost always typos).
    Upper-case keys are left to Triton and the Python backend (``EXECUTION_ENV_PATH`` and friends).
    Relative checkpoint paths are resolved against ``base_dir`` (the model repository)."""
    for old, new in REPLACED_PARAMS.items():
        if old in params:
            raise _bad(old, params[old], f"replaced by {new} ({FUSED}, {LOCAL} or the MTP stage model's name)")
    unknown = sorted(k for k in params if k not in BACKEND_PARAMS + ENGINE_PARAMS and not k.isupper())
    if unknown:
        raise _bad(
            unknown[0], params[unknown[0]], f"unknown parameter; known: {', '.join(BACKEND_PARAMS + ENGINE_PARAMS)}"
        )
    role_value = params.get("role", "") or Role.ORCHESTRATOR.value
    try:
        role = Role(role_value)
    except ValueError:
        raise _bad("role", role_value, f"expected one of {', '.join(r.value for r in Role)}") from None
    engine = _engine_config(params, base_dir)
    metrics = parse_bool("metrics", params.get("metrics", "") or "on")
    stage_models = {
        stage: params.get(param, "").strip() or default for stage, (param, default) in STAGE_MODEL_PARAMS.items()
    }
    if engine.mtp not in (LOCAL, FUSED):
        stage_models["mtp"] = engine.mtp
    front_target = params.get(FRONT_TARGET_PARAM[0], "").strip() or FRONT_TARGET_PARAM[1]
    stage_timeout_s = _stage_timeout(params)
    stages = _stages(params)
    response_threads = _positive_int(params, "response_threads", BackendConfig.response_threads, 64)
    if stages in STAGES_IN_ORCHESTRATOR and not params.get("decode_threads", "").strip():
        engine = dataclasses.replace(
            engine, decode_threads=serving_decode_threads(engine.num_threads, available_cpus())
        )
    data_parallel = _data_parallel_size(params, stages)
    shards = BackendConfig(
        role, engine, metrics, stage_models, stages=stages, data_parallel_size=data_parallel
    ).engine_processes()
    if stages in STAGES_IN_ORCHESTRATOR and shards == 1 and not params.get("decode_nice", "").strip():
        # the lone decoding thread ahead of the frontend's processes (stages.executor.LoneDecodePriority);
        # not with several engines, whose threads together would hold every core ahead of them
        engine = dataclasses.replace(engine, decode_nice=SERVING_DECODE_NICE)
    return BackendConfig(role=role, engine=engine, metrics=metrics, stage_models=stage_models,
                         orchestrator_model=front_target, stage_timeout_s=stage_timeout_s,
                         stages=stages, response_threads=response_threads, data_parallel_size=data_parallel,
                         header_forward_pattern=_pattern(params, "header_forward_pattern"))  # fmt: skip


def _engine_config(params: dict[str, str], base_dir: str | Path | None) -> EngineConfig:
    """The engine's fields among ``params``, checkpoint paths resolved against ``base_dir``."""
    kwargs = {}
    for f in dataclasses.fields(EngineConfig):
        raw = params.get(f.name, "").strip()
        if raw and f.name in PATH_PARAMS and base_dir is not None:
            raw = str((Path(base_dir) / Path(raw).expanduser()).resolve())
        if raw:
            kwargs[f.name] = _convert(f.name, raw, f.type)
    try:
        engine = EngineConfig(**kwargs)
    except ValueError as e:  # EngineConfig names the field: "speculation='x': expected ..."
        raise ValueError(f"parameter {e}") from None
    if engine.kv_cache_memory and parse_memory(engine.kv_cache_memory)[1] is not None:
        raise _bad(
            "kv_cache_memory",
            engine.kv_cache_memory,
            "a fraction of free memory would differ in each of "
            "the server's processes; give bytes (e.g. 2GiB) so that every stage sizes the same pool",
        )
    return engine


def _stage_timeout(params: dict[str, str]) -> float:
    timeout = params.get("stage_timeout_s", "").strip() or "30"
    try:
        stage_timeout_s = float(timeout)
    except ValueError:
        stage_timeout_s = -1.0
    if not 0 < stage_timeout_s < 1e6:
        raise _bad("stage_timeout_s", timeout, "expected a positive number of seconds")
    return stage_timeout_s


SERVING_DECODE_NICE = -10


def serving_decode_threads(num_threads: int, cpus: int) -> int:
    """An engine in the orchestrator's process or its child (``stages: local`` or ``process``)
    decodes with one thread per CPU but one (``EngineConfig.decode_threads``), as vLLM's CPU backend
    keeps a core for its front end: Triton's frontend, the stub's responses and a local client share
    the cores, and in a decode-only step a second OpenMP worker gains the step less than it takes
    from them (without speculation 1.04-1.15x the tokens at c=64 in six paired rounds here,
    docs/benchmarks.md). Calls with drafts or prompt chunks keep ``num_threads``: they are
    compute, and more threads pay."""
    return max(1, (num_threads or cpus) - 1)


def _pattern(params: dict[str, str], name: str) -> str:
    raw = params.get(name, "").strip()
    try:
        re.compile(raw)
    except re.error as e:
        raise _bad(name, raw, f"not a regular expression ({e})") from None
    return raw


def _positive_int(params: dict[str, str], name: str, default: int, most: int) -> int:
    raw = params.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        raise _bad(name, raw, f"expected an integer from 1 to {most}")
    return value


def _data_parallel_size(params: dict[str, str], stages: str) -> int:
    """0 (auto: ``BackendConfig.engine_processes`` decides) or the engine processes asked for."""
    raw = params.get("data_parallel_size", "").strip()
    if raw in ("", "auto"):
        return 0
    value = _positive_int(params, "data_parallel_size", 1, 64)
    if value > 1 and stages != STAGES_PROCESS:
        raise _bad("data_parallel_size", raw, f"several engine processes need stages {STAGES_PROCESS}")
    return value


def _stages(params: dict[str, str]) -> str:
    value = params.get(STAGES_PARAM, "").strip() or STAGES_PROCESS
    if value not in (STAGES_TRITON, *STAGES_IN_ORCHESTRATOR):
        raise _bad(
            STAGES_PARAM,
            value,
            f"expected {STAGES_TRITON} (stage models over BLS), {STAGES_LOCAL} "
            f"(in the orchestrator's process) or {STAGES_PROCESS} (in a child process of it)",
        )
    return value


def check_checkpoints(config: BackendConfig) -> None:
    """Fail early, naming the parameter, when a checkpoint this role needs is not there."""
    from lightspec_core.config import resolve_dirs

    target, mtp, draft = resolve_dirs(config.engine)
    role = config.role
    needed = {
        Role.ORCHESTRATOR: [("model_dir", target, "config.json")],
        Role.TARGET: [
            ("model_dir", target, "config.json"),
            *([("mtp_dir", mtp, "mtp_config.json")] if config.loads_heads else []),
        ],
        Role.MTP: [("model_dir", target, "config.json"), ("mtp_dir", mtp, "mtp_config.json")],
        Role.DRAFT: [("draft_dir", draft, "config.json")],
        Role.BATCHED: [],  # loads no model: it forwards to the orchestrator
    }[role]
    for param, path, marker in needed:
        if not (Path(path) / marker).is_file():
            value = getattr(config.engine, param) or ""
            hint = (
                " (empty: the embedded default model; train it with python tools/train_default.py)" if not value else ""
            )
            raise _bad(param, value, f"no checkpoint at {path}: {marker} missing{hint}")


def check_single_instance(model_config: dict) -> None:
    """Every LightSpec model must run as exactly one instance: the orchestrator's engine allocates
    KV blocks for one pool per KV stage, and a second instance of either would own blocks (or a
    pool) the other does not know about. A GPU group's ``count`` is per GPU it lists, and the
    configuration a model receives lists every visible GPU where the file named none."""
    total = 0
    for group in model_config.get("instance_group", []):
        gpus = group.get("gpus") or []
        on_gpus = group.get("kind", "KIND_AUTO") != "KIND_CPU" and len(gpus) > 0
        total += int(group.get("count", 1)) * (len(gpus) if on_gpus else 1)
    if total > 1:
        raise ValueError(
            f"instance_group: {total} instances: LightSpec models need exactly one instance "
            "(one engine owns the stages' KV pools; a KIND_GPU group needs gpus: [N], one GPU)"
        )


def read_config_parameters(config_pbtxt: str | Path) -> dict[str, str]:
    """The ``parameters`` of a config.pbtxt file, parsed with Triton's own protobuf schema."""
    from google.protobuf import json_format, text_format
    from tritonclient.grpc import model_config_pb2

    cfg = text_format.Parse(Path(config_pbtxt).read_text(), model_config_pb2.ModelConfig())
    return flatten_parameters(json_format.MessageToDict(cfg, preserving_proto_field_name=True))


def check_stage_configs(config: BackendConfig, repository: str | Path) -> list[str]:
    """Check that the stage models next to the orchestrator in a local model repository share its KV
    geometry and checkpoints; raise ``ValueError`` on a mismatch.

    The orchestrator allocates KV blocks and the target/draft stages own the pools those block ids
    index, so ``num_kv_blocks`` and ``block_size`` must agree or the stages write out of bounds (or
    waste memory). Triton gives a model no way to read another model's config over BLS, so this reads
    the files. Returns notes for stages it could not check (remote repository, renamed model).
    """
    notes = []
    mine = config.engine
    for stage in config.stages_in_use():
        name = config.stage_models[stage]
        path = Path(repository) / name / "config.pbtxt"
        if not path.is_file():
            notes.append(f"stage model {name!r}: {path} not found, KV geometry not checked")
            continue
        theirs = parse_backend_config(read_config_parameters(path), base_dir=repository)
        param = STAGE_MODEL_PARAMS[stage][0] if stage in STAGE_MODEL_PARAMS else "mtp"
        if theirs.role.value != stage:
            raise _bad(param, name, f"that model has role={theirs.role.value!r}, expected {stage!r}")
        fused = stage == "target" and mine.fused_mtp
        if fused and not theirs.loads_heads:
            raise _bad(
                "mtp",
                FUSED,
                f"stage model {name!r} does not load the MTP heads "
                f"(it needs speculation: mtp and mtp: {FUSED} in {path})",
            )
        keys = [
            "model_dir",
            *(["mtp_dir"] if stage == "mtp" or fused else []),
            *(["draft_dir"] if stage == "draft" else []),
        ]
        # what sizes and indexes the pools: with kv_cache_memory the block count follows the bytes
        # a block takes (dtype) and the rope table the context (max_model_len)
        keys += [*KV_PARAMS, "dtype", "max_model_len"] if stage != "mtp" else []
        for key in keys:
            a, b = getattr(mine, key), getattr(theirs.engine, key)
            if a != b:
                raise _bad(key, "" if a is None else str(a), f"differs from stage model {name!r} ({b!r} in {path})")
        # kv_cache_memory's bytes hold a draft model's pool beside the target's with speculation: draft;
        # otherwise orchestrators of other methods share a stage (the bench's repository does)
        drafts = (mine.method is SpecMethod.DRAFT, theirs.engine.method is SpecMethod.DRAFT)
        if stage != "mtp" and mine.kv_cache_memory and drafts[0] != drafts[1]:
            raise _bad(
                "speculation",
                mine.speculation,
                f"differs from stage model {name!r} "
                f"({theirs.engine.speculation!r} in {path}), which sizes the pool from kv_cache_memory "
                f"{'with' if drafts[1] else 'without'} a draft model's pool",
            )
    return notes
