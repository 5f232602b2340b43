"""A checkpoint's chat template, rendered with transformers' semantics.

The template comes from where transformers looks for it: ``chat_template.jinja`` beside the
tokenizer (what ``save_pretrained`` writes), else ``tokenizer_config.json``'s ``chat_template`` (a
string, or a list of named templates of which ``default`` is used). It is rendered in a sandboxed
Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``raise_exception`` and
``strftime_now`` globals, a ``tojson`` that does not escape HTML, the ``{% generation %}`` block
(rendered as its body), and the tokenizer's special tokens (``bos_token``, ``eos_token``, ...) as
variables, which a request's ``chat_template_kwargs`` override, as ``apply_chat_template`` does.
The rendered text is the prompt; Triton tokenizes it without adding special tokens (the template
has them already).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from .errors import OpenAIError

# template variables the request sets through its own fields, not through chat_template_kwargs
_REQUEST_FIELDS = ("messages", "add_generation_prompt")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _token_text(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken as tokenizer_config.json stores it
        return value.get("content")
    return value if isinstance(value, str) else None


@lru_cache(maxsize=8)
def load_template(model_dir: str) -> tuple[str | None, dict[str, str]]:
    """(template source or ``None``, special-token variables) of the checkpoint in ``model_dir``."""
    root = Path(model_dir)
    config_path = root / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokens = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(), tokens
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return (template if isinstance(template, str) and template else None), tokens


def _generation_extension():
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``: transformers marks the assistant's part of a
        conversation with it (for ``return_assistant_tokens_mask``); a prompt needs only the body,
        in a scope of its own as transformers' block has."""

        tags = frozenset({"generation"})

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body, lineno=lineno)

    return Generation


@lru_cache(maxsize=8)
def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _generation_extension()]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


def render_chat(
    model_dir: Path | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt text for ``messages``. ``chat_template_kwargs``: the request's extra template
    variables (they override the special tokens). A checkpoint without a chat template, or a
    template that raises, is a 400 naming the cause."""
    variables = dict(chat_template_kwargs or {})
    for key in _REQUEST_FIELDS:
        if key in variables:
            raise OpenAIError(
                f"chat_template_kwargs.{key}: use the request's own {key} field instead",
                param=f"chat_template_kwargs.{key}",
            )
    if model_dir is None:
        raise OpenAIError(
            "messages: the model's checkpoint directory is unknown, so its chat template cannot be read "
            "(start the API with --model-dir)",
            param="messages",
        )
    source, tokens = load_template(str(model_dir))
    if source is None:
        raise OpenAIError(
            f"messages: the model has no chat template (no chat_template in {model_dir}/tokenizer_config.json "
            "and no chat_template.jinja); use /v1/completions",
            param="messages",
            code="missing_chat_template",
        )
    if continue_final_message and add_generation_prompt:
        raise OpenAIError(
            "continue_final_message: cannot be combined with add_generation_prompt", param="continue_final_message"
        )
    import jinja2

    try:
        text = _compile(source).render(
            {**tokens, **variables}, messages=messages, add_generation_prompt=add_generation_prompt
        )
    except jinja2.exceptions.TemplateError as e:
        raise OpenAIError(f"messages: the chat template refused the conversation: {e}", param="messages") from None
    if continue_final_message:
        # as transformers does: cut the text right after the final message's content
        final = str(messages[-1].get("content") or "").strip()
        if final and final in text:
            text = text[: text.rindex(final) + len(final)]
    return text
