"""LightSpec's Triton Python-based backend, installed as ``<backend-directory>/lightspec/model.py``.

One file, five roles chosen by the config.pbtxt parameter ``role``:

- ``orchestrator`` (decoupled, max_batch_size 0): owns a ``lightspec_core.LLMEngine``, which runs its
  stages in a child process (``stages: process``, the default) or in this one (``local``), or
  reaches the models below by BLS (``triton``); see :mod:`lightspec_backend.orchestrator`;
- ``target`` / ``draft``: a :class:`~lightspec_core.stages.ModelRunner` (weights + paged KV pool);
- ``mtp``: a :class:`~lightspec_core.stages.MTPRunner` (MTP heads);
- ``batched`` (decoupled, max_batch_size 1): forwards ``[1, 1]``-shaped requests to the
  orchestrator; see :mod:`lightspec_backend.front`.

This file is only the adapter between Triton and those pieces: parameters are parsed once into an
``EngineConfig`` (a bad one raises here and Triton refuses to load the model), and everything else
lives in the importable, Triton-free ``lightspec_backend`` package.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import triton_python_backend_utils as pb_utils
from lightspec_backend.params import (
    Role,
    check_checkpoints,
    check_single_instance,
    check_stage_configs,
    flatten_parameters,
    parse_backend_config,
)
from lightspec_backend.repository import check_stage_tensors


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        model_config = json.loads(args["model_config"])
        repository = Path(args["model_repository"]).parent
        check_single_instance(model_config)
        self.config = parse_backend_config(flatten_parameters(model_config), base_dir=repository)
        check_checkpoints(self.config)
        self.name = args["model_name"]
        if self.config.role is Role.ORCHESTRATOR:
            self.impl = _orchestrator(args, model_config, self.config, repository)
        elif self.config.role is Role.BATCHED:
            self.impl = _front(model_config, self.config)
        else:
            check_stage_tensors(self.config.role, model_config)
            self.impl = _stage(args, self.config)
        pb_utils.Logger.log_info(f"[lightspec] {self.name}: role={self.config.role.value} ready (python {sys.prefix})")

    def execute(self, requests: list):
        return self.impl.execute(requests)

    def finalize(self) -> None:
        self.impl.finalize()


class _OrchestratorModel:
    def __init__(self, orchestrator, engine, reporter):
        self.orchestrator = orchestrator
        self.engine = engine
        self.reporter = reporter

    def execute(self, requests: list) -> None:
        for request in requests:
            self.orchestrator.submit(request)
        # decoupled: responses go through each request's response sender

    def finalize(self) -> None:
        self.orchestrator.shutdown()
        self.engine.close()
        if self.reporter is not None:
            self.reporter.close()


def _orchestrator(args: dict, model_config: dict, config, repository: Path) -> _OrchestratorModel:
    from lightspec_backend.control import ControlDir, restarts_from_env
    from lightspec_backend.metrics import MetricsReporter
    from lightspec_backend.orchestrator import Orchestrator
    from lightspec_backend.params import STAGES_LOCAL, STAGES_PROCESS

    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise ValueError("model_transaction_policy: the orchestrator must be decoupled (decoupled: true)")
    for note in check_stage_configs(config, repository):
        pb_utils.Logger.log_warn(f"[lightspec] {note}")
    control = ControlDir.from_env()
    if config.stages == STAGES_LOCAL:
        engine = _local_engine(config)
    elif config.stages == STAGES_PROCESS:
        engine = _process_engine(config, control)
    else:
        engine = _bls_engine(config, control)
    reporter = None
    if config.metrics:
        try:
            # vLLM's labels, so that dashboards written for vLLM select LightSpec's metrics unchanged
            reporter = MetricsReporter(
                pb_utils, {"model_name": args["model_name"], "engine": "0"}, max_model_len=engine.max_model_len
            )
            reporter.publish(engine.stats.snapshot(), [])  # fails here if the server has metrics off
        except pb_utils.TritonModelException as e:
            pb_utils.Logger.log_warn(f"[lightspec] custom metrics unavailable ({e}); continuing without them")
            reporter = None
    gc.collect()
    gc.freeze()  # what the model loaded (modules, tokenizer, engine): never scanned by a collection again
    orchestrator = Orchestrator(
        engine,
        pb_utils,
        reporter,
        control=control,
        restarts=restarts_from_env(),
        response_threads=config.response_threads,
        forwarded_headers=config.header_forward_pattern,
    )
    return _OrchestratorModel(orchestrator, engine, reporter)


def _local_engine(config):
    """``stages: local``: the engine with its stages in this process, as in the library; the stage
    profile is taken here, while the model loads."""
    from lightspec_core import LLMEngine
    from lightspec_core.stages.memory import keep_freed_memory

    keep_freed_memory()  # as in a stage process: a step's large temporaries reuse freed memory
    engine = LLMEngine(config.engine)
    pb_utils.Logger.log_info(f"[lightspec] stages in this process: {', '.join(engine.executor.runners)}")
    return engine


def _process_engine(config, control):
    """``stages: process``: the engine and its stages in a child process of this one (or in several,
    ``data_parallel_size``), which only parses requests and sends responses; a child that dies is
    reported to the supervisor."""
    from lightspec_core.engine.process import EngineProcess

    def on_exit(message: str) -> None:
        pb_utils.Logger.log_error(f"[lightspec] {message}")
        if control is not None:  # lightspec serve's supervisor restarts the server
            control.report_fault("engine", message)

    n = config.engine_processes()
    if n == 1:
        engine = EngineProcess(config.engine, on_exit=on_exit, stall_timeout_s=config.stage_timeout_s)
        pb_utils.Logger.log_info(f"[lightspec] engine and stages in process {engine.pid}")
        return engine
    from lightspec_backend.params import available_cpus

    from lightspec_core.engine.shards import EngineShards

    threads = config.engine.num_threads or available_cpus()
    engine = EngineShards(config.engine, n, threads, on_exit=on_exit, stall_timeout_s=config.stage_timeout_s)
    pb_utils.Logger.log_info(f"[lightspec] {n} engine processes (data_parallel_size): {engine.pids}")
    return engine


def _bls_engine(config, control):
    """The engine with its stages reached over BLS (the heads at ``mtp: fused``/``local`` in this
    process)."""
    from lightspec_backend.bls import BLSExecutor

    from lightspec_core import LLMEngine

    def on_fault(model: str, message: str) -> None:
        pb_utils.Logger.log_error(f"[lightspec] {message}")
        if control is not None:  # lightspec serve's supervisor restarts the server
            control.report_fault(model, message)

    stages = {s: config.stage_models[s] for s in config.stages_in_use()}
    executor = BLSExecutor(stages, pb_utils, stage_timeout_s=config.stage_timeout_s, on_fault=on_fault)
    if config.engine.speculative and config.local_stage(config.engine.speculation):
        from lightspec_core.config import resolve_dirs
        from lightspec_core.engine.build import served_context
        from lightspec_core.stages.executor import LocalExecutor, RoutingExecutor
        from lightspec_core.stages.mtp import MTPRunner

        target, mtp, _ = resolve_dirs(config.engine)
        ctx = served_context(config.engine, target)
        local = LocalExecutor({"mtp": MTPRunner(target, mtp, config.engine.device, max_context=ctx)})
        executor = RoutingExecutor({"target": executor, "mtp": local})
    # the stages load beside this model and answer BLS only once it has loaded: the engine fetches
    # their profiles (taken while they load) from its loop, before its first step
    engine = LLMEngine(config.engine, executor=executor, profile_now=False)
    if engine.profile_pending and config.engine.speculation == "mtp" and config.local_stage("mtp"):
        # the heads run in this process: time them now, while the model loads
        executor.profile("mtp", engine.profile_spec())
    return engine


def _front(model_config: dict, config):
    from lightspec_backend.front import BatchedFront

    if not pb_utils.using_decoupled_model_transaction_policy(model_config):
        raise ValueError("model_transaction_policy: the batched front must be decoupled (decoupled: true)")
    return BatchedFront(pb_utils, config.orchestrator_model, config.header_forward_pattern)


class _StageModelAdapter:
    def __init__(self, stage):
        self.stage = stage

    def execute(self, requests: list) -> list:
        return self.stage.execute(requests)

    def finalize(self) -> None:
        pass


def _stage(args: dict, config) -> _StageModelAdapter:
    import torch
    from lightspec_backend.params import available_cpus
    from lightspec_backend.stage import StageModel, stage_threads

    from lightspec_core.config import resolve_dirs
    from lightspec_core.engine.build import check_draft_context, with_draft_tokens
    from lightspec_core.engine.kv_budget import with_kv_budget
    from lightspec_core.models.llama import LlamaConfig
    from lightspec_core.stages.memory import keep_freed_memory
    from lightspec_core.stages.mtp import MTPRunner
    from lightspec_core.stages.target import ModelRunner

    cfg = config.engine
    if not keep_freed_memory():  # a step's megabytes of temporaries reuse freed memory (see there)
        pb_utils.Logger.log_warn("[lightspec] mallopt unavailable (not glibc): large temporaries are not kept")
    threads = stage_threads(cfg.num_threads, available_cpus())
    pb_utils.Logger.log_info(
        f"[lightspec] {config.role.value} stage: {threads.small} torch thread(s) for calls under "
        f"{threads.large_call_tokens} tokens, {threads.large} for larger ones"
    )
    device = cfg.device
    if args.get("model_instance_kind") == "GPU":
        device = f"cuda:{args['model_instance_device_id']}"
    target, mtp, draft = resolve_dirs(cfg)
    # the pool's blocks come from the target's geometry in every process; the target stage, which
    # holds the weights and the pool, checks that they fit
    model = LlamaConfig.from_dir(target)
    # max_draft_tokens as the engine resolves it: the profile taken here is then the one it asks for
    cfg = with_kv_budget(
        with_draft_tokens(cfg), model, target, allow_fraction=False, check_fit=config.role is Role.TARGET
    )
    ctx = cfg.context_length(model.max_position_embeddings)  # served: the model must compute it exactly
    if config.role is Role.MTP:
        runner = MTPRunner(target, mtp, device, max_context=ctx)
    elif config.role is Role.TARGET:
        heads = MTPRunner(target, mtp, device, max_context=ctx) if config.loads_heads else None  # fused drafts
        runner = ModelRunner(
            target, cfg.num_kv_blocks, cfg.block_size, device, heads=heads, dtype=cfg.dtype, max_context=ctx
        )
    else:
        check_draft_context(draft, ctx)  # refused here, naming draft_dir, not at its first long request
        runner = ModelRunner(draft, cfg.num_kv_blocks, cfg.block_size, device, dtype=cfg.dtype, max_context=ctx)
    stage = StageModel(config.role, runner, pb_utils, threads=threads, set_threads=torch.set_num_threads)
    if cfg.speculative and cfg.policy_kind == "dynamic" and cfg.profile_stages:
        _take_profile(stage, config.role, cfg, model)
    return _StageModelAdapter(stage)


def _take_profile(stage, role: Role, cfg, model) -> None:
    """The dynamic policy's profile of this stage, taken before the server reports ready (the
    orchestrator's engine fetches it; a stage the engine will not ask, such as the draft stage of
    an MTP repository, takes none)."""
    from lightspec_core.spec.calibrate import PROPOSER_STAGE, ProfileSpec

    if role is not Role.TARGET and PROPOSER_STAGE.get(cfg.method) != role.value:
        return
    t0 = time.perf_counter()
    try:
        stage.take_profile(ProfileSpec.for_engine(cfg, model, cfg.context_length(model.max_position_embeddings)))
    except Exception as e:  # noqa: BLE001 - an optimisation: the engine asks again, or plans with generic costs
        pb_utils.Logger.log_warn(f"[lightspec] {role.value} stage: profile failed ({e})")
        return
    pb_utils.Logger.log_info(f"[lightspec] {role.value} stage: profiled in {time.perf_counter() - t0:.1f} s")
