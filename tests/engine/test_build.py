"""What an engine is built from (``lightspec_core/engine/build.py``): ``max_draft_tokens`` against the
MTP heads it proposes with."""

from __future__ import annotations

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.models.mtp_heads import MTPConfig, MTPHeads

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "for i in range(10):\n    for j in range(i):\n"]


@pytest.fixture(scope="module")
def two_heads(default_model, tmp_path_factory):
    """The embedded model's first two trained heads, saved as ``train-heads --heads 2`` saves them:
    their drafts are accepted often enough that the test sees the engine use both heads."""
    four = MTPHeads.load(default_model / "mtp")
    cfg = four.config
    two = MTPHeads(MTPConfig(2, cfg.hidden_size, cfg.intermediate_size, cfg.rms_norm_eps), four.draft_vocab)
    two.load_state_dict({k: v for k, v in four.state_dict().items() if k.startswith(("heads.0.", "heads.1."))})
    out = tmp_path_factory.mktemp("two_heads")
    two.save(out)
    return out


def generate(default_model, **kw) -> tuple[list[list[int]], int, EngineConfig]:
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), num_kv_blocks=64, **kw))
    try:
        outs = eng.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    finally:
        eng.close()
    assert all(o.finish_reason == "length" for o in outs), [o.finish_reason for o in outs]
    return [o.output_token_ids for o in outs], sum(o.num_draft_tokens for o in outs), eng.config


@pytest.mark.parametrize("mtp", ["fused", "local"])
@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_heads_fewer_than_the_default_drafts_serve_with_default_settings(default_model, two_heads, mtp, policy):
    plain, _, _ = generate(default_model, speculation="none", policy="off")
    tokens, drafted, cfg = generate(default_model, speculation="mtp", mtp_dir=str(two_heads), mtp=mtp, policy=policy)
    assert cfg.max_draft_tokens == 2
    assert tokens == plain and drafted > 0


def test_the_default_stays_where_the_heads_are_as_many(default_model):
    _, _, cfg = generate(default_model, speculation="mtp", policy="static")
    assert cfg.max_draft_tokens == 4


@pytest.mark.parametrize(
    ("setting", "named"),
    [({"max_draft_tokens": 4}, "max_draft_tokens=4"), ({"max_draft_tokens": 3, "policy": "static:3"}, "max_draft_tokens=3"),
     ({"policy": "static:3"}, "policy='static:3'")],
)  # fmt: skip
def test_more_drafts_than_heads_asked_for_are_refused_at_load_naming_the_setting(default_model, two_heads, setting,
                                                                                   named):  # fmt: skip
    with pytest.raises(ValueError, match="draft at most 2 tokens") as e:
        LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation="mtp", mtp_dir=str(two_heads),
                               num_kv_blocks=64, **setting))  # fmt: skip
    assert str(e.value).startswith(named)
