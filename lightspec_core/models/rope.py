"""Rotary position embedding for the rope types of Hugging Face checkpoints, in plain torch.

A checkpoint states its rope in one of two forms: the hub's ``rope_scaling`` dict beside a top-level
``rope_theta``, or transformers 5's ``rope_parameters`` dict carrying ``rope_theta`` inside.
:func:`parse_rope` reads either the way transformers does (``RotaryEmbeddingConfigMixin``), and
:func:`rope_frequencies` computes the inverse frequencies and the attention factor formula for
formula as ``transformers.modeling_rope_utils``'s ``_compute_*_parameters``; tests/models holds our
logits to transformers' for every type.

Rope types: ``default``, ``linear``, ``llama3`` and ``yarn`` are implemented. ``dynamic`` (NTK) is
implemented up to ``max_position_embeddings``: transformers recomputes its frequencies from the
running sequence's length once that passes ``max_position_embeddings`` (so a sequence's early keys
would have been rotated with other frequencies than its late ones), and below that length they equal
the ones computed here, so a longer served context is refused (:meth:`RopeScaling.check_context`).
Every other type (``longrope``, ``proportional``, ...) is refused at load.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn

DEFAULT_THETA = 10000.0  # transformers' RotaryEmbeddingConfigMixin.default_theta, for all four families

# the keys each implemented type reads, besides rope_type (or its old name type) and rope_theta
ROPE_KEYS: dict[str, frozenset[str]] = {
    "default": frozenset(),
    "linear": frozenset({"factor"}),
    "dynamic": frozenset({"factor"}),
    "llama3": frozenset({"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}),
    "yarn": frozenset(
        {
            "factor",
            "original_max_position_embeddings",
            "attention_factor",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "truncate",
        }
    ),
}
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": (),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


def refused(field: str, value, why: str) -> ValueError:
    """The load error for a config field the runner does not implement, naming field and value."""
    shown = value if isinstance(value, str) else repr(value)
    return ValueError(f"config.json: {field}={shown}: not supported ({why})")


@dataclass(frozen=True)
class RopeScaling:
    """A checkpoint's rope scaling (theta apart), resolved as transformers resolves it."""

    rope_type: str
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: None derives it from factor (and mscale)
    beta_fast: float | None = None  # yarn: None is 32
    beta_slow: float | None = None  # yarn: None is 1
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool | None = None  # yarn: None (absent) is True

    def to_hf(self) -> dict:
        """The hub's ``rope_scaling`` dict, which transformers 4 and 5 both read."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def check_context(self, max_context: int, max_position_embeddings: int) -> None:
        if self.rope_type == "dynamic" and max_context > max_position_embeddings:
            raise refused(
                "rope_scaling.rope_type",
                "dynamic",
                (
                    f"transformers recomputes dynamic NTK frequencies from the running sequence's length past "
                    f"max_position_embeddings={max_position_embeddings}, and {max_context} tokens would be served; "
                    f"serve at most max_position_embeddings tokens"
                ),
            )


def parse_rope(raw: dict, max_position_embeddings: int) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling or None for the default rope) from a config.json dict."""
    source = "rope_scaling" if raw.get("rope_scaling") else "rope_parameters"
    params = dict(raw.get("rope_scaling") or raw.get("rope_parameters") or {})
    theta = params.pop("rope_theta", raw.get("rope_theta", DEFAULT_THETA))
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not theta > 0:
        raise refused("rope_theta", theta, "a positive number")
    theta = float(theta)
    rope_type = params.pop("rope_type", None) or params.get("type") or "default"
    params.pop("type", None)
    for where, value in (
        ("partial_rotary_factor", raw.get("partial_rotary_factor")),
        (f"{source}.partial_rotary_factor", params.pop("partial_rotary_factor", None)),
    ):
        if value not in (None, 1, 1.0):
            raise refused(where, value, "rotary embedding of part of each head is not implemented")
    if rope_type not in ROPE_KEYS:
        raise refused(f"{source}.rope_type", rope_type, f"implemented: {', '.join(ROPE_KEYS)}")
    unknown = sorted(set(params) - ROPE_KEYS[rope_type])
    if unknown:
        raise refused(f"{source}.{unknown[0]}", params[unknown[0]], f"not a parameter of rope type {rope_type}")
    for key in _REQUIRED.get(rope_type, ()):
        if params.get(key) is None:
            raise ValueError(f"config.json: {source}.{key}: required by rope type {rope_type}")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # a top-level original_max_position_embeddings wins over the dict's (transformers' standardize_rope_params)
        top = raw.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(
            top or params.get("original_max_position_embeddings") or max_position_embeddings
        )
        if "truncate" in params:  # transformers reads a null truncate as false: no rounding of the ramp
            params["truncate"] = bool(params["truncate"])
        if rope_type == "yarn" and params.get("factor") is None:
            params["factor"] = max_position_embeddings / params["original_max_position_embeddings"]
    return theta, RopeScaling(rope_type, **params)


def rope_frequencies(
    theta: float, scaling: RopeScaling | None, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies fp32 [head_dim / 2] and the factor cos and sin are scaled by."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    if scaling is None:
        return 1.0 / (theta**exponents), 1.0
    s, kind = scaling, scaling.rope_type
    if kind == "linear":
        return 1.0 / (theta**exponents) / s.factor, 1.0
    if kind == "dynamic":
        # transformers' value for any sequence of at most max_position_embeddings tokens
        seq_len = max_position_embeddings
        base = theta * ((s.factor * seq_len / max_position_embeddings) - (s.factor - 1)) ** (head_dim / (head_dim - 2))
        return 1.0 / (base**exponents), 1.0
    if kind == "llama3":
        return _llama3(1.0 / (theta**exponents), s), 1.0
    assert kind == "yarn", kind
    return _yarn(theta, exponents, s, head_dim)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth ramp between."""
    old_len = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, exponents: torch.Tensor, s: RopeScaling, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated and extrapolated frequencies blended by a linear ramp over the dimensions
    whose rotation count at the original context lies between ``beta_slow`` and ``beta_fast``, and
    cos/sin scaled by the attention factor (``0.1 ln(factor) + 1`` unless given)."""
    factor, attention = s.factor, s.attention_factor
    if attention is None:
        if s.mscale and s.mscale_all_dim:
            attention = float(_yarn_mscale(factor, s.mscale) / _yarn_mscale(factor, s.mscale_all_dim))
        else:
            attention = _yarn_mscale(factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate is None or s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta**exponents
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, attention


class Rope(nn.Module):
    """cos/sin tables for positions 0..num_positions-1, in the Hugging Face (rotate-half,
    non-interleaved) convention, computed in fp32 (they follow the model's dtype on ``.to``)."""

    def __init__(
        self,
        head_dim: int,
        num_positions: int,
        theta: float = DEFAULT_THETA,
        scaling: RopeScaling | None = None,
        max_position_embeddings: int | None = None,
    ):
        super().__init__()
        inv_freq, attention = rope_frequencies(theta, scaling, head_dim, max_position_embeddings or num_positions)
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [num_positions, head_dim]
        self.register_buffer("cos", emb.cos() * attention, persistent=False)
        self.register_buffer("sin", emb.sin() * attention, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [..., T, 1, head_dim] for ``positions`` [..., T]; gathered once per step."""
        return self.cos[positions].unsqueeze(-2), self.sin[positions].unsqueeze(-2)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [..., T, heads, head_dim]
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin
