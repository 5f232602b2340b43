"""The OpenAI request bodies LightSpec accepts, as pydantic models.

Every field the OpenAI API defines for ``/v1/completions`` and ``/v1/chat/completions`` is accepted
by name. Fields LightSpec honours are used; fields that change nothing at their neutral value
(``frequency_penalty=0``, ``user``, ``metadata``) are ignored; a field set to a value LightSpec
cannot honour (``logprobs``, tools) is refused with a 400 naming it, and so is a field the
API does not define. A few extensions that vLLM's server also takes (``top_k``, ``ignore_eos``,
``min_tokens``, ``stream_interval``, ``add_special_tokens``) and LightSpec's own ``num_draft_tokens``
and ``priority`` are accepted too, and vLLM's other sampling extensions at their neutral value. ``add_special_tokens`` has vLLM's defaults: true for a completion's
text prompt (the tokenizer's BOS is added), false for chat (the rendered template holds it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..conventions import NEUTRAL_KEYS
from .errors import OpenAIError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's SSE padding; LightSpec sends none
    continuous_usage_stats: bool = False  # vLLM's extension: cumulative usage on every chunk


class _Common(BaseModel):
    """Fields both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM's names, and LightSpec's per-request speculation cap and priority)
    top_k: int | None = None
    ignore_eos: bool | None = None
    num_draft_tokens: int | None = None
    priority: int | None = None
    stream_interval: int | None = None
    min_tokens: int | None = None
    # vLLM's sampling extensions that LightSpec takes at their neutral value only, as its Triton
    # side does (conventions.NEUTRAL_KEYS): vLLM's own benchmark client sends repetition_penalty 1
    repetition_penalty: float | None = None
    min_p: float | None = None
    use_beam_search: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None

    def refuse_unsupported(self) -> None:
        """Raise a 400 naming the first field set to a value LightSpec cannot honour."""
        for name in _VLLM_NEUTRAL:
            value = getattr(self, name)
            if value is not None and value != NEUTRAL_KEYS[name]:
                raise OpenAIError(f"{name}={value!r}: not supported (only {NEUTRAL_KEYS[name]!r})", param=name)
        if self.n is not None and self.n < 1:
            raise OpenAIError(f"n={self.n}: must be at least 1", param="n")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise OpenAIError(f"{name}: not supported (only 0)", param=name)
        if self.logit_bias:
            raise OpenAIError("logit_bias: not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options: only allowed when stream is true", param="stream_options")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


# the vLLM extensions above (n, the penalties and logit_bias are OpenAI's, checked by name)
_VLLM_NEUTRAL = tuple(
    name
    for name in NEUTRAL_KEYS
    if name in _Common.model_fields and name not in ("n", "presence_penalty", "frequency_penalty", "logit_bias")
)

# OpenAI's documented default for /v1/completions; chat leaves the length to the engine's default
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's extension and default

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs is not None:
            raise OpenAIError("logprobs: not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise OpenAIError(f"best_of={self.best_of}: only 1 is supported", param="best_of")
        if self.echo:
            raise OpenAIError("echo: not supported", param="echo")
        if self.suffix:
            raise OpenAIError("suffix: not supported", param="suffix")

    def prompts(self) -> list[str | list[int]]:
        """The prompts this request carries, each text or token ids: one, or a batch."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise OpenAIError("prompt: an empty list", param="prompt")
        if all(isinstance(t, int) for t in p):
            return [list(p)]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template as they are
    role: str
    content: str | list[ContentPart] | None = None

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as a chat template sees it (text parts joined by newlines; other parts refused)."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            for part in self.content:
                if part.type != "text":
                    raise OpenAIError(
                        f"messages[{index}].content: part type {part.type!r} not supported (text only)",
                        param=f"messages[{index}].content",
                    )
            msg["content"] = "\n".join(part.text or "" for part in self.content)  # as vLLM joins them
        return msg


class ChatCompletionRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # vLLM's extensions for the template, and for tokenizing the rendered prompt
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool = False  # the template writes bos_token itself

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.logprobs or self.top_logprobs:  # top_logprobs 0 without logprobs asks for nothing
            name = "logprobs" if self.logprobs else "top_logprobs"
            raise OpenAIError(f"{name}: not supported", param=name)
        if self.response_format not in (None, {"type": "text"}):
            raise OpenAIError("response_format: only {'type': 'text'} is supported", param="response_format")
        for name in ("tools", "functions", "audio", "prediction", "web_search_options"):
            if getattr(self, name):
                raise OpenAIError(f"{name}: not supported", param=name)
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise OpenAIError(f"{name}: not supported (only 'none')", param=name)
        if self.modalities not in (None, ["text"]):
            raise OpenAIError("modalities: only ['text'] is supported", param="modalities")
        if self.reasoning_effort is not None:
            raise OpenAIError("reasoning_effort: not supported", param="reasoning_effort")

    @property
    def length_limit(self) -> tuple[str, int] | None:
        """(field name, value) of the requested completion length, if any; ``max_completion_tokens``
        wins over the deprecated ``max_tokens`` when a client sends both, as in vLLM."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return ("max_tokens", self.max_tokens) if self.max_tokens is not None else None


Endpoint = Literal["completions", "chat"]
