"""Validated configuration dataclasses: one per concern, parsed once at the edge.

Every check raises ``ValueError`` naming the field and the bad value, so the Triton adapter can turn it
into an ``INVALID_ARG`` response (per-request fields) or a model-load failure (config.pbtxt parameters).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

DEFAULT_MODEL_ROOT = Path(__file__).resolve().parent / "default_model"


class SpecMethod(str, Enum):
    MTP = "mtp"
    DRAFT = "draft"
    NGRAM = "ngram"
    NONE = "none"


INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_HALF_TINY = 2.0**-150  # at or below it a float rounds to 0 in float32


def _bad(name: str, value, why: str) -> ValueError:
    return ValueError(f"{name}={value!r}: {why}")


# Bounds on a request's stop strings: their matching runs in the engine loop every step, so one
# request's list must not slow every other request down.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 256


@dataclass
class SamplingParams:
    """Per-request generation parameters (vLLM names; ``end_id`` as in TensorRT-LLM).

    ``max_tokens=None`` generates to the end of the context (the engine resolves it when the request
    is added). ``temperature == 0`` is greedy, as is one that float32 rounds to 0; one beyond
    float32's range is refused. ``num_draft_tokens`` caps speculation for this request (``None``:
    engine default, ``0``: no speculation). Higher ``priority`` is admitted first and
    preempted last. Until ``min_tokens`` tokens are generated, the end tokens (EOS unless
    ``ignore_eos``, and ``end_id``) are masked out of the target's distribution and stop strings
    are not matched, as vLLM does. ``stream_interval`` raises the engine's
    ``EngineConfig.stream_interval`` for this request (vLLM's rule: the larger of the two).
    ``return_perf_metrics`` (TensorRT-LLM's name) adds the request's KV blocks and times to every
    delta (``RequestDelta.perf``).
    """

    max_tokens: int | None = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    end_id: int | None = None
    ignore_eos: bool = False
    num_draft_tokens: int | None = None
    priority: int = 0
    min_tokens: int = 0
    stream_interval: int | None = None
    return_perf_metrics: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise _bad("max_tokens", self.max_tokens, "must be a positive integer")
        if not (0.0 <= self.temperature <= FLOAT32_MAX):  # also rejects NaN
            raise _bad(
                "temperature",
                self.temperature,
                f"must be a finite number >= 0 and <= {FLOAT32_MAX:.7g} (float32's largest)",
            )
        if not (0.0 < self.top_p <= 1.0):
            raise _bad("top_p", self.top_p, "must be in (0, 1]")
        if not 0 <= self.top_k <= INT32_MAX:  # the stages carry top_k as int32
            raise _bad("top_k", self.top_k, f"must be in [0, {INT32_MAX}] (0 disables top-k)")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= (self.max_tokens or INT32_MAX):
            raise _bad("min_tokens", self.min_tokens, f"must be an integer in [0, max_tokens={self.max_tokens}]")
        if self.num_draft_tokens is not None and self.num_draft_tokens < 0:
            raise _bad("num_draft_tokens", self.num_draft_tokens, "must be >= 0")
        if self.seed is not None and self.seed < 0:
            # vLLM takes any int64: a negative seed is its 64 bits, as the UINT64 seed input carries them
            if self.seed < -(1 << 63):
                raise _bad("seed", self.seed, "must be >= -2**63")
            self.seed += 1 << 64
        if self.stream_interval is not None and (not isinstance(self.stream_interval, int) or self.stream_interval < 1):
            raise _bad("stream_interval", self.stream_interval, "must be a positive integer")
        if any(not s for s in self.stop):
            raise _bad("stop", self.stop, "stop strings must be non-empty")
        check_stop_strings("stop", self.stop)

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one that is 0 in the float32 the stages compute with (greedy is its limit)."""
        return self.temperature <= FLOAT32_HALF_TINY


def check_stop_strings(name: str, stop: list[str]) -> None:
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"{name}: {len(stop)} stop strings, at most {MAX_STOP_STRINGS}")
    longest = max((len(s) for s in stop), default=0)
    if longest > MAX_STOP_CHARS:
        raise ValueError(f"{name}: a stop string of {longest} characters, at most {MAX_STOP_CHARS}")


_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "b": 1,
}


