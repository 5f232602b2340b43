"""Continuous batching with chunked prefill, priorities, recompute preemption and per-request
speculation depth. Never touches tensors.

Each ``schedule()`` builds one :class:`StepPlan`:

1. running requests (priority order): a decoding request feeds its newest token; a prefilling one
   feeds the next chunk of its prompt within the step's token budget. If the KV pool is short, the
   lowest-priority running request not yet in the plan is preempted (its blocks are freed; it is
   recomputed from its tokens later), so the pool can never deadlock. A request whose only victim
   would be itself waits instead while another micro-batch in flight holds blocks: that batch
   comes back and either frees them or preempts it;
2. waiting requests are admitted by priority while budget, ``max_num_seqs`` and blocks allow, in a
   step that preempted nobody (as in vLLM: a preempted request admitted again at once would take
   back the blocks just freed, and two requests could take turns preempting each other forever);
3. the speculation policy picks k_i for the decoding requests, under the remaining token budget and
   the KV headroom (above the high-water mark drafts only use slots already allocated); lookahead
   blocks for the drafts are then reserved.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from ..spec.acceptance import ALPHA_STRENGTH, AcceptanceStats, request_alphas
from ..spec.policy import SMALL_SLOTS, PolicyBatch
from .block_manager import BlockManager
from .sequence import Sequence, Status

EXPLORE_EVERY = 16  # every 16th step of a request ignores the policy's gain floor


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int  # known tokens fed this step (a prefill chunk, or 1 when decoding)
    k: int = 0  # draft slots reserved this step
    samples: bool = False  # the chunk reaches the newest token: outputs are sampled/verified
    min_gain: float = 0.0  # least cumulative acceptance probability worth a draft (0: keep all k)

    @property
    def start(self) -> int:
        return self.seq.num_computed


@dataclass
class StepPlan:
    items: list[ScheduledSeq] = field(default_factory=list)
    decision_seconds: float = 0.0  # wall time of schedule()
    decision_cpu_seconds: float = 0.0  # CPU time of this thread in it: the wall time less GIL waits and preemption
    prefill_tokens: int = 0  # tokens of prompt chunks (requests not yet decoding); the rest decode

    @property
    def ks(self) -> list[int]:
        return [it.k for it in self.items if it.samples]


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        policy,
        acceptance: AcceptanceStats,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_draft_tokens: int,
        kv_high_water: float,
        speculative: bool,
    ):
        self.blocks = blocks
        self.policy = policy
        self.acceptance = acceptance
        self.max_num_seqs = max_num_seqs
        self.token_budget = max_num_batched_tokens
        self.max_k = max_draft_tokens if speculative else 0
        self.kv_high_water = kv_high_water
        self.waiting: list[Sequence] = []  # sorted by sort_key
        self.running: list[Sequence] = []  # sorted by sort_key
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens of admitted requests (vLLM: prefix_cache_queries)
        self.prefix_hits = 0  # of which the prefix cache held (vLLM: prefix_cache_hits)

    # ---- queues --------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        # per-position acceptance counts of length max_k, so that a decision stacks them in one
        # array (a position never drafted has zero counts: its estimate is the global rate)
        for counts in (seq.pos_reached, seq.pos_accepted):
            counts.extend([0.0] * (self.max_k - len(counts)))
            del counts[max(self.max_k, 1) :]  # (never drafted deeper than this engine's k anyway)
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)

    def remove(self, seq: Sequence) -> None:
        """Take a request out of the queues (finished or aborted) and free its blocks."""
        for q in (self.running, self.waiting):
            if seq in q:
                q.remove(seq)
        self.blocks.free(seq.request_id)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- the step ------------------------------------------------------------------------------
    def schedule(self, busy: set[str] = frozenset(), max_seqs: int | None = None) -> StepPlan | None:
        """Plan one step over requests not in ``busy`` (in flight in another micro-batch)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        max_seqs = min(max_seqs or self.max_num_seqs, self.max_num_seqs)
        plan = StepPlan()
        in_plan: set[str] = set()
        preempted = self.num_preemptions
        budget = self.token_budget
        items = plan.items
        running = Status.RUNNING
        cands: list[ScheduledSeq] = []  # decoding requests that may draft (newest token fed, proposers warm)
        prefill = longest = 0  # prompt-chunk tokens; the longest context a request reaches this step
        for seq in list(self.running):
            if len(items) >= max_seqs or budget <= 0:
                break
            if seq.request_id in busy or seq.status is not running:
                continue
            item = self._schedule_running(seq, budget, busy, in_plan)
            if item is None:
                continue
            prefill += self._sort(item, cands)
            longest = max(longest, item.start + item.num_new)
            items.append(item)
            in_plan.add(seq.request_id)
            budget -= item.num_new
        admitted = len(items)
        if self.num_preemptions == preempted:
            budget = self._admit(plan, in_plan, budget, max_seqs)
        for item in items[admitted:]:
            prefill += self._sort(item, cands)
            longest = max(longest, item.start + item.num_new)
        plan.prefill_tokens = prefill
        if cands:
            self._choose_drafts(cands, budget, self.token_budget - budget, len(items) * longest, prefill, len(items))
        if not plan.items:
            return None
        plan.decision_seconds = time.perf_counter() - t0
        plan.decision_cpu_seconds = time.thread_time() - c0
        return plan

    @staticmethod
    def _sort(item: ScheduledSeq, cands: list[ScheduledSeq]) -> int:
        """A request the fast path of ``schedule`` did not take: its prompt-chunk tokens, and into
        ``cands`` if it may draft."""
        seq = item.seq
        if not seq.is_decoding:
            return item.num_new
        if item.samples and seq.warm:
            cands.append(item)
        return 0

    def _feed(self, seq: Sequence, budget: int) -> tuple[int, bool]:
        todo = seq.num_tokens - seq.num_computed
        n = min(todo, budget)
        return n, n == todo

    def _schedule_running(self, seq, budget, busy, in_plan) -> ScheduledSeq | None:
        n, samples = self._feed(seq, budget)
        if len(self.blocks.tables.get(seq.request_id, ())) * self.blocks.block_size >= seq.num_computed + n:
            return ScheduledSeq(seq, n, samples=samples)  # fast path: the slots are already there
        while not self.blocks.ensure(seq.request_id, seq.num_computed + n):
            victim = self._pick_victim(busy, in_plan)
            if victim is None or (victim is seq and any(self.blocks.tables.get(r) for r in busy)):
                return None  # see the module's docstring: wait for the batch in flight
            self._preempt(victim)
            if victim is seq:
                return None
        return ScheduledSeq(seq, n, samples=samples)

    def _pick_victim(self, busy, in_plan) -> Sequence | None:
        for seq in reversed(self.running):  # lowest priority, latest arrival first
            if seq.request_id not in busy and seq.request_id not in in_plan:
                return seq
        return None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.request_id)
        seq.reset_for_recompute()
        bisect.insort(self.waiting, seq, key=lambda s: s.sort_key)
        self.num_preemptions += 1

    def _admit(self, plan: StepPlan, in_plan: set[str], budget: int, max_seqs: int) -> int:
        reserve = int((1.0 - self.kv_high_water) * self.blocks.num_blocks)
        while self.waiting and budget > 0 and len(plan.items) < max_seqs and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_computed == 0:  # what the prefix cache holds of its tokens is computed already
                seq.num_computed = self.blocks.match_prefix(seq.request_id, seq.token_ids)
            n, samples = self._feed(seq, budget)
            need = self.blocks.extra_blocks_needed(seq.request_id, seq.num_computed + n)
            # keep a reserve for running requests to grow into, unless nothing else is running
            if (self.running and self.blocks.num_free - need < reserve) or not self.blocks.ensure(
                seq.request_id, seq.num_computed + n
            ):
                self.blocks.free(seq.request_id)  # matched blocks go back until it is admitted
                seq.num_computed = 0
                break
            if not seq.admitted:  # a first admission, not a recompute after preemption
                self.prefix_queries += seq.prompt_len
                self.prefix_hits += seq.num_computed
                seq.kv_reused_blocks, seq.kv_block_size = (
                    seq.num_computed // self.blocks.block_size,
                    self.blocks.block_size,
                )
            self.waiting.pop(0)
            seq.status, seq.admitted = Status.RUNNING, True
            bisect.insort(self.running, seq, key=lambda s: s.sort_key)
            plan.items.append(ScheduledSeq(seq, n, samples=samples))
            in_plan.add(seq.request_id)
            budget -= n
        return budget

    def _choose_drafts(
        self, cands: list[ScheduledSeq], budget: int, base: int, context: int, prefill: int, requests: int
    ) -> None:
        """k for each candidate, within the step's remaining token ``budget``; ``base``: the step's
        tokens before drafts, ``context``: KV slots its attention reads."""
        if self.max_k == 0 or budget <= 0:
            return
        bs = self.blocks.block_size
        high = self.blocks.usage() >= self.kv_high_water
        free_slots = 0 if high else self.blocks.num_free * bs  # above the high-water mark: own slots only
        tables = self.blocks.tables
        max_k = self.max_k
        seqs = [it.seq for it in cands]
        if len(seqs) * max_k <= SMALL_SLOTS:
            batch = self._small_batch(seqs, free_slots)
        else:
            batch = self._array_batch(seqs, free_slots)
        decision = self.policy.choose(batch, base, base + budget, context, prefill, requests)
        if decision.floors:
            explore = EXPLORE_EVERY
            for it, floor in zip(cands, decision.floors):
                # now and then a request drafts its k whatever the confidence, so that the
                # acceptance of low-confidence drafts keeps being measured (ConfidenceStats)
                it.min_gain = floor if it.seq.num_steps % explore != explore - 1 else 0.0
        ensure = self.blocks.ensure
        for it, k in zip(cands, decision.ks):
            if not k:
                continue
            seq = it.seq
            if len(tables[seq.request_id]) * bs < len(seq.token_ids) + k:  # reserve the drafts' KV slots
                while k > 0 and not ensure(seq.request_id, seq.num_tokens + k):
                    k -= 1
            it.k = k

    def _array_batch(self, seqs: list[Sequence], free_slots: int) -> PolicyBatch:
        """The policy's inputs for many requests: one pass over them into flat arrays (np.fromiter
        over a chain is about twice as fast as np.array over nested lists), the rest vectorised.
        Gives what :meth:`_small_batch` gives, as arrays (a test compares them)."""
        b, max_k, bs, tables = len(seqs), self.max_k, self.blocks.block_size, self.blocks.tables
        info = np.fromiter(
            chain.from_iterable(
                (
                    len(s.token_ids),
                    len(tables[s.request_id]),
                    min(s.draft_cap_asked, s.draft_room),
                    s.end_len,
                    s.sampled,
                )
                for s in seqs
            ),
            np.int64,
            5 * b,
        ).reshape(b, 5)
        n_tok = info[:, 0]
        limits = np.minimum(
            np.minimum(info[:, 2], max_k),
            # drafts beyond max_tokens - 1 can never be emitted (the bonus token comes too)
            np.minimum(info[:, 3] - n_tok - 1, info[:, 1] * bs - n_tok + free_slots),
        ).clip(0)
        sampled = info[:, 4].astype(bool)
        # request_alphas() for all at once: the request's decayed counts smoothed toward its mode's rates
        rates = np.where(sampled[:, None], self.acceptance.rates(True)[:max_k], self.acceptance.rates(False)[:max_k])
        accepted = np.fromiter(chain.from_iterable(s.pos_accepted for s in seqs), np.float64, b * max_k)
        reached = np.fromiter(chain.from_iterable(s.pos_reached for s in seqs), np.float64, b * max_k)
        alphas = (accepted.reshape(b, max_k) + ALPHA_STRENGTH * rates) / (reached.reshape(b, max_k) + ALPHA_STRENGTH)
        return PolicyBatch(limits, alphas, sampled)

    def _small_batch(self, seqs: list[Sequence], free_slots: int) -> PolicyBatch:
        """The policy's inputs for a few requests, as plain lists (numpy's per-call overhead would
        double a lone request's decision): the reference :meth:`_array_batch` is held to."""
        max_k, bs, tables = self.max_k, self.blocks.block_size, self.blocks.tables
        rates = [self.acceptance.rates(m).tolist() for m in (False, True)]  # greedy, sampled
        limits, alphas, sampled = [], [], []
        for seq in seqs:
            n_tok = len(seq.token_ids)
            limit = min(
                max_k,
                seq.draft_cap_asked,
                seq.draft_room,
                seq.end_len - n_tok - 1,
                len(tables[seq.request_id]) * bs - n_tok + free_slots,
            )
            limits.append(max(0, limit))
            alphas.append(request_alphas(seq.pos_reached, seq.pos_accepted, rates[seq.sampled], max_k))
            sampled.append(seq.sampled)
        return PolicyBatch(limits, alphas, sampled)
