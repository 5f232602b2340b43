"""A Hugging Face checkpoint's config.json and generation_config.json, parsed into one validated
:class:`LlamaConfig` for the families the runner implements: Llama, Mistral, Qwen2 and Qwen3.

The rule: a config field that changes the math is implemented (and tests/models holds the runner's
logits to transformers') or the load fails with ``ValueError("config.json: <field>=<value>: not
supported (...)")``. How each field a config may carry is treated:

=====================================  =====================================================
implemented (every family)             vocab_size, hidden_size, intermediate_size,
                                       num_hidden_layers, num_attention_heads,
                                       num_key_value_heads, head_dim, max_position_embeddings,
                                       rms_norm_eps, tie_word_embeddings, rope_theta,
                                       rope_scaling / rope_parameters and
                                       original_max_position_embeddings (rope.py)
implemented (per family)               llama: attention_bias, mlp_bias; qwen3: attention_bias
                                       (and q/k RMSNorm, always); qwen2: q/k/v biases, always
exact only within a context            sliding_window (mistral; qwen2/3 with use_sliding_window,
                                       max_window_layers, layer_types): accepted while the window
                                       is at least the served context (it then masks nothing),
                                       refused otherwise; rope type dynamic: exact up to
                                       max_position_embeddings, past which the engine never serves
allowed one value                      hidden_act: silu; partial_rotary_factor: 1.0; is_causal: true
accepted, no effect on the math        ACCEPTED below (ids, dtype, bookkeeping, dropout)
refused                                any other field that is set (not null, false, 0 or
                                       empty): quantization_config, auto_map, softcapping, a
                                       flag of another family (mistral's attention_bias), ...
=====================================  =====================================================

Fields a config.json leaves out take the family's transformers default (``FAMILIES``; a test holds
them to transformers' config classes), as transformers would.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .rope import RopeScaling, parse_rope, refused

# fields with no effect on a forward pass at inference: ids, dtype (weights are converted to the
# runner's dtype), bookkeeping, dropout (off at inference), pretraining_tp (a matmul split with the
# same result, which transformers 5 no longer reads), chunked feed-forward (same result)
ACCEPTED = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "torch_dtype",
        "dtype",
        "use_cache",
        "initializer_range",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_dropout",
        "pretraining_tp",
        "chunk_size_feed_forward",
        "id2label",
        "label2id",
        "problem_type",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "_name_or_path",
        "tokenizer_class",
        "task_specific_params",
        "is_llama_config",  # SmolLM2's configs: transformers reads neither
        "_attn_implementation_autoset",
    }
)
# fields accepted at one value only: another one changes the math where transformers reads it
ONE_VALUE = {"is_causal": True}  # otherwise transformers 5 attends bidirectionally
# read by rope.parse_rope, which refuses what it does not implement
ROPE_FIELDS = frozenset(
    {"rope_theta", "rope_scaling", "rope_parameters", "original_max_position_embeddings", "partial_rotary_factor"}
)


@dataclass(frozen=True)
class Family:
    architecture: str
    defaults: dict  # the math fields this family reads, each with transformers' default


_COMMON = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "head_dim": None,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
_QWEN = dict(
    _COMMON,
    vocab_size=151936,
    intermediate_size=22016,
    num_key_value_heads=32,
    max_position_embeddings=32768,
    use_sliding_window=False,
    sliding_window=4096,
    max_window_layers=28,
    layer_types=None,
)
FAMILIES = {
    "llama": Family(
        "LlamaForCausalLM",
        dict(
            _COMMON,
            intermediate_size=11008,
            num_key_value_heads=None,
            max_position_embeddings=2048,
            attention_bias=False,
            mlp_bias=False,
        ),
    ),
    "mistral": Family(
        "MistralForCausalLM",
        dict(
            _COMMON, intermediate_size=14336, num_key_value_heads=8, max_position_embeddings=131072, sliding_window=4096
        ),
    ),
    "qwen2": Family("Qwen2ForCausalLM", _QWEN),
    "qwen3": Family("Qwen3ForCausalLM", dict(_QWEN, head_dim=128, attention_bias=False)),
}
_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class LlamaConfig:
    """The model's shape and math. Constructed directly it describes a Llama model of this project
    (the defaults are the embedded model's); :meth:`from_dir` reads a checkpoint of any family."""

    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 704
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    max_position_embeddings: int = 1024
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2  # the first of eos_token_ids
    pad_token_id: int | None = 0
    model_type: str = "llama"  # a key of FAMILIES
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    attention_bias: bool = False  # q/k/v/o biases (llama, qwen3)
    mlp_bias: bool = False  # llama
    rope_scaling: RopeScaling | None = None  # None: the default rope
    sliding_window: int | None = None  # None: every layer attends to the whole context
    sliding_layers: tuple[int, ...] = ()  # the layers the window applies to
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation; () takes (eos_token_id,)

    def __post_init__(self) -> None:
        if self.model_type not in FAMILIES:
            raise refused("model_type", self.model_type, f"implemented: {', '.join(FAMILIES)}")
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim % 2:  # rotary embeddings rotate pairs of dimensions
            raise refused("head_dim", self.head_dim, "rotary embeddings need an even head dimension")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"config.json: num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if not self.eos_token_ids and self.eos_token_id is not None:
            self.eos_token_ids = (self.eos_token_id,)
        self.eos_token_ids = tuple(self.eos_token_ids)
        self.eos_token_id = self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def qkv_bias(self) -> bool:
        """q/k/v projections carry biases: Qwen2 always, Llama and Qwen3 with attention_bias."""
        return self.attention_bias or self.model_type == "qwen2"

    @property
    def qk_norm(self) -> bool:
        """Qwen3 RMS-normalises each head's queries and keys before the rotation."""
        return self.model_type == "qwen3"

    def check_context(self, max_context: int) -> None:
        """Refuse a served context this model's math cannot give exactly: one longer than its
        attention window (the runner attends to the whole context) or past what dynamic rope allows."""
        if self.sliding_window is not None and self.sliding_window < max_context:
            raise refused(
                "sliding_window",
                self.sliding_window,
                (
                    f"the runner attends to the whole context, and {max_context} tokens would be served; "
                    f"serve at most sliding_window tokens (max_model_len)"
                ),
            )
        if self.rope_scaling is not None:
            self.rope_scaling.check_context(max_context, self.max_position_embeddings)

    def served_context(self, max_context: int | None) -> int:
        """The positions a runner needs: ``max_context`` (the engine's context length), capped by
        the model's; None: the model's."""
        return min(max_context or self.max_position_embeddings, self.max_position_embeddings)

    @classmethod
    def from_dir(cls, model_dir: str | Path, max_context: int | None = None) -> LlamaConfig:
        """Read ``config.json`` (and ``generation_config.json``'s EOS ids, which win, as in
        transformers' generation). With ``max_context`` also :meth:`check_context`."""
        model_dir = Path(model_dir)
        cfg = cls.from_hf_dict(json.loads((model_dir / "config.json").read_text()), _generation_eos(model_dir))
        if max_context is not None:
            cfg.check_context(cfg.served_context(max_context))
        return cfg

    @classmethod
    def from_hf_dict(cls, raw: dict, eos_token_ids: tuple[int, ...] = ()) -> LlamaConfig:
        model_type = _family_of(raw)
        family = FAMILIES[model_type]
        for key, value in raw.items():
            if key in ONE_VALUE:
                if value is not ONE_VALUE[key]:
                    raise refused(key, value, f"only {ONE_VALUE[key]!r}: causal attention")
            elif value and key not in family.defaults and key not in ACCEPTED and key not in ROPE_FIELDS:
                raise refused(key, value, f"a field LightSpec's {model_type} model does not implement")
        v = {k: raw.get(k, default) for k, default in family.defaults.items()}
        _check_numbers(v)
        if v["hidden_act"] != "silu":
            raise refused("hidden_act", v["hidden_act"], "the MLP is SwiGLU: silu only")
        rope_theta, scaling = parse_rope(raw, v["max_position_embeddings"])
        window, sliding_layers = _sliding(model_type, v)
        shape = {
            k: v[k]
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
                "rms_norm_eps",
                "head_dim",
            )
        }
        return cls(
            **shape,
            num_key_value_heads=v["num_key_value_heads"] or v["num_attention_heads"],
            rope_theta=rope_theta,
            tie_word_embeddings=bool(v["tie_word_embeddings"]),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_id=None,
            pad_token_id=raw.get("pad_token_id"),
            model_type=model_type,
            attention_bias=bool(v.get("attention_bias", False)),
            mlp_bias=bool(v.get("mlp_bias", False)),
            rope_scaling=scaling,
            sliding_window=window,
            sliding_layers=sliding_layers,
            eos_token_ids=eos_token_ids or _ids(raw.get("eos_token_id")),
        )

    def to_hf_dict(self, torch_dtype: str = "float32") -> dict:
        """A config.json transformers (4 and 5) loads: the hub's form, rope_scaling beside rope_theta."""
        keys = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
            "rms_norm_eps",
            "rope_theta",
            "tie_word_embeddings",
            "bos_token_id",
            "eos_token_id",
            "pad_token_id",
        )
        d = {k: getattr(self, k) for k in keys}
        if len(self.eos_token_ids) > 1:
            d["eos_token_id"] = list(self.eos_token_ids)
        family = FAMILIES[self.model_type]
        d.update(
            architectures=[family.architecture], model_type=self.model_type, head_dim=self.head_dim, hidden_act="silu"
        )
        d.update({k: getattr(self, k) for k in ("attention_bias", "mlp_bias") if k in family.defaults})
        if self.rope_scaling is not None:
            d["rope_scaling"] = self.rope_scaling.to_hf()
        if self.model_type == "mistral":
            d["sliding_window"] = self.sliding_window
        elif self.model_type in ("qwen2", "qwen3"):
            d.update(
                use_sliding_window=bool(self.sliding_layers),
                sliding_window=self.sliding_window,
                layer_types=[_LAYER_TYPES[i in self.sliding_layers] for i in range(self.num_hidden_layers)],
            )
        d["torch_dtype"] = torch_dtype
        return d


