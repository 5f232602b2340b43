"""What the engine hands back: a delta per request per step, and a whole output at the end."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """New tokens of one request produced by one ``LLMEngine.step()``.

    ``new_text`` never splits a UTF-8 character; ``finished`` is set exactly once, on the request's
    last delta, with ``finish_reason`` one of ``length``, ``stop``, ``cancelled``, ``error``.
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [j]: the request's verify steps with drafts that accepted exactly j (cumulative, like the counts)
    acceptance_histogram: list[int] = field(default_factory=list)
    # with SamplingParams.return_perf_metrics, TensorRT-LLM's request perf metrics so far: KV blocks
    # (newly allocated, reused from the prefix cache, allocated in total) and the times of arrival, first scheduling, first
    # and last token in ns of CLOCK_MONOTONIC (TensorRT-LLM's steady clock; 0: not yet)
    perf: tuple[int, int, int, int, int, int, int] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_steps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
