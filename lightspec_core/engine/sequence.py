"""Request state. Speculation is "more tokens to catch up": a step feeds
``token_ids[num_computed:]`` plus k drafts; a rejection is a rollback of ``num_computed``.

Invariant while decoding: ``num_computed == len(token_ids) - 1`` (the newest token's K/V is written
by the next step, which also verifies the drafts that follow it).
"""

from __future__ import annotations

import time
from enum import Enum

import numpy as np

from ..config import SamplingParams
from ..models.tokenizer import IncrementalDetokenizer, TokenizerInfo
from ..spec.sampling import keyed_noise


def checked_prompt(
    tok: TokenizerInfo,
    vocab: int,
    max_model_len: int,
    prompt: str | list[int],
    params: SamplingParams,
    add_special_tokens: bool = True,
) -> list[int]:
    """The prompt's token ids, or a ``ValueError`` naming ``prompt``, ``max_tokens``, ``min_tokens``
    or ``end_id`` (checked here, not at its first use inside a batched step, which would fail the
    whole batch).
    A text prompt is encoded with the tokenizer's special tokens (BOS) unless ``add_special_tokens``
    is false (a rendered chat template holds them already); token ids are taken as they are."""
    if params.end_id is not None and not 0 <= params.end_id < vocab:
        raise ValueError(f"end_id={params.end_id}: must be a token id in [0, {vocab})")
    ids = tok.encode(prompt, add_special_tokens) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise ValueError("prompt: empty prompt")
    if any(t < 0 or t >= vocab for t in ids):
        raise ValueError(f"prompt: token ids must be in [0, {vocab})")
    if len(ids) >= max_model_len:
        raise ValueError(f"prompt: {len(ids)} tokens, the context holds {max_model_len}")
    if params.max_tokens is None and params.min_tokens > max_model_len - len(ids):
        raise ValueError(
            f"min_tokens={params.min_tokens}: the context of {max_model_len} tokens leaves "
            f"{max_model_len - len(ids)} after the prompt ({len(ids)} tokens)"
        )
    if params.max_tokens is not None and len(ids) + params.max_tokens > max_model_len:
        raise ValueError(
            f"max_tokens={params.max_tokens}: prompt ({len(ids)} tokens) + max_tokens exceeds the "
            f"context of {max_model_len} tokens"
        )
    return ids


