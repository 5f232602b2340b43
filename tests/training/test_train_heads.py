"""``lightspec train-heads`` end to end on the smoke target: what it writes, its budget, resuming,
its errors, and heads that serve losslessly."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest
import torch

from lightspec_core.models.llama import LlamaModel
from lightspec_core.models.mtp_heads import MTPHeads
from lightspec_core.training import loop, run
from lightspec_core.training.checkpoint import load_checkpoint
from lightspec_core.training.train_heads import main

SMALL = ["--seq", "32", "--batch", "4", "--continuations", "8", "--eval-windows", "8", "--quiet"]


def train(smoke_model, text_dir, out, *extra: str) -> int:
    return train_on(smoke_model / "target", text_dir, out, *extra)


def train_on(model, text_dir, out, *extra: str) -> int:
    return main(["--model", str(model), "--data", str(text_dir), "--out", str(out), *SMALL, *extra])


@pytest.fixture(scope="module")
def trained(smoke_model, text_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("heads") / "out"
    assert train(smoke_model, text_dir, out, "--steps", "4", "--draft-vocab", "200") == 0
    return out


def test_the_command_writes_loadable_heads_sized_from_the_target_and_their_evaluation(trained, smoke_model):
    heads = MTPHeads.load(trained)
    target_cfg = json.loads((smoke_model / "target" / "config.json").read_text())
    assert heads.config.num_heads == 4 and heads.config.hidden_size == target_cfg["hidden_size"]
    assert heads.config.intermediate_size == 2 * target_cfg["hidden_size"]
    assert len(heads.draft_vocab) == 200
    report = json.loads((trained / "eval.json").read_text())
    for key in ("head_greedy_acceptance", "continuation_head_agreement"):
        assert len(report[key]) == 4 and all(0.0 <= a <= 1.0 for a in report[key])
    assert report["acceptance_length"] == pytest.approx(1.0 + report["chain_accepted"])
    assert 1.0 <= report["acceptance_length"] <= 5.0
    data = report["data"]
    assert data["files"] == 7 and data["heldout_documents"] >= 1 and data["train_tokens"] > data["heldout_tokens"] > 0
    assert data["continuations"] == 8 and data["heldout_continuations"] == 8


def test_steps_are_honoured_and_recorded_in_the_checkpoint(trained):
    assert json.loads((trained / "eval.json").read_text())["steps"] == 4
    state = load_checkpoint(trained)
    assert state["progress"]["step"] == 4 and state["progress"]["elapsed"] > 0
    assert state["settings"]["draft_vocab"] == 200


def test_the_trained_heads_serve_the_same_greedy_tokens_as_no_speculation(trained, smoke_model):
    from lightspec_core import EngineConfig, LLMEngine, SamplingParams

    prompts = ["def f(x):\n    return", "import json\n", "class A:\n"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    outs = {}
    for spec in ("none", "mtp"):
        engine = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), mtp_dir=str(trained),
                                        speculation=spec, policy="static:4" if spec == "mtp" else "off"))  # fmt: skip
        try:
            outs[spec] = engine.generate(prompts, params)
        finally:
            engine.close()
    assert [o.output_token_ids for o in outs["mtp"]] == [o.output_token_ids for o in outs["none"]]
    assert sum(o.num_draft_tokens for o in outs["mtp"]) > 0  # the heads did draft


def test_a_resumed_run_continues_to_the_parameters_of_an_uninterrupted_one(smoke_model, text_dir, tmp_path,
                                                                           monkeypatch):  # fmt: skip
    assert train(smoke_model, text_dir, tmp_path / "whole", "--steps", "6") == 0
    real_step, calls = loop.HeadTrainer.step, []

    def interrupted_step(self, frac):
        calls.append(frac)
        if len(calls) == 3:  # as Ctrl-C would, mid-step: the step finishes, then the run stops
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self, frac)

    monkeypatch.setattr(loop.HeadTrainer, "step", interrupted_step)
    assert train(smoke_model, text_dir, tmp_path / "parts", "--steps", "6") == 130
    assert load_checkpoint(tmp_path / "parts")["progress"]["step"] == 3
    assert not (tmp_path / "parts" / "mtp.safetensors").exists()
    monkeypatch.setattr(loop.HeadTrainer, "step", real_step)
    assert train(smoke_model, text_dir, tmp_path / "parts", "--steps", "6", "--resume") == 0
    whole, parts = (json.loads((tmp_path / d / "eval.json").read_text()) for d in ("whole", "parts"))
    assert parts["steps"] == whole["steps"] == 6
    assert (tmp_path / "parts/mtp.safetensors").read_bytes() == (tmp_path / "whole/mtp.safetensors").read_bytes()
    assert parts["head_greedy_acceptance"] == whole["head_greedy_acceptance"]
    assert parts["total_seconds"] > load_checkpoint(tmp_path / "parts")["progress"]["train_seconds"]


def bad_model_dirs(smoke_model, tmp_path):
    no_config = tmp_path / "no_config"
    shutil.copytree(smoke_model / "target", no_config)
    (no_config / "config.json").unlink()
    small_vocab = tmp_path / "small_vocab"  # the smoke tokenizer has 512 tokens
    shutil.copytree(smoke_model / "target", small_vocab)
    cfg = json.loads((small_vocab / "config.json").read_text())
    (small_vocab / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    return no_config, small_vocab


def short_heldout_dir(smoke_model, text_dir, tmp_path):
    """Training text, and a held-out document of 8 tokens (its EOS counted): enough for 4 heads by
    the old rule (heads + 3), too few to evaluate them (a window of 2 * heads + 1 and one more)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smoke_model / "target" / "tokenizer.json"))
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "in", "the", "warm", "sun"]
    texts = (" ".join(words[:n]) for n in range(1, len(words)))
    held = next(t for t in texts if len(tok.encode(t, add_special_tokens=False).ids) + 1 == 8)
    d = tmp_path / "short_heldout"
    d.mkdir()
    (d / "a.py").write_text("\n".join(p.read_text() for p in sorted(text_dir.glob("*.py"))))
    (d / "b.py").write_text(held)  # the last document: the held-out one
    return d


