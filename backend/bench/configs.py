"""What a sweep runs: speculation configurations, and the model repository that serves them."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..params import FUSED, LOCAL, STAGES_IN_ORCHESTRATOR, STAGES_PARAM, Role
from ..repository import (
    STAGE_PARAMS,
    default_parameters,
    orchestrator_parameters,
    render_orchestrator,
    render_stage,
    write_model_repository,
)

DEFAULT_CONFIGS = ["none", "static:1", "static:2", "static:4", "dynamic"]
METHODS = ("mtp", "ngram", "draft")
TARGET_STAGE = "lightspec_target"
DRAFT_STAGE = "lightspec_draft"
_POLICY = re.compile(r"dynamic(\+stop)?|static(:\d+)?")
_WHERE = re.compile(r"\+(local|fused)$")


@dataclass(frozen=True)
class RunConfig:
    """One server configuration: a speculation method and policy, served by its own orchestrator.

    ``config`` is the user's label: ``none``, ``dynamic``, ``static`` or ``static:K``, optionally
    suffixed ``@2`` for pipeline depth 2; ``dynamic+stop`` is the dynamic policy with its MTP
    confidence stop (``confidence_stop: on``); ``+local`` / ``+fused`` set ``mtp`` for this
    configuration (where the MTP heads run, to compare them in one run). The ``none`` baseline has
    ``method == "none"``."""

    config: str
    method: str
    policy: str  # the orchestrator's policy parameter
    pipeline_depth: int = 1
    confidence_stop: bool = False
    mtp: str | None = None  # local | fused; None: the repository's (--set mtp=...)

    @property
    def model_name(self) -> str:
        if self.method == "none":
            name = "lightspec_none"
        else:
            name = f"lightspec_{self.method}_{self.policy.replace(':', '_')}"
            name += "_stop" if self.confidence_stop else ""
            name += f"_{self.mtp}" if self.mtp else ""
        return name + (f"_d{self.pipeline_depth}" if self.pipeline_depth != 1 else "")

    @property
    def static_k(self) -> int | None:
        return int(self.policy.split(":")[1]) if self.policy.startswith("static:") else None

    def parameters(self, max_draft_tokens: int) -> dict[str, str]:
        """The orchestrator parameters that make this configuration."""
        k = self.static_k or 0
        out = {
            "speculation": self.method,
            "policy": self.policy,
            "max_draft_tokens": str(max(max_draft_tokens, k)),
            "pipeline_depth": str(self.pipeline_depth),
        }
        if self.confidence_stop:
            out["confidence_stop"] = "on"
        if self.mtp and self.method == "mtp":
            out["mtp"] = self.mtp
        return out


def _depth(spec: str, depth: str) -> int:
    try:
        depth_n = int(depth) if depth else 1
    except ValueError:
        raise SystemExit(f"--configs {spec!r}: expected CONFIG@DEPTH with DEPTH 1 or 2") from None
    if depth_n not in (1, 2):
        raise SystemExit(f"--configs {spec!r}: pipeline depth must be 1 or 2")
    return depth_n


def _parse_one(spec: str, methods: list[str]) -> list[RunConfig]:
    """One ``--configs`` entry -> its run configurations (one per method; ``none`` once)."""
    label, _, depth = spec.partition("@")
    depth_n = _depth(spec, depth)
    if label in ("none", "off"):
        return [RunConfig(spec, "none", "off", depth_n)]
    where = _WHERE.search(label)
    label = label.removesuffix(where.group(0)) if where else label
    if not _POLICY.fullmatch(label):
        raise SystemExit(
            f"--configs {spec!r}: expected none, dynamic, static or static:K "
            "(optionally @2; dynamic+stop: with the MTP confidence stop; +local or +fused: "
            "where the MTP heads run)"
        )
    policy, stop = label.removesuffix("+stop"), label.endswith("+stop")
    return [RunConfig(spec, m, policy, depth_n, stop, where.group(1) if where else None) for m in methods]


def parse_configs(configs: list[str], methods: list[str]) -> list[RunConfig]:
    """``["none", "static:2", "dynamic@2"] x ["mtp", "ngram"]`` -> run configurations, ``none`` once."""
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"--methods {m!r}: expected some of {', '.join(METHODS)}")
    out = [c for spec in configs for c in _parse_one(spec, methods)]
    if len({c.model_name for c in out}) != len(out):
        raise SystemExit(f"--configs {' '.join(configs)}: a configuration is listed twice")
    return out


def stages_for(configs: list[RunConfig], overrides: dict[str, str] | None = None) -> list[str]:
    """Stage models the configurations need: the target always, the MTP stage named by ``mtp`` when
    a configuration's heads run there (not at ``local`` or ``fused``), the draft model when used;
    none at ``stages: local`` or ``process`` (the default), where each orchestrator runs its own."""
    params = {**default_parameters(), **(overrides or {})}
    if params[STAGES_PARAM] in STAGES_IN_ORCHESTRATOR:
        return []
    base = params["mtp"]
    remote_heads = any((c.mtp or base) not in (LOCAL, FUSED) for c in configs if c.method == "mtp")
    draft = any(c.method == "draft" for c in configs)
    return [TARGET_STAGE, *([base] if remote_heads else []), *([DRAFT_STAGE] if draft else [])]


def write_bench_repository(
    dst: str | Path, configs: list[RunConfig], overrides: dict[str, str], max_draft_tokens: int
) -> Path:
    """The stage models plus one orchestrator per configuration (and the plain ``lightspec`` one)."""
    fused = any(c.mtp == FUSED for c in configs)  # then the shared target stage loads the heads
    dst = write_model_repository(dst, {**overrides, "mtp": FUSED} if fused else overrides)
    local = orchestrator_parameters(overrides)[STAGES_PARAM] in STAGES_IN_ORCHESTRATOR  # the default too
    if any(c.method == "draft" for c in configs) and not local and not (dst / DRAFT_STAGE / "config.pbtxt").is_file():
        # the generated repository has a draft stage only for speculation draft; the shared one here
        # serves the draft configurations beside the others
        params = {**default_parameters(), **overrides, "speculation": "draft"}
        (dst / DRAFT_STAGE / "1").mkdir(parents=True, exist_ok=True)
        text = render_stage(Role.DRAFT, DRAFT_STAGE, {k: params[k] for k in STAGE_PARAMS[Role.DRAFT] if k in params})
        (dst / DRAFT_STAGE / "config.pbtxt").write_text(text)
    for c in configs:
        params = {**orchestrator_parameters(overrides), **c.parameters(max_draft_tokens)}
        (dst / c.model_name / "1").mkdir(parents=True, exist_ok=True)
        (dst / c.model_name / "1" / ".gitkeep").touch()
        (dst / c.model_name / "config.pbtxt").write_text(render_orchestrator(params, c.model_name))
    return dst
