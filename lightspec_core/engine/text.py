"""A request's text as it streams: stop strings, the tail held back, the delta handed out."""

from __future__ import annotations

from .outputs import RequestDelta
from .sequence import Sequence


def truncate_at_stop(seq: Sequence, new_chars: int) -> bool:
    """Cut the text before the first stop string that its last ``new_chars`` characters completed;
    True if one did. Only a match ending in them counts, as in vLLM: an earlier one was searched for
    when it appeared, or appeared before ``min_tokens`` let a stop string end the request. (A window
    of fixed size instead misses a match followed by more new text than it holds: this tokenizer's
    indentation tokens carry up to 49 characters.)"""
    start = len(seq.text) - new_chars
    hits = [i for s in seq.params.stop if (i := seq.text.find(s, max(0, start - len(s) + 1))) >= 0]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def sendable_chars(seq: Sequence) -> int:
    """Hold back a text tail that could be the start of a stop string, so no text that belongs to
    a stop string is ever streamed. Per stop string, only the tail positions holding its first
    character are tried (``str.find``), so the cost follows the matches, not the string's length
    squared."""
    text = seq.text
    hold = 0
    for s in seq.params.stop:
        tail = text[len(text) - min(len(s) - 1, len(text)) :]
        i = tail.find(s[0])
        while i >= 0:
            if s.startswith(tail[i:]):  # the longest held prefix of s is the earliest match
                hold = max(hold, len(tail) - i)
                break
            i = tail.find(s[0], i + 1)
    return len(text) - hold


def take_delta(seq: Sequence, finished: bool = False, interval: int = 1) -> RequestDelta | None:
    """What the request produced since its last delta (None: nothing new, or, unless finished,
    fewer than ``interval`` new tokens after its first delta), marked as sent."""
    new_ids = seq.output_ids[seq.sent_tokens :]
    if not finished and seq.sent_tokens and len(new_ids) < interval:
        return None
    end = len(seq.text) if finished else sendable_chars(seq)
    new_text = seq.text[seq.sent_chars : end] if end > seq.sent_chars else ""
    if not new_ids and not new_text and not finished:
        return None
    seq.sent_tokens = seq.num_output
    seq.sent_chars = max(seq.sent_chars, end)
    return RequestDelta(
        request_id=seq.request_id,
        new_token_ids=new_ids,
        new_text=new_text,
        finished=finished,
        finish_reason=seq.finish_reason,
        error=seq.error,
        num_prompt_tokens=seq.prompt_len,
        num_output_tokens=seq.num_output,
        num_draft_tokens=seq.num_draft,
        num_accepted_tokens=seq.num_accepted,
        acceptance_histogram=list(seq.accept_hist),
        perf=perf_metrics(seq) if seq.params.return_perf_metrics else None,
    )


def perf_metrics(seq: Sequence) -> tuple[int, int, int, int, int, int, int]:
    """``RequestDelta.perf`` now. As TensorRT-LLM counts them, allocated blocks (new and total: the
    same here) are those the request's tokens hold beyond what the prefix cache supplied, reused ones
    the cache's (none before its first admission): a repeated prompt of 5 blocks gives 1, 1, 4."""
    size = seq.kv_block_size
    allocated = -(-seq.num_tokens // size) - seq.kv_reused_blocks if size else 0
    ns = [
        int(t * 1e9) if t is not None else 0
        for t in (seq.t_arrival, seq.t_scheduled, seq.t_first_token, seq.t_last_token)
    ]
    return (allocated, seq.kv_reused_blocks, allocated, *ns)