@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("empty data", ["--data", "no text files"]),
        ("missing data", ["--data", "no such file"]),
        ("no config", ["--model", "config.json"]),
        ("small vocab", ["--model", "tokenizer.json", "512", "vocab_size 300"]),
        ("no heads", ["--heads 0"]),
        ("no budget", ["--minutes", "--steps"]),
        ("resume nothing", ["--resume", "checkpoint.pt"]),
        ("windows too short to evaluate", ["--seq 8", "2 * heads + 1 = 9"]),
        ("windows past the context", ["--seq", "max_position_embeddings"]),
        ("no evaluation windows", ["--eval-windows 0", ">= 1"]),
        ("held-out text too short", ["--data", "8 held-out tokens", "4 heads", "need 10"]),
    ],
)
def test_bad_input_fails_naming_the_option(smoke_model, text_dir, tmp_path, capsys, case, named):
    no_config, small_vocab = bad_model_dirs(smoke_model, tmp_path)
    (tmp_path / "empty").mkdir()
    positions = json.loads((smoke_model / "target" / "config.json").read_text())["max_position_embeddings"]
    model, data, extra = smoke_model / "target", text_dir, ["--steps", "1"]
    if case == "empty data":
        data = tmp_path / "empty"
    elif case == "missing data":
        data = tmp_path / "missing"
    elif case in ("no config", "small vocab"):
        model = no_config if case == "no config" else small_vocab
    elif case == "held-out text too short":
        data = short_heldout_dir(smoke_model, text_dir, tmp_path)
    elif case == "no budget":
        extra = []
    else:
        extra += {"no heads": ["--heads", "0"], "resume nothing": ["--resume"],
                  "windows too short to evaluate": ["--seq", "8"],
                  "windows past the context": ["--seq", str(positions + 1)],
                  "no evaluation windows": ["--eval-windows", "0"]}[case]  # fmt: skip
    argv = ["--model", str(model), "--data", str(data), "--out", str(tmp_path / "out"), *SMALL, *extra]
    assert main(argv) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightspec train-heads: ") and all(w in last for w in named), last


def test_a_finished_run_is_neither_overwritten_nor_resumed_with_other_settings(trained, smoke_model, text_dir, capsys):
    assert train(smoke_model, text_dir, trained, "--steps", "4") == 2
    err = capsys.readouterr().err
    assert "--out" in err and "add --resume" in err
    assert train(smoke_model, text_dir, trained, "--steps", "4", "--resume", "--heads", "2") == 2
    assert "--heads 2: the checkpoint in --out was trained with --heads 4" in capsys.readouterr().err