class Status(Enum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


class Sequence:
    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        detok: IncrementalDetokenizer,
        seed: int,
        arrival: int,
        arrived_at: float | None = None,
    ):
        self.request_id = request_id
        self.params = params
        self.prompt_len = len(prompt_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.reset_for_recompute()  # what a preemption forgets: computed tokens, proposers' inputs
        self.arrival = arrival  # monotonically increasing admission order
        self.rng = np.random.default_rng(params.seed if params.seed is not None else seed)
        self._noise: dict[int, np.ndarray] = {}  # output position -> its noise (see noise)
        self.detok = detok
        self.text = ""
        self.sent_tokens = 0  # output tokens already reported in a delta
        self.sent_chars = 0
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.aborted = False
        self.abort_error: str | None = None  # aborted as a failure (see LLMEngine.abort)
        # speculation state beside reset_for_recompute's
        self.fused_at = -1  # fused MTP: fused_ids are valid while the sequence has this many tokens
        self.ngram_index = None  # the n-gram proposer's incremental index of token_ids (NgramIndex)
        self.num_draft = 0
        self.num_accepted = 0
        self.num_steps = 0
        self.admitted = False  # once: a recompute after preemption is not another prefix-cache query
        # set at the first admission: the blocks the prefix cache supplied, and the pool's block size
        self.kv_reused_blocks = 0
        self.kv_block_size = 0
        self.accept_hist: list[int] = []  # [j]: verify steps with drafts that accepted exactly j of them
        # per draft position j, decayed counts: times j was reached (drafts < j all accepted) and
        # times it was accepted; their ratio is the conditional acceptance rate the policy uses
        self.pos_reached: list[float] = []
        self.pos_accepted: list[float] = []
        # fixed per request, read by the scheduler's per-step pass: the draft depth the request asked
        # for at most, its length when max_tokens is reached, and whether it samples
        self.draft_cap_asked = params.num_draft_tokens if params.num_draft_tokens is not None else 1 << 30
        # the most drafts the proposer holds for the next step (fused MTP: those the target stage
        # returned); the policy grants no more
        self.draft_room = 1 << 30
        self.end_len = self.prompt_len + params.max_tokens
        self.sampled = not params.greedy
        # timing
        # when the server took the request (``time.perf_counter``: CLOCK_MONOTONIC, the same clock
        # in every process), so a wait for the step in progress counts in its queue time and TTFT
        self.t_arrival = time.perf_counter() if arrived_at is None else arrived_at
        self.t_scheduled: float | None = None  # first admitted to a step (queue time ends)
        self.t_first_token: float | None = None
        self.t_last_token: float | None = None

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    def noise(self, offset: int, vocab: int) -> np.ndarray:
        """A seeded request's ``keyed_noise`` for output position ``num_output + offset``: fp32 [vocab].
        Kept until that position is decoded: a step's proposer draws its drafts with it, and its
        verification races the target with the same rows (at a large vocabulary a row costs ~1 ms)."""
        pos = self.num_output + offset
        row = self._noise.get(pos)
        if row is None or len(row) < vocab:
            self._noise = {p: r for p, r in self._noise.items() if p >= self.num_output}
            row = self._noise[pos] = keyed_noise(self.params.seed, pos, vocab)
        return row[:vocab]

    @property
    def masks_end(self) -> bool:
        """The next token may not be an end token yet (``min_tokens`` not reached)."""
        return self.num_output < self.params.min_tokens

    @property
    def needs_logits(self) -> bool:
        """This step's target rows must come back as logits: to sample, or to mask the end tokens."""
        return not self.params.greedy or self.masks_end

    @property
    def is_decoding(self) -> bool:
        return self.num_computed == len(self.token_ids) - 1

    @property
    def sort_key(self) -> tuple[int, int]:
        # higher priority first, then first come first served
        return (-self.params.priority, self.arrival)

    def draft_cap(self, engine_k: int) -> int:
        # drafts beyond max_tokens - 1 can never be emitted (the bonus token always comes too); the
        # scheduler's per-step pass computes the same from these fields for many requests at once
        return max(0, min(engine_k, self.draft_cap_asked, self.end_len - len(self.token_ids) - 1))

    def record_acceptance(self, drafted: int, accepted: int, decay: float = 0.9) -> None:
        self.num_draft += drafted
        self.num_accepted += accepted
        if drafted == 0:
            return
        while len(self.accept_hist) <= accepted:
            self.accept_hist.append(0)
        self.accept_hist[accepted] += 1
        while len(self.pos_reached) < drafted:
            self.pos_reached.append(0.0)
            self.pos_accepted.append(0.0)
        for j in range(len(self.pos_reached)):
            self.pos_reached[j] *= decay
            self.pos_accepted[j] *= decay
        for j in range(min(drafted, accepted + 1)):
            self.pos_reached[j] += 1.0
            if j < accepted:
                self.pos_accepted[j] += 1.0

    def reset_for_recompute(self) -> None:
        self.num_computed = 0
        self.draft_computed = 0  # tokens whose K/V the draft model holds
        self.last_hidden: np.ndarray | None = None  # target hidden at the last verified position
        # fused MTP: the drafts the target stage proposed for the next step (see ModelCall.mtp_drafts)
        self.fused_ids: list[int] | None = None
        self.fused_conf: list[float] | None = None
        self.warm = False  # a sampled step completed since (re)admission: proposers have their inputs
        self.status = Status.WAITING