def parse_memory(value: str) -> tuple[int | None, float | None]:
    """``"2GiB"``, ``"512MB"``, ``"1073741824"`` -> (bytes, None); ``"0.5"`` (in (0, 1)) -> (None, fraction)."""
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num) :]
    try:
        number = float(num)
    except ValueError:
        number = -1.0
    if unit not in _UNITS or not number > 0:
        raise _bad("kv_cache_memory", value, "expected bytes (e.g. 2GiB, 512MB) or a fraction of free memory in (0, 1)")
    if not unit and number < 1:
        return None, number
    return int(number * _UNITS[unit]), None


def parse_policy(policy: str) -> tuple[str, int | None]:
    """``"dynamic"`` | ``"off"`` | ``"static"`` | ``"static:K"`` -> (kind, fixed k or None)."""
    if policy in ("dynamic", "off", "static"):
        return policy, None
    if policy.startswith("static:"):
        try:
            k = int(policy.split(":", 1)[1])
        except ValueError:
            raise _bad("policy", policy, "expected static:K with an integer K") from None
        if k < 0:
            raise _bad("policy", policy, "K must be >= 0")
        return "static", k
    raise _bad("policy", policy, "expected one of dynamic, off, static, static:K")


DTYPES = ("float32", "bfloat16", "float16")  # of the target's and draft's weights and KV pools
MTP_FUSED = "fused"  # the target stage runs the MTP heads right after its forward
MTP_LOCAL = "local"  # the heads run in the engine's process (the orchestrator's, in a server)
DEFAULT_MAX_DRAFT_TOKENS = 4  # unset max_draft_tokens: this, or the MTP heads' number where smaller


