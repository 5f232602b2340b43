"""LLMEngine: the step loop. ``plan = schedule(); drafts = propose(plan); out = target(plan, drafts);
update(plan, out)``, with up to ``pipeline_depth`` micro-batches in flight.

With depth 2 the engine launches micro-batch B (schedule, propose on the MTP/draft stage, submit to the
target stage) while micro-batch A is still being verified by the target stage, so the stages of
different micro-batches overlap; results are consumed in launch order.
"""

from __future__ import annotations

import itertools
import logging
import time
import zlib
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .block_manager import BlockManager
from ..spec.calibrate import ProfileSpec, calibrate
from ..config import EngineConfig, SamplingParams, SpecMethod
from ..models.llama import LlamaConfig
from .outputs import RequestDelta, RequestOutput
from ..spec.acceptance import AcceptanceStats, ConfidenceStats
from ..spec.cost import CostModel
from ..spec.policy import DynamicPolicy, StaticPolicy
from ..spec.draft import DraftModelProposer
from ..spec.mtp import MTPProposer
from ..spec.ngram import NgramProposer
from ..spec.proposer import NoProposer, Proposal
from ..spec.sampling import probs_from_logits
from .scheduler import Scheduler, StepPlan
from .sequence import Sequence, Status
from ..stages.executor import Executor, LocalExecutor
from ..stages.contract import ModelCall, pack_block_tables
from ..stages.target import ModelRunner
from ..stages.mtp import MTPRunner
from .stats import RuntimeStats
from ..models.tokenizer import IncrementalDetokenizer, TokenizerInfo
from ..spec.verify import verify_greedy, verify_rejection

DEFAULT_MODEL_ROOT = Path(__file__).resolve().parents[1] / "default_model"
log = logging.getLogger("lightspec")


def default_model_dir() -> str:
    """Directory of the embedded default target checkpoint (HF layout)."""
    return str(DEFAULT_MODEL_ROOT / "target")


def resolve_dirs(cfg: EngineConfig) -> tuple[str, str, str]:
    """(target, mtp, draft) checkpoint directories; MTP heads and draft model default to the
    siblings ``mtp`` and ``draft`` of the target directory."""
    target = cfg.model_dir or default_model_dir()
    parent = Path(target).parent
    return target, cfg.mtp_dir or str(parent / "mtp"), cfg.draft_dir or str(parent / "draft")


def build_local_executor(cfg: EngineConfig) -> LocalExecutor:
    target, mtp, draft = resolve_dirs(cfg)
    runners: dict[str, object] = {}
    if cfg.method is SpecMethod.MTP:
        runners["mtp"] = MTPRunner(target, mtp, cfg.device)
    heads = runners["mtp"] if cfg.fused_mtp and cfg.speculative else None  # stateless: shared safely
    runners["target"] = ModelRunner(target, cfg.num_kv_blocks, cfg.block_size, cfg.device, heads=heads)
    if cfg.method is SpecMethod.DRAFT:
        runners["draft"] = ModelRunner(draft, cfg.num_kv_blocks, cfg.block_size, cfg.device)
    return LocalExecutor(runners, threaded=cfg.pipeline_depth > 1)


@dataclass
class InFlight:
    plan: StepPlan
    proposals: list[Proposal]
    future: Future
    rows: list[list[int]]  # per plan item: rows of the target output to verify (empty: no sample)
    logit_rows: list[list[int]]  # per plan item: its rows of the returned logits (sampled requests only)
    t_submit: float
    num_tokens: int
    context: int  # padded KV slots the target's attention reads: requests x longest context
    prefill: int  # of num_tokens, prompt-chunk tokens
    drafts: int  # of num_tokens, draft tokens


