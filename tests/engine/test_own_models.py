"""Checkpoints of other families, made by transformers, run through the engine: speculation stays
lossless on them (n-gram drafts against plain greedy decoding), their EOS ids all stop, and a text
prompt gets the BOS their tokenizer adds, as transformers encodes it."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
from tokenizers import Tokenizer, processors

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.engine.shards import EngineShards
from tests.engine.test_process import steps_until_done
from tests.models.factories import CASES, save_hf_checkpoint

PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n", "for i in range(10):\n    for j in range(i):\n"]


def own_model(tmp_path, default_model, case: str):
    model_type, overrides, how = CASES[case]
    path = save_hf_checkpoint(tmp_path / case, model_type, {**overrides, "vocab_size": 4096}, **how)
    shutil.copy(default_model / "target" / "tokenizer.json", path / "tokenizer.json")  # the same 4096 ids
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_ngram_speculation_on_another_family_equals_plain_greedy(tmp_path, default_model, case):
    path = own_model(tmp_path, default_model, case)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for spec in ("none", "ngram"):
        eng = LLMEngine(
            EngineConfig(
                model_dir=str(path),
                speculation=spec,
                policy="static:3",
                num_kv_blocks=32,
                block_size=8,
                profile_stages=False,
            )
        )
        try:
            outs[spec] = [o.output_token_ids for o in eng.generate(PROMPTS, params)]
        finally:
            eng.close()
    assert outs["ngram"] == outs["none"] and all(len(o) == 24 for o in outs["none"])


def test_every_eos_id_of_generation_config_stops(tmp_path, default_model):
    path = own_model(tmp_path, default_model, "mistral")  # generation_config.json: eos_token_id [2, 7]
    eng = LLMEngine(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=8))
    assert eng.model_config.eos_token_ids == (2, 7)
    free = eng.generate(PROMPTS[0], SamplingParams(max_tokens=24, ignore_eos=True))[0].output_token_ids
    eng.close()
    # make the model's own 3rd token an EOS id: generation stops there, with finish_reason stop
    stop_at = free[2]
    (path / "generation_config.json").write_text(f'{{"eos_token_id": [2, {stop_at}]}}')
    eng = LLMEngine(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=8))
    out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=24))[0]
    eng.close()
    assert out.finish_reason == "stop" and out.output_token_ids == free[: free.index(stop_at) + 1]


@pytest.mark.parametrize("case", ["llama-llama3", "qwen3"])
def test_heads_trained_for_another_family_speculate_losslessly(tmp_path, default_model, case):
    """``lightspec train-heads`` in smoke size on a family checkpoint: its heads serve, and greedy
    output with them is plain greedy decoding."""
    from lightspec_core.corpus import stdlib_files
    from lightspec_core.training.train_heads import main as train_heads

    path = own_model(tmp_path, default_model, case)
    data = tmp_path / "text"
    data.mkdir()
    for src in stdlib_files()[0][:4]:
        (data / src.name).write_text(src.read_text(encoding="utf-8", errors="replace"))
    heads = tmp_path / "heads"
    argv = [
        "--model",
        str(path),
        "--data",
        str(data),
        "--out",
        str(heads),
        "--steps",
        "3",
        "--seq",
        "32",
        "--batch",
        "4",
        "--continuations",
        "4",
        "--eval-windows",
        "4",
        "--quiet",
    ]
    assert train_heads(argv) == 0
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for spec, policy in (("none", "off"), ("mtp", "static:4")):
        eng = LLMEngine(
            EngineConfig(
                model_dir=str(path), mtp_dir=str(heads), speculation=spec, policy=policy, num_kv_blocks=32, block_size=8
            )
        )
        try:
            res = eng.generate(PROMPTS, params)
        finally:
            eng.close()
        outs[spec] = [o.output_token_ids for o in res]
        drafted = sum(o.num_draft_tokens for o in res)
    assert drafted > 0 and outs["mtp"] == outs["none"]


def test_a_draft_model_with_another_vocabulary_is_refused_naming_draft_dir(tmp_path, default_model):
    target = own_model(tmp_path, default_model, "qwen3")
    model_type, overrides, how = CASES["llama-linear"]
    draft = save_hf_checkpoint(tmp_path / "draft", model_type, overrides, **how)  # 256 ids, not 4096
    with pytest.raises(ValueError, match=r"draft_dir=.*the draft model's vocabulary differs from the target's"):
        LLMEngine(
            EngineConfig(
                model_dir=str(target), draft_dir=str(draft), speculation="draft", num_kv_blocks=32, block_size=8
            )
        )
    same = own_model(tmp_path / "same", default_model, "llama-linear")  # the target's tokenizer: accepted
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(target),
            draft_dir=str(same),
            speculation="draft",
            policy="static:2",
            num_kv_blocks=32,
            block_size=8,
        )
    )
    eng.close()


def test_a_draft_with_fewer_padding_rows_than_the_target_speculates_losslessly(tmp_path, default_model):
    """Qwen2.5's small models pad the same tokenizer to fewer rows than its large ones: such a draft
    serves; one with more rows than the target (ids the target has no row for) is refused."""
    target = save_hf_checkpoint(tmp_path / "target", "llama", {"vocab_size": 4160})  # 4096 tokens, padded
    shutil.copy(default_model / "target" / "tokenizer.json", target / "tokenizer.json")
    draft = own_model(tmp_path / "small", default_model, "llama-linear")  # the same tokens, 4096 rows
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    sampled = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=1.0, seed=s) for s in range(4)]
    outs = {}
    for spec in ("none", "draft"):
        eng = LLMEngine(
            EngineConfig(
                model_dir=str(target),
                draft_dir=str(draft),
                speculation=spec,
                policy="static:2",
                num_kv_blocks=64,
                block_size=8,
            )
        )
        try:
            outs[spec] = [o.output_token_ids for o in eng.generate(PROMPTS, greedy)]
            done = eng.generate([PROMPTS[0]] * 4, sampled)
            assert all(o.finish_reason == "length" and len(o.output_token_ids) == 16 for o in done)
            if spec == "draft":
                assert eng.stats.snapshot()["spec_decode_num_draft_tokens_total"] > 0
        finally:
            eng.close()
    assert outs["draft"] == outs["none"]
    with pytest.raises(ValueError, match=r"draft_dir=.*with the same tokenizer a draft may have fewer padding rows"):
        LLMEngine(
            EngineConfig(
                model_dir=str(draft), draft_dir=str(target), speculation="draft", num_kv_blocks=32, block_size=8
            )
        )


def test_a_sampled_id_past_the_tokenizer_adds_no_text_and_the_step_goes_on(tmp_path, default_model):
    """Qwen2 pads its 151665 tokens to 152064 embedding rows. Here the head scores only two padding
    rows, ``w`` and ``-w``, so greedy decoding picks one of them at every step."""
    from safetensors.torch import load_file, save_file

    path = save_hf_checkpoint(tmp_path / "padded", "llama", {"vocab_size": 4160})  # the tokenizer: 4096 ids
    shutil.copy(default_model / "target" / "tokenizer.json", path / "tokenizer.json")
    state = load_file(path / "model.safetensors")
    head = state["lm_head.weight"]
    w = head[4100].clone()
    head.zero_()
    head[4100], head[4101] = w, -w
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    eng = LLMEngine(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=8))
    try:
        out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    finally:
        eng.close()
    assert out.error is None and out.finish_reason == "length"
    assert set(out.output_token_ids) <= {4100, 4101} and len(out.output_token_ids) == 6 and out.text == ""


def test_a_draft_model_shorter_than_the_served_context_is_refused_naming_draft_dir(tmp_path, default_model):
    target = own_model(tmp_path, default_model, "llama-linear")  # 64 positions
    model_type, overrides, how = CASES["llama-linear"]
    draft = save_hf_checkpoint(
        tmp_path / "draft", model_type, {**overrides, "vocab_size": 4096, "max_position_embeddings": 32}, **how
    )
    shutil.copy(default_model / "target" / "tokenizer.json", draft / "tokenizer.json")
    cfg = EngineConfig(
        model_dir=str(target),
        draft_dir=str(draft),
        speculation="draft",
        policy="static:2",
        num_kv_blocks=32,
        block_size=8,
    )
    with pytest.raises(ValueError, match=r"draft_dir=.*max_position_embeddings=32 .* 64 tokens .* max_model_len"):
        LLMEngine(cfg)
    eng = LLMEngine(dataclasses.replace(cfg, max_model_len=32))  # served within the draft's positions
    try:
        out = eng.generate(PROMPTS[0], SamplingParams(max_tokens=13, ignore_eos=True))[0]  # to position 31
    finally:
        eng.close()
    assert out.error is None and out.finish_reason == "length"


def bos_model(tmp_path, default_model):
    """A Llama checkpoint whose tokenizer.json puts BOS before a text through its post-processor,
    as Llama 3's and Mistral's do (the embedded tokenizer has no post-processor)."""
    path = own_model(tmp_path, default_model, "llama-linear")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[bos]),
    ])  # fmt: skip
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"})
    )
    return path


def test_a_text_prompt_is_encoded_with_the_bos_as_transformers_encodes_it(tmp_path, default_model):
    from transformers import AutoTokenizer

    path = bos_model(tmp_path, default_model)
    hf = AutoTokenizer.from_pretrained(path)
    want, bare = hf(PROMPTS[0]).input_ids, hf(PROMPTS[0], add_special_tokens=False).input_ids
    assert want == [hf.bos_token_id, *bare]  # the checkpoint is what it should be
    params = SamplingParams(max_tokens=2)
    eng = LLMEngine(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=8))
    try:
        assert eng.generate(PROMPTS[0], params)[0].prompt_token_ids == want
        eng.add_request("bare", PROMPTS[0], params, add_special_tokens=False)
        eng.add_request("ids", bare, params, add_special_tokens=True)  # token ids are taken as they are
        assert eng.seqs["bare"].token_ids == eng.seqs["ids"].token_ids == bare
    finally:
        eng.close()


def test_engine_processes_encode_the_prompt_as_the_engine_does(tmp_path, default_model):
    """The parent process encodes the text (its child gets token ids), through EngineShards too."""
    from transformers import AutoTokenizer

    path = bos_model(tmp_path, default_model)
    bare = AutoTokenizer.from_pretrained(path)(PROMPTS[0], add_special_tokens=False).input_ids
    engine = EngineShards(EngineConfig(model_dir=str(path), speculation="none", num_kv_blocks=32, block_size=8), 1,
                          threads=1)  # fmt: skip
    try:
        engine.add_request("bos", PROMPTS[0], SamplingParams(max_tokens=2))
        engine.add_request("bare", PROMPTS[0], SamplingParams(max_tokens=2), add_special_tokens=False)
        steps_until_done(engine)
        assert engine.stats.snapshot()["prompt_tokens_total"] == (len(bare) + 1) + len(bare)
    finally:
        engine.close()