@dataclass
class EngineConfig:
    """Engine configuration. ``model_dir=None`` uses the embedded default model.

    KV memory is ``num_kv_blocks`` blocks of ``block_size`` tokens. With the dynamic policy the
    stages are timed on synthetic steps while the engine loads (``profile_stages``; about a second
    here) and the policy plans with that profile; without it, with generic costs. Each step
    schedules at most ``max_num_seqs`` requests and ``max_num_batched_tokens`` new tokens (prefill
    chunks + 1 + k per decoding request).

    ``mtp`` says where the MTP heads run: ``"fused"`` (the default) in the target stage, right after
    its forward, which returns each greedy request's next drafts with its result and saves a stage
    call per step (sampled requests draft on heads in the engine's process); ``"local"`` in the
    engine's process for every request; any other value names the Triton stage model that serves
    them (in process, that is ``"local"``). ``confidence_stop`` (MTP with the dynamic policy) lets a
    request's chain of drafts stop where its heads' confidence says the next draft is not worth
    verifying (see ``ConfidenceStats``); off by default, as it did not pay with the embedded model
    (docs/benchmarks.md). ``dtype``: the target's and draft model's weights and KV pools
    (float32, bfloat16, float16; float32 by default, the fastest on most CPUs). ``kv_cache_memory``:
    the KV pool's size as bytes (``"2GiB"``) or a fraction of the memory available after the weights
    (``"0.5"``); it sets ``num_kv_blocks`` (see ``engine.kv_budget``). ``stream_interval``: a
    request's deltas carry at least this many new tokens, except its first and its last (vLLM's
    ``--stream-interval``); 1 hands out every step's tokens at once. A server sends a response per
    delta, and at high concurrency each costs more than the tokens it carries (docs/benchmarks.md).
    ``enable_prefix_caching`` (on by default, as in vLLM): full blocks of computed K/V (prompt or
    verified output) are kept, keyed by their tokens and everything before them, for later requests
    whose prompts start the same way (``engine.block_manager``).
    ``max_draft_tokens`` unset: 4, or the MTP heads' number where they are fewer (an engine reads it
    from ``mtp_dir``: ``engine.build.with_draft_tokens``); set above that number, the engine refuses it.
    ``num_threads``: torch's intra-op threads (0: torch's default, one per CPU); ``decode_threads``:
    those of a target or draft call in which every request feeds one token (0: as the others). A
    server sets it to one per CPU but one (see ``lightspec_backend.params``). ``decode_nice`` (-20..0;
    0 leaves priorities alone): the nice value of such a call where it runs on one thread
    (``decode_threads`` 1), so that a server's frontend processes do not preempt it
    (``stages.executor.LoneDecodePriority``); a server sets -10.
    """

    model_dir: str | None = None
    mtp_dir: str | None = None
    draft_dir: str | None = None
    speculation: str = "mtp"
    policy: str = "dynamic"
    max_draft_tokens: int | None = None
    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    max_model_len: int | None = None
    pipeline_depth: int = 1
    ngram_max: int = 3
    ngram_min: int = 1
    kv_high_water: float = 0.90
    seed: int = 0
    device: str = "cpu"
    num_threads: int = 0
    decode_threads: int = 0
    decode_nice: int = 0
    profile_stages: bool = True
    confidence_stop: bool = False
    mtp: str = MTP_FUSED
    dtype: str = "float32"
    kv_cache_memory: str | None = None
    stream_interval: int = 1
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        try:
            self.method = SpecMethod(self.speculation)
        except ValueError:
            raise _bad("speculation", self.speculation, "expected one of mtp, draft, ngram, none") from None
        self.policy_kind, self.static_k = parse_policy(self.policy)
        if self.max_draft_tokens is not None and not 0 <= self.max_draft_tokens <= 16:
            raise _bad("max_draft_tokens", self.max_draft_tokens, "must be in 0..16")
        for name in ("num_kv_blocks", "block_size", "max_num_seqs", "max_num_batched_tokens", "stream_interval"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise _bad(name, v, "must be a positive integer")
        for name in ("num_threads", "decode_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise _bad(name, v, "must be 0 (the default) or a positive integer")
        if not isinstance(self.decode_nice, int) or not -20 <= self.decode_nice <= 0:
            raise _bad("decode_nice", self.decode_nice, "must be in -20..0 (0: priorities left alone)")
        if self.pipeline_depth not in (1, 2):
            raise _bad("pipeline_depth", self.pipeline_depth, "must be 1 or 2")
        if not 0.0 < self.kv_high_water <= 1.0:
            raise _bad("kv_high_water", self.kv_high_water, "must be in (0, 1]")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise _bad("ngram_min", self.ngram_min, "need 1 <= ngram_min <= ngram_max")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len <= 0):
            raise _bad("max_model_len", self.max_model_len, "must be a positive integer (or unset: the model's)")
        if self.kv_cache_memory:
            parse_memory(self.kv_cache_memory)
        if self.dtype not in DTYPES:
            raise _bad("dtype", self.dtype, f"expected one of {', '.join(DTYPES)}")
        if not isinstance(self.mtp, str) or not self.mtp.strip():
            raise _bad("mtp", self.mtp, f"expected {MTP_FUSED}, {MTP_LOCAL} or the name of a stage model")
        if self.static_k is not None and self.static_k > self.draft_limit:
            raise _bad("policy", self.policy, f"K exceeds max_draft_tokens={self.draft_limit}")

    def context_length(self, max_position_embeddings: int) -> int:
        """The longest sequence served: the model's, ``max_model_len`` and the KV pool's, whichever is least."""
        return min(
            self.max_model_len or max_position_embeddings, max_position_embeddings, self.num_kv_blocks * self.block_size
        )

    @property
    def fused_mtp(self) -> bool:
        """The target stage proposes MTP drafts with its result (``mtp: fused`` and speculating)."""
        return self.method is SpecMethod.MTP and self.speculative and self.mtp == MTP_FUSED

    @property
    def confidence_floors(self) -> bool:
        """The dynamic policy computes per-request gain floors for the MTP heads' confidence stop."""
        return self.confidence_stop and self.method is SpecMethod.MTP and self.policy_kind == "dynamic"

    @property
    def draft_limit(self) -> int:
        """``max_draft_tokens``, or the default where it is unset and no engine has resolved it yet."""
        return DEFAULT_MAX_DRAFT_TOKENS if self.max_draft_tokens is None else self.max_draft_tokens

    @property
    def speculative(self) -> bool:
        return self.method is not SpecMethod.NONE and self.policy_kind != "off" and self.draft_limit > 0


def cache_dir() -> Path:
    """Where LightSpec keeps what it builds (backends, repositories, compiled kernels):
    ``$LIGHTSPEC_CACHE``, else ``$XDG_CACHE_HOME/lightspec``, else ``~/.cache/lightspec``."""
    if os.environ.get("LIGHTSPEC_CACHE"):
        return Path(os.environ["LIGHTSPEC_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightspec"


def default_model_dir() -> str:
    """Directory of the embedded default target checkpoint (HF layout)."""
    return str(DEFAULT_MODEL_ROOT / "target")


def resolve_dirs(cfg: EngineConfig) -> tuple[str, str, str]:
    """(target, mtp, draft) checkpoint directories; MTP heads and draft model default to the
    siblings ``mtp`` and ``draft`` of the target directory."""
    target = cfg.model_dir or default_model_dir()
    parent = Path(target).parent
    return target, cfg.mtp_dir or str(parent / "mtp"), cfg.draft_dir or str(parent / "draft")