def _stamp_done(fut: Future) -> None:
    """For an executor whose futures come without ``t_done`` (see ``Executor``): late by whatever
    the waiting thread does before the callback gets the interpreter."""
    if not hasattr(fut, "t_done"):
        fut.t_done = time.perf_counter()


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, executor: Executor | None = None):
        self.config = cfg = config or EngineConfig()
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
        target_dir, _, _ = resolve_dirs(cfg)
        self.model_config = LlamaConfig.from_dir(target_dir)
        self.tok = TokenizerInfo.from_dir(target_dir)
        self.tokenizer = self.tok.tokenizer
        pool_tokens = cfg.num_kv_blocks * cfg.block_size
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, pool_tokens)
        self.executor = executor if executor is not None else build_local_executor(cfg)
        k = cfg.max_draft_tokens if cfg.speculative else 0
        self.stats = RuntimeStats(max(k, 1))
        self.acceptance = AcceptanceStats(max(k, 1))
        # the dynamic policy's MTP drafts stop at a confidence floor (see ConfidenceStats)
        self.confidence = (ConfidenceStats(k) if k and cfg.method is SpecMethod.MTP and cfg.policy_kind == "dynamic"
                           and cfg.confidence_stop else None)
        self.cost = CostModel()
        self._profile_pending = cfg.speculative and cfg.policy_kind == "dynamic" and cfg.profile_stages
        policy = (DynamicPolicy(self.cost, objective=cfg.policy_objective) if cfg.policy_kind == "dynamic"
                  else StaticPolicy(cfg.static_k or 0))
        if cfg.policy_kind == "static" and cfg.static_k is None:
            policy = StaticPolicy(cfg.max_draft_tokens)
        self.blocks = BlockManager(cfg.num_kv_blocks, cfg.block_size)
        self.scheduler = Scheduler(self.blocks, policy, self.acceptance, cfg.max_num_seqs, cfg.max_num_batched_tokens,
                                   k, cfg.kv_high_water, cfg.speculative)
        if self.confidence is not None:
            policy.floors_wanted = True
        self._plans_with_cost = isinstance(policy, DynamicPolicy)
        self.proposer = self._make_proposer(k)
        self.fused = bool(k) and cfg.fused_mtp
        self.seqs: dict[str, Sequence] = {}
        self._inflight: deque[InFlight] = deque()
        self._aborts: list[str] = []
        self._target_free_at = 0.0
        self._last_step = 0.0
        self._stage_seconds = 0.0  # stage time inside the current step, for the overhead estimate
        self._arrivals = itertools.count()

    def _make_proposer(self, k: int):
        m = self.config.method
        if k == 0 or m is SpecMethod.NONE:
            return NoProposer()
        if m is SpecMethod.MTP:
            return MTPProposer(self.executor, k, self.confidence)
        if m is SpecMethod.DRAFT:
            return DraftModelProposer(self.executor)
        return NgramProposer(self.config.ngram_max, self.config.ngram_min)

    # ---- public API ----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.seqs:
            raise ValueError(f"request_id={request_id!r}: already in use")
        ids = self.tok.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt: empty prompt")
        vocab = self.model_config.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt: {len(ids)} tokens, the context holds {self.max_model_len}")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens={params.max_tokens}: prompt ({len(ids)} tokens) + max_tokens exceeds the "
                             f"context of {self.max_model_len} tokens")
        seq = Sequence(request_id, ids, params, IncrementalDetokenizer(self.tok),
                       seed=zlib.crc32(f"{self.config.seed}:{request_id}".encode()), arrival=next(self._arrivals))
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        self.stats.counters["prompt_tokens_total"] += len(ids)

    def abort(self, request_id: str) -> None:
        """Cancel a request; the next ``step()`` returns its final ``cancelled`` delta."""
        self._aborts.append(request_id)

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
            self.profile_stages()
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
        self._update_gauges()
        return deltas

    def generate(self, prompts: list[str] | list[list[int]] | str,
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"params: {len(plist)} SamplingParams for {len(prompts)} prompts")
        base = f"gen-{next(self._arrivals)}-"
        outs: dict[str, RequestOutput] = {}
        for i, (p, sp) in enumerate(zip(prompts, plist)):
            rid = base + str(i)
            self.add_request(rid, p, sp)
            outs[rid] = RequestOutput(rid, list(self.seqs[rid].token_ids))
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

    def profile_stages(self) -> None:
        """Time the stages on synthetic steps and plan with the result (see ``calibrate``). Runs
        once, before the first step computes anything; the KV it writes is overwritten later."""
        self._profile_pending = False
        cfg = self.config
        spec = ProfileSpec(cfg.method, self.scheduler.max_k, cfg.block_size, cfg.num_kv_blocks, cfg.max_num_seqs,
                           cfg.max_num_batched_tokens, self.max_model_len, self.model_config.hidden_size,
                           vocab_size=self.model_config.vocab_size, fused_mtp=self.fused)
        try:
            self.cost.verify, self.cost.propose = calibrate(self.executor, spec)
        except Exception:  # a profile is an optimisation: serve with generic costs rather than fail
            log.exception("stage profile failed; planning with generic costs")
            return
        self.cost.calibrated = True

    def close(self) -> None:
        self.executor.close()

    # ---- launch: propose drafts and submit the target step --------------------------------------
    def _launch(self, plan: StepPlan) -> InFlight:
        t0 = time.perf_counter()
        tables = [self.blocks.table(it.seq.request_id) for it in plan.items]
        floors = [it.min_gain for it in plan.items] if self.confidence is not None else None
        props = self.proposer.propose([it.seq for it in plan.items], [it.k for it in plan.items], tables, floors)
        t1 = time.perf_counter()
        num_drafts = sum(len(p.draft_ids) for p in props)
        if self.confidence is not None:
            self.stats.counters["spec_decode_num_stopped_drafts_total"] += sum(it.k for it in plan.items) - num_drafts
        if num_drafts:
            came_fused = sum(len(p.draft_ids) for p in props if p.fused)
            self.stats.counters["spec_decode_num_fused_drafts_total"] += came_fused
            if came_fused < num_drafts:  # a proposer stage ran
                self.stats.observe("stage_latency_seconds", t1 - t0, {"stage": self.config.method.value})
            self.cost.observe_propose(num_drafts, max(len(p.draft_ids) for p in props), t1 - t0)
        self._stage_seconds += t1 - t0
        ids: list[int] = []
        pos: list[int] = []
        qlens: list[int] = []
        rows: list[list[int]] = []
        flags: list[bool] = []  # per sample row: a sampled request's, whose logits must come back
        logit_rows: list[list[int]] = []  # per item: its rows of the returned logits
        m = 0  # logits rows so far (sum of flags)
        for it, pr in zip(plan.items, props):
            seq = it.seq
            drafts = pr.draft_ids[: it.k]
            toks = seq.token_ids[it.start : it.start + it.num_new] + drafts
            base = len(ids)
            ids += toks
            pos += range(it.start, it.start + len(toks))
            qlens.append(len(toks))
            rows.append(list(range(base + it.num_new - 1, base + len(toks))) if it.samples else [])
            sampled = not seq.params.greedy
            logit_rows.append(list(range(m, m + len(rows[-1]))) if sampled else [])
            m += len(rows[-1]) if sampled else 0
            flags += [sampled] * len(rows[-1])
        bt = pack_block_tables(tables)
        sample_rows = [r for rr in rows for r in rr]
        mtp = self.config.method is SpecMethod.MTP and self.config.speculative
        fused = np.zeros(0, np.int32)
        if self.fused:  # the next step's drafts of greedy requests come back with this step
            fused = np.array([it.seq.draft_cap(self.scheduler.max_k) if it.samples and it.seq.params.greedy else 0
                              for it in plan.items], np.int32)
        call = ModelCall(
            input_ids=np.array(ids, np.int64), positions=np.array(pos, np.int64),
            query_lens=np.array(qlens, np.int32), block_tables=bt,
            sample_indices=np.array(sample_rows, np.int64),
            return_logits=np.array(flags if any(flags) and not all(flags) else [any(flags)]),
            # with fused drafts, only sampled requests draft from a hidden state in the engine
            return_hidden=np.array([mtp and (not self.fused or any(not it.seq.params.greedy for it in plan.items))]),
            mtp_drafts=fused,
            mtp_conf=np.array([self.fused and self.confidence is not None]),
        )
        # rows relative to the returned (sampled) outputs
        out_rows, n = [], 0
        for rr in rows:
            out_rows.append(list(range(n, n + len(rr))))
            n += len(rr)
        t_submit = time.perf_counter()
        fut = self.executor.submit("target", call)
        fut.add_done_callback(_stamp_done)
        return InFlight(plan, props, fut, out_rows, logit_rows, t_submit, len(ids), len(qlens) * (max(pos) + 1),
                        plan.prefill_tokens, num_drafts)

    # ---- complete: verify, update, emit --------------------------------------------------------
    def _complete(self, f: InFlight) -> list[RequestDelta]:
        try:
            res = f.future.result()
        except Exception as e:  # a stage failure fails this micro-batch only; the engine goes on
            return [d for it in f.plan.items if (d := self._finish(it.seq, "error", f"stage failure: {e}"))]
        # The target stage serves calls one at a time in order, so its service time for this call
        # starts when it was submitted or when the previous call finished, whichever is later.
        t_done = getattr(f.future, "t_done", time.perf_counter())
        service = t_done - max(f.t_submit, self._target_free_at)
        self._target_free_at = t_done
        self.stats.observe("stage_latency_seconds", service, {"stage": "target"})
        self.cost.observe_verify(len(f.plan.items), f.drafts, f.context, f.prefill, service)
        self._stage_seconds += service
        self.stats.counters["engine_steps_total"] += 1
        deltas = []
        probs = self._target_probs(f, res.logits) if len(res.logits) else None
        for b, (it, pr, rows, lrows) in enumerate(zip(f.plan.items, f.proposals, f.rows, f.logit_rows)):
            seq = it.seq
            if seq.aborted or seq.status is Status.FINISHED:
                if seq.aborted and seq.status is not Status.FINISHED:
                    deltas.append(self._finish(seq, "cancelled"))
                continue
            if seq.status is not Status.RUNNING:  # preempted while in flight: recomputed later
                continue
            if not rows:
                seq.num_computed += it.num_new
                self.blocks.set_used(seq.request_id, seq.num_computed)
                continue
            drafts = pr.draft_ids[: it.k]
            if seq.params.greedy:
                tokens = verify_greedy(drafts, res.top1_ids[rows].tolist())
            else:
                p = probs[lrows]
                q = pr.q[: len(drafts)] if pr.q is not None else None
                tokens = verify_rejection(drafts, q, p, seq.rng)
            accepted = len(tokens) - 1
            if drafts:
                seq.record_acceptance(len(drafts), accepted)
                self.acceptance.observe(len(drafts), accepted, not seq.params.greedy)
                self.stats.observe_verification(len(drafts), accepted)
                if pr.conf is not None:
                    self.confidence.observe(pr.conf, accepted, not seq.params.greedy)
            seq.num_computed += it.num_new + accepted
            seq.num_steps += 1
            seq.warm = True
            if self.config.method is SpecMethod.MTP:
                seq.last_hidden = res.hidden[rows[accepted]] if len(res.hidden) else None
            seq.draft_computed = min(seq.draft_computed, seq.num_computed)
            d = self._append(seq, tokens)
            if len(res.accepted) and seq.params.greedy:
                self._keep_fused(seq, res, b, accepted)
            if d is not None:
                deltas.append(d)
            if seq.status is Status.RUNNING:
                self.blocks.trim(seq.request_id, seq.num_tokens)
                self.blocks.set_used(seq.request_id, seq.num_computed)
        return deltas

    @staticmethod
    def _keep_fused(seq: Sequence, res, b: int, accepted: int) -> None:
        """Keep the drafts the target stage proposed for this request's next step. They continue
        from the stage's own greedy verification, which must agree with the engine's."""
        seq.fused_ids = seq.fused_conf = None
        if int(res.accepted[b]) < 0:  # none asked for (no sample row, or no draft allowed)
            return
        if int(res.accepted[b]) != accepted:
            log.warning("fused MTP: stage accepted %d drafts of %s, the engine %d; drafts dropped",
                        int(res.accepted[b]), seq.request_id, accepted)
            return
        row = res.next_draft_ids[b]
        n = int((row >= 0).sum())
        seq.fused_ids = row[:n].tolist()
        seq.fused_conf = res.next_draft_conf[b, :n].tolist()
        seq.fused_at = seq.num_tokens

    @staticmethod
    def _target_probs(f: InFlight, logits: np.ndarray) -> np.ndarray:
        """The target's distributions at every returned logits row, in one batched call (one per
        request cost more than the verification itself on a mixed batch)."""
        params = [it.seq.params for it, lr in zip(f.plan.items, f.logit_rows) for _ in lr]
        return probs_from_logits(
            torch.from_numpy(logits), torch.tensor([p.temperature for p in params], dtype=torch.float32),
            torch.tensor([p.top_k for p in params], dtype=torch.int64),
            torch.tensor([p.top_p for p in params], dtype=torch.float32),
        ).numpy()

    def _append(self, seq: Sequence, tokens: list[int]) -> RequestDelta | None:
        sp = seq.params
        eos = self.model_config.eos_token_id
        now = time.perf_counter()
        if seq.t_first_token is None:
            seq.t_first_token = now
            self.stats.observe("time_to_first_token_seconds", now - seq.t_arrival)
        elif seq.t_last_token is not None:
            self.stats.observe("time_per_output_token_seconds", (now - seq.t_last_token) / len(tokens))
        seq.t_last_token = now
        reason = None
        for t in tokens:
            seq.token_ids.append(t)
            seq.text += seq.detok.push(t)
            self.stats.counters["generation_tokens_total"] += 1
            if t == sp.end_id or (not sp.ignore_eos and t == eos):
                reason = "stop"
            elif sp.stop and self._truncate_at_stop(seq):
                return self._finish(seq, "stop", flush=False)
            elif seq.num_output >= sp.max_tokens:
                reason = "length"
            if reason:
                return self._finish(seq, reason)
        return self._delta(seq)

    def _truncate_at_stop(self, seq: Sequence) -> bool:
        window = max(len(s) for s in seq.params.stop) + 8
        tail_start = max(0, len(seq.text) - window)
        hits = [i for s in seq.params.stop if (i := seq.text.find(s, tail_start)) >= 0]
        if not hits:
            return False
        seq.text = seq.text[: min(hits)]
        return True

    def _sendable_chars(self, seq: Sequence) -> int:
        """Hold back a text tail that could be the start of a stop string, so no text that belongs to
        a stop string is ever streamed."""
        text = seq.text
        hold = 0
        for s in seq.params.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    hold = max(hold, n)
                    break
        return len(text) - hold

    def _delta(self, seq: Sequence, finished: bool = False) -> RequestDelta | None:
        end = len(seq.text) if finished else self._sendable_chars(seq)
        new_ids = seq.output_ids[seq.sent_tokens:]
        new_text = seq.text[seq.sent_chars:end] if end > seq.sent_chars else ""
        if not new_ids and not new_text and not finished:
            return None
        seq.sent_tokens = seq.num_output
        seq.sent_chars = max(seq.sent_chars, end)
        return RequestDelta(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=seq.finish_reason, error=seq.error, num_prompt_tokens=seq.prompt_len,
            num_output_tokens=seq.num_output, num_draft_tokens=seq.num_draft, num_accepted_tokens=seq.num_accepted,
        )

    def _finish(self, seq: Sequence, reason: str, error: str | None = None, flush: bool = True) -> RequestDelta | None:
        if seq.status is Status.FINISHED:
            return None
        if flush:  # an incomplete UTF-8 tail becomes U+FFFD, as a full decode would show it
            seq.text += seq.detok.flush()
        seq.finish_reason, seq.error = reason, error
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        self.seqs.pop(seq.request_id, None)
        now = time.perf_counter()
        self.stats.observe("e2e_request_latency_seconds", now - seq.t_arrival)
        self.stats.counters["request_success_total" if reason in ("length", "stop") else "request_failure_total"] += 1
        return self._delta(seq, finished=True)

    def _process_aborts(self) -> list[RequestDelta]:
        deltas = []
        busy = {it.seq.request_id for f in self._inflight for it in f.plan.items}
        for rid in self._aborts:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            seq.aborted = True
            if rid not in busy:  # in-flight ones finish when their micro-batch returns
                d = self._finish(seq, "cancelled")
                if d:
                    deltas.append(d)
        self._aborts.clear()
        return deltas

    def _update_gauges(self) -> None:
        g = self.stats.gauges
        g["num_requests_running"] = len(self.scheduler.running)
        g["num_requests_waiting"] = len(self.scheduler.waiting)
        g["kv_cache_usage_ratio"] = self.blocks.usage()
        g["kv_cache_fragmentation_ratio"] = self.blocks.fragmentation()
        g["stage_inflight_calls"] = len(self._inflight)
        self.stats.counters["num_preemptions_total"] = self.scheduler.num_preemptions
        if self._plans_with_cost:  # what the dynamic policy believes a step costs, at today's batch
            cost = self.cost
            g["policy_draft_cost_seconds"] = cost.per_slot(max(len(self.scheduler.running), 1))
            g["policy_step_excess_seconds"] = cost.verify_extra
            g["policy_step_overhead_seconds"] = cost.overhead