def _family_of(raw: dict) -> str:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        raise refused("model_type", model_type, f"implemented: {', '.join(FAMILIES)}")
    archs = raw.get("architectures") or [FAMILIES[model_type].architecture]
    if archs != [FAMILIES[model_type].architecture]:
        raise refused("architectures", archs, f"a {model_type} checkpoint is {FAMILIES[model_type].architecture}")
    return model_type


def _sliding(model_type: str, v: dict) -> tuple[int | None, tuple[int, ...]]:
    """(window, the layers it applies to), as transformers' configs derive them."""
    n = v["num_hidden_layers"]
    if model_type == "mistral":
        window = v["sliding_window"]
        return window, tuple(range(n)) if window is not None else ()
    if model_type not in ("qwen2", "qwen3"):
        return None, ()
    window = v["sliding_window"] if v["use_sliding_window"] else None
    types = v["layer_types"] or [_LAYER_TYPES[window is not None and i >= v["max_window_layers"]] for i in range(n)]
    if len(types) != n or not set(types) <= set(_LAYER_TYPES):
        raise refused("layer_types", types, f"{n} entries of {' or '.join(_LAYER_TYPES)}")
    layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention") if window is not None else ()
    return (window if layers else None), layers


_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_numbers(v: dict) -> None:
    """Sizes are positive integers, ``rms_norm_eps`` a number >= 0: a null or a string there would
    otherwise fail (or change the math) deep in the runner, not naming the field."""
    for key in (*_SIZES, "num_key_value_heads", "head_dim", "max_position_embeddings"):
        value = v.get(key)
        if value is None and key in ("num_key_value_heads", "head_dim"):
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refused(key, value, "a positive integer")
    eps = v["rms_norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise refused("rms_norm_eps", eps, "a number >= 0")


def _ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"eos_token_id={value!r}: expected a token id or a list of them")
    return tuple(ids)


def _generation_eos(model_dir: Path) -> tuple[int, ...]:
    path = model_dir / "generation_config.json"
    return _ids(json.loads(path.read_text()).get("eos_token_id")) if path.exists() else ()