def test_the_lightspec_command_hands_train_heads_its_arguments(smoke_model, tmp_path, capsys):
    from lightspec_backend import cli

    assert cli.main(["train-heads", "--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                     "--steps", "1"]) == 2  # fmt: skip
    assert "--model" in capsys.readouterr().err


def test_the_heads_are_written_before_their_evaluation(smoke_model, text_dir, tmp_path, monkeypatch):
    """A budget's training is not lost to a failing evaluation."""

    def failing(*args, **kwargs):
        raise RuntimeError("the evaluation failed")

    monkeypatch.setattr(run, "chain_acceptance", failing)
    with pytest.raises(RuntimeError, match="the evaluation failed"):
        train(smoke_model, text_dir, tmp_path / "out", "--steps", "1")
    assert MTPHeads.load(tmp_path / "out").config.num_heads == 4


def test_a_mistral_whose_attention_window_is_shorter_than_its_positions_trains(smoke_model, text_dir, tmp_path,
                                                                              capsys):  # fmt: skip
    """transformers' default MistralConfig: sliding_window 4096, max_position_embeddings 32768. The
    windows training uses are far shorter than the attention window, so the model is exact there."""
    from tests.models.factories import save_hf_checkpoint

    model = save_hf_checkpoint(tmp_path / "mistral", "mistral", {"vocab_size": 512, "max_position_embeddings": 32768,
                                                                   "sliding_window": 4096})  # fmt: skip
    shutil.copy(smoke_model / "target" / "tokenizer.json", model / "tokenizer.json")
    argv = ["--model", str(model), "--data", str(text_dir), *SMALL, "--steps", "2"]
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert MTPHeads.load(tmp_path / "out").config.num_heads == 4
    assert json.loads((tmp_path / "out" / "eval.json").read_text())["steps"] == 2
    capsys.readouterr()
    # a window past the attention window is refused, naming the option that sets it
    assert main([*argv, "--out", str(tmp_path / "long"), "--seq", "4097"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("lightspec train-heads: --seq 4097: must be <= the model's sliding_window 4096"), last


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none here)")
def test_a_run_on_a_cuda_device_trains_evaluates_and_writes_the_heads(smoke_model, text_dir, tmp_path):
    assert train(smoke_model, text_dir, tmp_path / "out", "--steps", "1", "--device", "cuda") == 0
    assert MTPHeads.load(tmp_path / "out").config.num_heads == 4
    report = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert report["steps"] == 1 and all(0.0 <= a <= 1.0 for a in report["head_greedy_acceptance"])


def test_every_window_the_heads_learn_and_are_judged_on_starts_with_the_bos_serving_puts_first(bos_model, text_dir,
                                                                                                tmp_path, monkeypatch):  # fmt: skip
    """A Llama-style tokenizer puts <s> before every served prompt: the target's hidden states the
    heads learn from, and are evaluated on, are the ones that follow it."""
    seen = []
    real_loss, real_eval = loop.distill_loss, run.head_acceptance
    monkeypatch.setattr(loop, "distill_loss", lambda mtp, target, x, vocab=None: seen.append(x) or
                        real_loss(mtp, target, x, vocab))  # fmt: skip
    monkeypatch.setattr(run, "head_acceptance", lambda target, mtp, w: seen.append(w) or real_eval(target, mtp, w))
    assert train_on(bos_model, text_dir, tmp_path / "out", "--steps", "2") == 0
    state = load_checkpoint(tmp_path / "out")
    assert len(seen) == 3  # two steps' batches (text and continuations), the evaluation's text windows
    for windows in (*seen, state["generated"], state["heldout_windows"]):
        assert windows[:, 0].eq(1).all(), windows[:, :3]


@pytest.fixture(scope="module")
def wide_model(smoke_model, tmp_path_factory):
    """A target with the smoke tokenizer and twice its hidden size."""
    from tests.models.factories import save_hf_checkpoint

    d = save_hf_checkpoint(tmp_path_factory.mktemp("wide") / "target", "llama",
                           {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256})  # fmt: skip
    shutil.copy(smoke_model / "target" / "tokenizer.json", d / "tokenizer.json")
    return d


def retrained_model(smoke_model, tmp_path):
    """The smoke target's config and tokenizer, other weights (a fine-tune's case)."""
    d = tmp_path / "retrained"
    shutil.copytree(smoke_model / "target", d)
    model = LlamaModel.load(d)
    with torch.no_grad():
        model.model.norm.weight.mul_(1.5)
    model.save(d)
    return d


def forbidden(*args, **kwargs):
    raise AssertionError("the target's weights were loaded: the refusal must come first")


@pytest.mark.parametrize(("other", "named"), [("wide", "hidden_size 64 in the checkpoint, 128 in --model"),
                                              ("retrained", "weights differ"),
                                              ("tokenizer", "tokenizer.json differ")])  # fmt: skip
def test_resuming_for_another_target_is_refused_before_training_naming_what_differs(
    trained, smoke_model, wide_model, bos_model, text_dir, tmp_path, monkeypatch, capsys, other, named
):
    model = {"wide": wide_model, "tokenizer": bos_model}.get(other) or retrained_model(smoke_model, tmp_path)
    shutil.copytree(trained, tmp_path / "out")
    monkeypatch.setattr(run, "load_target", forbidden)
    assert train_on(model, text_dir, tmp_path / "out", "--steps", "5", "--resume") == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"lightspec train-heads: --resume: the checkpoint in --out was trained for another "
                           f"target ({(smoke_model / 'target').resolve()}) than --model {model}: "), last  # fmt: skip
    assert named in last, last


def test_a_copy_of_the_target_elsewhere_is_the_same_target_and_resumes(trained, smoke_model, text_dir, tmp_path):
    shutil.copytree(smoke_model / "target", tmp_path / "copy")
    shutil.copytree(trained, tmp_path / "out")
    assert train_on(tmp_path / "copy", text_dir, tmp_path / "out", "--steps", "5", "--resume") == 0
    assert load_checkpoint(tmp_path / "out")["progress"]["step"] == 5


def test_a_checkpoint_that_records_no_target_resumes_on_a_target_its_heads_fit_and_records_it(
    trained, smoke_model, wide_model, text_dir, tmp_path, capsys
):
    """Checkpoints of the first format, written before the target was recorded: the heads' shapes
    are checked, and the run records its target from then on."""
    shutil.copytree(trained, tmp_path / "out")
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    state.pop("target", None)
    torch.save({**state, "format": 1}, tmp_path / "out" / "checkpoint.pt")
    assert train_on(wide_model, text_dir, tmp_path / "out", "--steps", "5", "--resume") == 2
    assert "hidden_size 64 in the checkpoint, 128 in --model" in capsys.readouterr().err
    assert train_on(smoke_model / "target", text_dir, tmp_path / "out", "--steps", "5", "--resume") == 0
    state = load_checkpoint(tmp_path / "out")
    assert state["format"] == 2 and state["progress"]["step"] == 5
    assert state["target"]["model"] == str((smoke_model / "target").resolve())


def test_a_checkpoint_whose_continuations_lack_the_bos_generates_them_again(bos_model, text_dir, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    """Format-1 checkpoints saved continuations that started anywhere; resumed for a tokenizer with
    a BOS, they would mix with the BOS-led text windows: they are generated again, and the run says so."""
    assert train_on(bos_model, text_dir, tmp_path / "out", "--steps", "2") == 0
    state = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)
    for key in ("generated", "heldout_windows"):
        assert state[key][:, 0].eq(1).all()
        state[key] = state[key].roll(-1, dims=1)  # the same length, no BOS in front
    state.pop("target")
    torch.save({**state, "format": 1}, tmp_path / "out" / "checkpoint.pt")
    said = []
    monkeypatch.setattr(run, "say", lambda args, msg: said.append(msg))  # the runs here are --quiet
    assert train_on(bos_model, text_dir, tmp_path / "out", "--steps", "3", "--resume") == 0
    assert any("do not start with the tokenizer's [1] (an earlier format): generating them again" in m for m in said)
    resumed = load_checkpoint(tmp_path / "out")
    assert resumed["progress"]["step"] == 3
    for key in ("generated", "heldout_windows"):
        assert resumed[key].shape == state[key].shape and resumed[key][:, 0].eq(1).all(), key
