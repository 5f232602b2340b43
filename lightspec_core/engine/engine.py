"""LLMEngine: the step loop. ``plan = schedule(); drafts = propose(plan); out = target(plan, drafts);
update(plan, out)``, with up to ``pipeline_depth`` micro-batches in flight.

With depth 2 the engine launches micro-batch B (schedule, propose on the MTP/draft stage, submit to the
target stage) while micro-batch A is still being verified by the target stage, so the stages of
different micro-batches overlap; results are consumed in launch order.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import zlib
from collections import deque
from collections.abc import Callable

import torch

from ..config import EngineConfig, SamplingParams, SpecMethod, resolve_dirs
from ..models.llama import LlamaConfig
from ..models.tokenizer import IncrementalDetokenizer, TokenizerInfo
from ..spec.acceptance import AcceptanceStats
from ..spec.calibrate import PROPOSER_STAGE, ProfileSpec
from ..spec.cost import CostModel, ProposeCost
from ..spec.policy import DynamicPolicy, StaticPolicy
from ..spec.proposer import Proposal
from ..spec.verify import verify_coupled, verify_greedy, verify_rejection
from ..stages.executor import Executor
from .block_manager import BlockManager
from .build import build_local_executor, check_same_vocabulary, make_policy, make_proposer, with_draft_tokens
from .kv_budget import with_kv_budget
from .outputs import RequestDelta, RequestOutput
from .scheduler import ScheduledSeq, Scheduler, StepPlan
from .sequence import Sequence, Status, checked_prompt
from .stats import RuntimeStats
from .step import InFlight, failed_launch, nonfinite_error, pack_step, stamp_done, target_rows
from .text import take_delta, truncate_at_stop

log = logging.getLogger("lightspec")


class LLMEngine:
    """The engine. ``executor``: how to reach the stages (default: runners in this process).
    ``profile_now``: take the dynamic policy's stage profile here, while the engine loads; a
    server whose stages are not reachable yet passes False and calls :meth:`profile_stages` once
    they are (otherwise the first step takes it)."""

    def __init__(
        self, config: EngineConfig | None = None, executor: Executor | None = None, *, profile_now: bool = True
    ):
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        target_dir, _, draft_dir = resolve_dirs(cfg)
        self.model_config = LlamaConfig.from_dir(target_dir)
        self.tok = TokenizerInfo.from_dir(target_dir)
        self.tokenizer = self.tok.tokenizer
        if cfg.method is SpecMethod.DRAFT:
            check_same_vocabulary(self.model_config, self.tok, draft_dir)
        # in process the pool is here; a server's stages check their own (see kv_budget)
        self.config = cfg = with_kv_budget(
            with_draft_tokens(cfg),
            self.model_config,
            target_dir,
            allow_fraction=executor is None,
            check_fit=executor is None,
        )
        self.max_model_len = cfg.context_length(self.model_config.max_position_embeddings)
        self.model_config.check_context(self.max_model_len)  # refused here, naming the field, before any load
        self._eos = frozenset(self.model_config.eos_token_ids)
        self.executor = executor if executor is not None else build_local_executor(cfg, self.max_model_len)
        k = cfg.max_draft_tokens if cfg.speculative else 0
        self.stats = RuntimeStats(max(k, 1))
        self.acceptance = AcceptanceStats(max(k, 1))
        self.cost = CostModel()
        policy = make_policy(cfg, self.cost)
        self.blocks = BlockManager(cfg.num_kv_blocks, cfg.block_size, prefix_caching=cfg.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.blocks,
            policy,
            self.acceptance,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            k,
            cfg.kv_high_water,
            cfg.speculative,
        )
        self._policy_cost = self.cost if isinstance(policy, DynamicPolicy) else None  # for the gauges
        self.proposer = make_proposer(cfg, self.executor, min(k, policy.k) if isinstance(policy, StaticPolicy) else k)
        self.seqs: dict[str, Sequence] = {}
        self._inflight: deque[InFlight] = deque()
        self._aborts: list[tuple[str, str | None]] = []
        self._target_free_at = 0.0
        self._last_step = 0.0
        self._stage_seconds = 0.0  # stage time inside the current step, for the overhead estimate
        self._arrivals = itertools.count()
        self._profile_pending = cfg.speculative and cfg.policy_kind == "dynamic" and cfg.profile_stages
        if self._profile_pending and profile_now:
            self.profile_stages()

    @property
    def profile_pending(self) -> bool:
        return self._profile_pending

    # ---- public API ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        add_special_tokens: bool = True,
        arrived_at: float | None = None,
    ) -> None:
        """Queue a request. A ``ValueError`` (prompt problems name the field ``prompt``) refuses it
        and counts it as a failed request. ``add_special_tokens``: see :func:`.sequence.checked_prompt`.
        ``arrived_at``: when a server took it (``time.perf_counter()``), for its latency metrics."""
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request_id={request_id!r}: already in use")
        try:
            ids = checked_prompt(
                self.tok, self.model_config.vocab_size, self.max_model_len, prompt, params, add_special_tokens
            )
            if params.max_tokens is None:  # the rest of the context, as in vLLM
                params = dataclasses.replace(params, max_tokens=self.max_model_len - len(ids))
        except ValueError:
            self.stats.count_rejected()
            raise
        seq = Sequence(
            request_id,
            ids,
            params,
            IncrementalDetokenizer(self.tok, ids),
            seed=zlib.crc32(f"{self.config.seed}:{request_id}".encode()),
            arrival=next(self._arrivals),
            arrived_at=arrived_at,
        )
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str, error: str | None = None) -> None:
        """Cancel a request; the next ``step()`` returns its final ``cancelled`` delta. With ``error``,
        the request failed elsewhere (a server's failed step): it ends with ``error`` and counts as a
        failure, not as a cancellation."""
        self._aborts.append((request_id, error))

    def has_unfinished(self) -> bool:
        return bool(self.seqs) or bool(self._inflight)

    def step(self, on_launched: Callable[[], None] | None = None) -> list[RequestDelta]:
        """Launch what fits in the pipeline, then complete the oldest micro-batch in flight.
        ``on_launched`` is called once, after the launches and before waiting for the target stage:
        a server sends the previous step's responses then, so that they do not compete with this
        step's scheduling decision and drafting for the interpreter."""
        now = time.perf_counter()
        if self._stage_seconds and now - self._last_step < 0.1:  # back-to-back steps: a busy loop
            self.cost.observe_overhead(now - self._last_step - self._stage_seconds)
        self._last_step, self._stage_seconds = now, 0.0
        deltas = self._process_aborts()
        if self._profile_pending and not self._inflight and self.scheduler.has_work():
            self.profile_stages()  # not taken while loading (``profile_now=False``): before any work
        depth = self.config.pipeline_depth
        while len(self._inflight) < depth:
            busy = {it.seq.request_id for f in self._inflight for it in f.plan.items}
            active = len(self.scheduler.running) + len(self.scheduler.waiting)
            cap = None if depth == 1 else max(1, -(-active // depth))
            plan = self.scheduler.schedule(busy, cap)
            if plan is None:
                break
            self.stats.observe_decision(plan.decision_seconds, plan.ks, plan.decision_cpu_seconds)
            self._inflight.append(self._launch(plan))
        if on_launched is not None:
            on_launched()
        if self._inflight:
            deltas += self._complete(self._inflight.popleft())
        self.stats.update_gauges(self.scheduler, self.blocks, len(self._inflight), self._policy_cost)
        return deltas

    def generate(
        self, prompts: list[str] | list[list[int]] | str, params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        base = f"gen-{next(self._arrivals)}-"
        rids = [base + str(i) for i in range(len(prompts))]
        try:
            for k, (rid, p, sp) in enumerate(zip(rids, prompts, plist)):
                self.add_request(rid, p, sp)
        except ValueError:  # the call is refused whole: the prompts queued before the bad one go too
            for rid in rids[:k]:
                self.scheduler.remove(self.seqs.pop(rid))
            raise
        outs = {rid: RequestOutput(rid, list(self.seqs[rid].token_ids)) for rid in rids}
        pending = set(outs)
        while pending:
            for d in self.step():
                o = outs.get(d.request_id)
                if o is None:
                    continue
                o.output_token_ids += d.new_token_ids
                o.text += d.new_text
                if d.finished:
                    o.finish_reason, o.error = d.finish_reason, d.error
                    o.num_draft_tokens, o.num_accepted_tokens = d.num_draft_tokens, d.num_accepted_tokens
                    pending.discard(d.request_id)
        return list(outs.values())

    def profile_spec(self) -> ProfileSpec:
        return ProfileSpec.for_engine(self.config, self.model_config, self.max_model_len)

    def profile_stages(self) -> None:
        """Time the stages on synthetic steps and plan with the result (see ``calibrate``). Runs
        once, before the first step computes anything; the KV it writes is overwritten later."""
        self._profile_pending = False
        spec = self.profile_spec()
        proposer = PROPOSER_STAGE.get(spec.method) if spec.max_k else None
        try:
            verify = self.executor.profile("target", spec)
            propose = self.executor.profile(proposer, spec) if proposer else ProposeCost(1e-5, 1e-5, 0.0)
        except Exception:  # a profile is an optimisation: serve with generic costs rather than fail
            log.exception("stage profile failed; planning with generic costs")
            return
        self.cost.verify, self.cost.propose = verify, propose
        self.cost.calibrated = True

    def close(self) -> None:
        self.executor.close()

    # ---- launch: propose drafts and submit the target step --------------------------------------
    def _launch(self, plan: StepPlan) -> InFlight:
        t0 = time.perf_counter()
        for it in plan.items:
            if it.seq.t_scheduled is None:  # its queue time ends with its first step
                it.seq.t_scheduled = t0
        tables = [self.blocks.table(it.seq.request_id) for it in plan.items]
        seqs, ks = [it.seq for it in plan.items], [it.k for it in plan.items]
        try:
            props = self.proposer.propose(seqs, ks, tables, [it.min_gain for it in plan.items])
        except Exception as e:  # noqa: BLE001 - a proposer stage failure fails this micro-batch only, as the target's
            return failed_launch(plan, e, t0)
        num_drafts = sum(len(p.draft_ids) for p in props)
        self._observe_proposals(plan, props, num_drafts, time.perf_counter() - t0)
        extra = self.proposer.target_inputs(seqs, [it.samples for it in plan.items], ks)
        packed = pack_step(plan, props, tables, extra)
        t_submit = time.perf_counter()
        fut = self.executor.submit("target", packed.call)
        fut.add_done_callback(stamp_done)
        return InFlight(
            plan,
            props,
            fut,
            packed.rows,
            packed.logit_rows,
            t_submit,
            len(packed.call.input_ids),
            packed.context,
            plan.prefill_tokens,
            num_drafts,
            packed.heads,
        )

    def _observe_proposals(self, plan: StepPlan, props: list[Proposal], num_drafts: int, seconds: float) -> None:
        self.stats.counters["spec_decode_num_stopped_drafts_total"] += sum(it.k for it in plan.items) - num_drafts
        if num_drafts:
            came_fused = sum(len(p.draft_ids) for p in props if p.fused)
            self.stats.counters["spec_decode_num_fused_drafts_total"] += came_fused
            if came_fused < num_drafts:  # a proposer stage ran (fused drafts came priced with the target's call)
                self.stats.observe("stage_latency_seconds", seconds, {"stage": self.config.method.value})
                staged = [len(p.draft_ids) for p in props if not p.fused]
                self.cost.observe_propose(sum(staged), max(staged), seconds, sum(p.fed for p in props))
        self._stage_seconds += seconds

    # ---- complete: verify, update, emit --------------------------------------------------------
    def _complete(self, f: InFlight) -> list[RequestDelta]:
        try:
            res = f.future.result()
        except Exception as e:  # noqa: BLE001 - a stage failure fails this micro-batch only; the engine goes on
            return [d for it in f.plan.items if (d := self._finish(it.seq, "error", f"stage failure: {e}"))]
        self._observe_target(f)
        tr = target_rows(f, res, self._eos)
        deltas = []
        for b, (it, pr, rows, lrows, ok) in enumerate(zip(f.plan.items, f.proposals, f.rows, f.logit_rows, tr.usable)):
            seq = it.seq
            if seq.aborted or seq.status is not Status.RUNNING:
                # aborted: ends now; finished: done; preempted while in flight: recomputed later
                if seq.aborted and seq.status is not Status.FINISHED:
                    deltas.append(self._finish_aborted(seq))
                continue
            # the K/V of the tokens this step fed is final (accepted drafts join next step): to the prefix cache
            self.blocks.cache_blocks(seq.request_id, seq.token_ids, seq.num_computed + it.num_new)
            if not rows:  # a prompt chunk short of the prompt's end
                seq.num_computed += it.num_new
                self.blocks.set_used(seq.request_id, seq.num_computed)
                continue
            d = self._verify(seq, it, pr, res, b, rows, tr.probs[lrows] if lrows else None, ok)
            if d is not None:
                deltas.append(d)
        return deltas

    def _observe_target(self, f: InFlight) -> None:
        # The target stage serves calls one at a time in order, so its service time for this call
        # starts when it was submitted or when the previous call finished, whichever is later.
        t_done = getattr(f.future, "t_done", time.perf_counter())
        service = t_done - max(f.t_submit, self._target_free_at)
        self._target_free_at = t_done
        self.stats.observe("stage_latency_seconds", service, {"stage": "target"})
        self.cost.observe_verify(len(f.plan.items), f.drafts, f.context, f.prefill, service, heads=f.heads)
        self._stage_seconds += service
        self.stats.counters["engine_steps_total"] += 1

    def _verify(
        self, seq: Sequence, it: ScheduledSeq, pr: Proposal, res, b: int, rows: list[int], probs, usable: int
    ) -> RequestDelta | None:
        """Verify one request's drafts, append what it gained (accepted drafts + the bonus token).
        ``usable``: its rows before the first without finite logits; where its next token would come
        from that one it ends with an error, as without drafts (a row past a rejected draft is unread)."""
        drafts = pr.draft_ids[: min(it.k, usable)]
        if seq.params.greedy:
            # a greedy request below min_tokens has its rows as logits: the argmax with the end
            # tokens masked (see mask_end_tokens)
            top1 = probs.argmax(-1).tolist() if probs is not None else res.top1_ids[rows].tolist()
            tokens = verify_greedy(drafts, top1)
        elif seq.params.seed is None:
            tokens = verify_rejection(drafts, pr.q, probs, seq.rng)  # reads the q rows of these drafts only
        else:  # the same tokens whatever the drafts: see verify_coupled
            tokens = verify_coupled(drafts, probs, lambda j: seq.noise(j, probs.shape[1]))
        accepted = len(tokens) - 1
        if drafts:
            seq.record_acceptance(len(drafts), accepted)
            self.acceptance.observe(len(drafts), accepted, not seq.params.greedy)
            self.stats.observe_verification(len(drafts), accepted)
        seq.num_computed += it.num_new + accepted
        seq.num_steps += 1
        seq.warm = True
        error = nonfinite_error(seq.num_output + usable) if len(tokens) > usable else None
        d = self._append(seq, tokens[:usable], error) if usable else self._finish(seq, "error", error)
        self.proposer.after_verify(seq, res, b, rows, len(drafts), accepted, pr)
        if seq.status is Status.RUNNING:
            self.blocks.trim(seq.request_id, seq.num_tokens)
            self.blocks.set_used(seq.request_id, seq.num_computed)
        return d

    def _append(self, seq: Sequence, tokens: list[int], error: str | None = None) -> RequestDelta | None:
        now = time.perf_counter()
        self.stats.observe_tokens(seq, now)
        seq.t_first_token = now if seq.t_first_token is None else seq.t_first_token
        seq.t_last_token = now
        sp = seq.params
        eos = self._eos
        for t in tokens:
            seq.token_ids.append(t)
            new_text = seq.detok.push(t)
            seq.text += new_text
            self.stats.counters["generation_tokens_total"] += 1
            may_end = seq.num_output > sp.min_tokens  # this token is output number min_tokens + 1 or later
            if may_end and (t == sp.end_id or (not sp.ignore_eos and t in eos)):
                return self._finish(seq, "stop")
            if sp.stop and seq.num_output >= sp.min_tokens and truncate_at_stop(seq, len(new_text)):
                return self._finish(seq, "stop", flush=False)
            if seq.num_output >= sp.max_tokens:
                return self._finish(seq, "length")
        if error is not None:  # the request fails after these tokens (see _verify)
            return self._finish(seq, "error", error)
        return take_delta(seq, interval=max(self.config.stream_interval, sp.stream_interval or 1))

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True) -> RequestDelta | None:
        if seq.status is Status.FINISHED:
            return None
        if flush:  # an incomplete UTF-8 tail becomes U+FFFD, as a full decode would show it
            seq.text += seq.detok.flush()
        seq.finish_reason, seq.error = reason, error
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        self.seqs.pop(seq.request_id, None)
        self.stats.observe_finished(seq, reason, time.perf_counter())
        return take_delta(seq, finished=True)

    def _process_aborts(self) -> list[RequestDelta]:
        deltas = []
        busy = {it.seq.request_id for f in self._inflight for it in f.plan.items}
        for rid, error in self._aborts:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            seq.aborted, seq.abort_error = True, error
            if rid not in busy:  # in-flight ones finish when their micro-batch returns
                d = self._finish_aborted(seq)
                if d:
                    deltas.append(d)
        self._aborts.clear()
        return deltas

    def _finish_aborted(self, seq: Sequence) -> RequestDelta | None:
        return self._finish(seq, "error", seq.abort_error) if seq.abort_error else self._finish(seq, "cancelled")
