"""Chat templates render as transformers' ``apply_chat_template`` renders them."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from lightspec_backend.openai_api.chat_template import load_template, render_chat
from lightspec_backend.openai_api.errors import OpenAIError

# A Llama-2-style template: bos_token, a system message folded into the first turn,
# raise_exception on a bad order, whitespace control, and a generation prompt.
TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set sys = '' %}{% endif %}\n"
    "{% for m in messages %}\n"
    "  {% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}\n"
    "  {% if m['role'] == 'user' %}<|user|>{% if loop.first and sys %}[{{ sys }}] {% endif %}"
    "{{ m['content'] | trim }}\n{% else %}<|assistant|>{{ m['content'] }}{{ eos_token }}\n{% endif %}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MESSAGES = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "  def fib(n):  "},
    {"role": "assistant", "content": "return n"},
    {"role": "user", "content": "again"},
]


def chat_checkpoint(src: Path, dst: Path, template: str = TEMPLATE) -> Path:
    """A copy of the checkpoint in ``src`` whose tokenizer transformers saved with ``template``
    (``save_pretrained`` writes it as chat_template.jinja)."""
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(src, dst)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(src / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok.chat_template = template
    tok.save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, default_model) -> Path:
    return chat_checkpoint(default_model / "target", tmp_path_factory.mktemp("chat") / "target")


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendering_equals_transformers(checkpoint, add_generation_prompt):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert render_chat(checkpoint, MESSAGES, add_generation_prompt) == want
    assert want.startswith("<s><|user|>[be brief] def fib(n):\n")  # the template did its work


def test_template_errors_are_a_400_with_its_message(checkpoint):
    with pytest.raises(OpenAIError, match="roles must alternate") as e:
        render_chat(checkpoint, [{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages"


def test_tokenizer_config_templates_string_and_named_list(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0].content }}!"}))
    assert render_chat(tmp_path / "a", [{"role": "user", "content": "hi"}]) == "hi!"
    (tmp_path / "b").mkdir()
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ eos_token }}"}]
    (tmp_path / "b" / "tokenizer_config.json").write_text(json.dumps({"chat_template": named, "eos_token": "</s>"}))
    assert load_template(str(tmp_path / "b"))[0] == "D{{ eos_token }}"
    assert render_chat(tmp_path / "b", [{"role": "user", "content": "hi"}]) == "D</s>"


def test_a_checkpoint_without_a_template_is_a_400_naming_it(default_model):
    with pytest.raises(OpenAIError) as e:
        render_chat(default_model / "target", [{"role": "user", "content": "hi"}])
    assert e.value.status == 400 and "no chat template" in e.value.message and e.value.code == "missing_chat_template"


def test_chat_template_kwargs_override_the_special_tokens_as_transformers(checkpoint):
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True, bos_token="<B>", eos_token="<E>"
    )
    got = render_chat(checkpoint, MESSAGES, True, False, {"bos_token": "<B>", "eos_token": "<E>"})
    assert got == want and got.startswith("<B><|user|>") and "return n<E>" in got


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt"])
def test_request_fields_in_chat_template_kwargs_are_a_400_naming_the_field_to_use(checkpoint, key):
    with pytest.raises(OpenAIError) as e:
        render_chat(checkpoint, MESSAGES, True, False, {key: []})
    assert e.value.status == 400 and e.value.param == f"chat_template_kwargs.{key}"
    assert e.value.message.startswith(f"chat_template_kwargs.{key}: use the request's own {key} field")


# transformers marks the assistant's tokens with {% generation %}; what is set inside stays inside
GENERATION_TEMPLATE = (
    "{% set tag = 'outer' %}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "{% generation %}{% set tag = 'inner' %}[{{ m['content'] }}|{{ tag }}]{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}{% endfor %}{{ tag }}"
)


def test_generation_blocks_render_their_body_as_transformers(tmp_path, default_model):
    from transformers import AutoTokenizer

    ckpt = chat_checkpoint(default_model / "target", tmp_path / "target", GENERATION_TEMPLATE)
    want = AutoTokenizer.from_pretrained(ckpt).apply_chat_template(MESSAGES[1:], tokenize=False)
    assert render_chat(ckpt, MESSAGES[1:]) == want == "  def fib(n):  [return n|inner]againouter"
