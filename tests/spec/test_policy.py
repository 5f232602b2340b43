"""Speculation policies on plain lists: goodput maximisation and the static baseline."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from lightspec_core.spec.acceptance import AcceptanceStats, ConfidenceStats, request_alphas
from lightspec_core.spec.cost import CostModel
from lightspec_core.spec.policy import DynamicPolicy, PolicyInput, StaticPolicy, _allocate_lists


def _policy(c0, c_tok, c_draft=0.0, p0=0.0):
    return DynamicPolicy(CostModel(verify=(c0, c_tok), propose=(p0, max(c_draft, 1e-7), 0.0)))


def test_cheap_verification_speculates_to_the_limit():
    pol = _policy(c0=10e-3, c_tok=0.05e-3)
    assert pol.choose([PolicyInput(4, [0.8] * 4)], base_tokens=1, token_budget=512).ks == [4]


def test_expensive_tokens_at_high_load_disable_low_acceptance_drafts():
    pol = _policy(c0=10e-3, c_tok=1e-3)
    reqs = [PolicyInput(4, [0.3] * 4) for _ in range(63)] + [PolicyInput(4, [0.99] * 4)]
    ks = pol.choose(reqs, base_tokens=64, token_budget=1024).ks
    assert ks[:63] == [0] * 63  # G = 64/74 tokens/ms > 0.3 / 1
    assert ks[63] == 4  # 0.99^j stays above G


def test_goodput_is_not_lowered_by_any_single_change():
    pol = _policy(c0=5e-3, c_tok=0.4e-3, c_draft=0.1e-3)
    reqs = [PolicyInput(4, a) for a in ([0.9, 0.8, 0.6, 0.4], [0.5] * 4, [0.95] * 4, [0.1] * 4)]
    ks = pol.choose(reqs, base_tokens=4, token_budget=100).ks

    def goodput(ks):
        e = 0.0
        for r, k in zip(reqs, ks):
            prod = 1.0
            e += 1
            for j in range(k):
                prod *= r.alphas[j]
                e += prod
        return e / pol.cost.step_seconds(4, sum(ks), depth=max(ks))

    best = goodput(ks)
    for i in range(4):
        for d in (-1, 1):
            alt = list(ks)
            alt[i] += d
            if 0 <= alt[i] <= 4:
                assert goodput(alt) <= best + 1e-12


def test_token_budget_and_limits_are_respected():
    pol = _policy(c0=10e-3, c_tok=1e-6)
    ks = pol.choose([PolicyInput(2, [0.9] * 2), PolicyInput(4, [0.9] * 4)], base_tokens=2, token_budget=5).ks
    assert ks[0] <= 2 and sum(ks) == 3
    assert StaticPolicy(3).choose([PolicyInput(2, [0.5] * 2), PolicyInput(4, [0.5] * 4)], 2, 100).ks == [2, 3]
    assert StaticPolicy(3).choose([PolicyInput(4, [0.5] * 4)] * 3, 3, 7).ks == [3, 1, 0]


def test_proposer_overhead_that_drafting_cannot_repay_disables_drafts():
    # 50 ms to propose at all, 0.6 acceptance, cheap verify: one step costs 10 ms without drafts
    pol = _policy(c0=10e-3, c_tok=1e-5, p0=50e-3)
    assert pol.choose([PolicyInput(4, [0.6] * 4)], base_tokens=1, token_budget=64).ks == [0]
    cheap = _policy(c0=10e-3, c_tok=1e-5, p0=1e-3)
    assert cheap.choose([PolicyInput(4, [0.6] * 4)], base_tokens=1, token_budget=64).ks == [4]


def test_young_requests_lean_on_global_rates():
    acc = AcceptanceStats(3)
    for _ in range(400):
        acc.observe(3, 3)
    g = acc.rates()
    assert g[0] > 0.9
    fresh = request_alphas([], [], g, 3)
    assert fresh[0] > 0.9
    bad = request_alphas([50.0], [0.0], g, 1)  # this request rejects every draft
    assert bad[0] < 0.1


def test_greedy_and_sampled_requests_learn_separate_priors():
    """A mixed workload: greedy requests accept almost everything, sampled ones almost nothing.
    A fresh sampled request starts from the sampled mode's rate, not from the greedy majority's."""
    acc = AcceptanceStats(2)
    for _ in range(300):
        acc.observe(2, 2, sampled=False)
        acc.observe(2, 0, sampled=True)
    greedy, sampled = acc.rates(False), acc.rates(True)
    assert greedy[0] > 0.9 and sampled[0] < 0.15
    assert request_alphas([], [], sampled.tolist(), 2)[0] < 0.15
    # a request with a short, failing history: the mode's prior no longer props it up
    assert request_alphas([3.0], [0.0], sampled.tolist(), 1)[0] < 0.1
    assert request_alphas([3.0], [0.0], greedy.tolist(), 1)[0] > 0.4


def test_policy_probes_again_after_deciding_not_to_draft():
    pol = _policy(c0=10e-3, c_tok=1e-5, p0=50e-3)  # drafting looks unprofitable
    reqs = [PolicyInput(4, [0.6] * 4), PolicyInput(0, [])]
    decisions = [pol.choose(reqs, base_tokens=2, token_budget=64).ks for _ in range(16)]
    probes = [i for i, ks in enumerate(decisions) if any(ks)]
    assert probes == [7, 15]  # one probe every 8 idle decisions, never more
    assert decisions[7] == [1, 0]  # one draft for the request that may draft


def _expected(reqs, ks):
    return sum(1 + sum(float(np.prod(r.alphas[: j + 1])) for j in range(k)) for r, k in zip(reqs, ks))


def test_allocation_is_the_exact_optimum_including_the_proposers_depth_cost():
    """Brute force over every allocation of small random instances: the policy's choice has the
    highest predicted goodput, with a proposer whose cost grows with its depth (max k) and a
    target that reads a large context whatever k is."""
    rng = np.random.default_rng(0)
    for trial in range(60):
        b, big_k = int(rng.integers(1, 4)), 3
        cost = CostModel(
            verify=(rng.uniform(1e-3, 5e-3), rng.uniform(1e-5, 5e-4), rng.uniform(0, 3e-6)),
            propose=(rng.uniform(0, 2e-3), rng.uniform(1e-6, 2e-4), rng.uniform(0, 1e-3)),
        )
        pol = DynamicPolicy(cost, probe_every=0)
        reqs = [
            PolicyInput(int(rng.integers(0, big_k + 1)), sorted(rng.uniform(0.05, 1.0, big_k), reverse=True))
            for _ in range(b)
        ]
        context = int(rng.integers(0, 20000))

        def goodput(ks, reqs=reqs, cost=cost, b=b, context=context):
            return _expected(reqs, ks) / cost.step_seconds(b, sum(ks), context, max(ks))

        ks = pol.choose(reqs, base_tokens=b, token_budget=10 * b, context=context).ks
        best = max(goodput(list(alt)) for alt in itertools.product(*[range(r.limit + 1) for r in reqs]))
        assert all(0 <= k <= r.limit for k, r in zip(ks, reqs))
        assert goodput(ks) >= best * (1 - 1e-12), (trial, ks)


def test_deep_drafts_for_a_few_are_dropped_when_depth_is_what_costs():
    # per-slot cost is tiny, but each extra head costs 3 ms: one sequential chain for everyone
    pol = DynamicPolicy(CostModel(verify=(5e-3, 1e-6), propose=(0.0, 1e-6, 3e-3)), probe_every=0)
    reqs = [PolicyInput(4, [0.95, 0.9, 0.9, 0.9])] + [PolicyInput(4, [0.7, 0.5, 0.4, 0.3])] * 7
    ks = pol.choose(reqs, base_tokens=8, token_budget=100).ks
    assert max(ks) == 1 and sum(ks) == 8


class _FakeStages:
    """An executor whose stages cost a known function of the call, on a fake clock: calibration
    must recover that function. The target's draft rows cost 0.5 ms each up to batch 4 (a CPU's
    small matrix products) and 0.1 ms beyond; the context costs 1 us per slot read."""

    def __init__(self):
        self.now = 0.0
        self.target_calls = []

    def clock(self):
        return self.now

    def submit(self, stage, call):
        from concurrent.futures import Future

        if stage == "target":
            b = len(call.query_lens)
            q = int(call.query_lens.max())
            ctx = int(call.positions.max()) + 1
            if q > 64:  # a prompt chunk
                t = 1e-3 + 4e-5 * q + 1e-6 * ctx
            else:
                t = 1e-3 + 3e-4 * b + (5e-4 if b <= 4 else 1e-4) * b * (q - 1) + 1e-6 * b * ctx
            if np.asarray(call.return_logits).any():  # 20 us per row of logits sent back
                t += 2e-5 * len(call.sample_indices)
            t += 1.5e-4 * int(np.asarray(call.mtp_drafts).sum())  # fused MTP heads: per head and request
            self.target_calls.append(call)
        elif stage == "draft":  # a chain of k drafts after feeding every request's tokens
            b, k = len(call.query_lens), int(call.draft_chain.max())
            t = 3e-4 + 2e-4 * k + 5e-5 * b * k + 1e-5 * (int(call.query_lens.sum()) - b)
        else:  # mtp
            k = int(call.num_tokens.max())
            t = 2e-4 * k + 5e-5 * len(call.num_tokens) * k
        self.now += t
        f = Future()
        f.set_result(None)
        return f


def _calibrated(max_num_seqs=64):
    from lightspec_core.config import SpecMethod
    from lightspec_core.spec.calibrate import ProfileSpec, calibrate

    stages = _FakeStages()
    spec = ProfileSpec(SpecMethod.MTP, 4, 16, 1024, max_num_seqs, 2048, 1024, 8)
    verify, propose = calibrate(stages, spec, clock=stages.clock)
    return CostModel(verify, propose, overhead=0.0)


def test_calibration_recovers_the_stage_costs_against_batch_size():
    cost = _calibrated()
    v, p = cost.verify, cost.propose
    assert v.sizes.tolist() == [1, 2, 4, 8, 16, 32, 64]
    assert abs(v.draft_cost(1) - 5e-4) < 1e-9 and abs(v.draft_cost(64) - 1e-4) < 1e-9
    assert abs(v.per_context - 1e-6) < 1e-12
    assert abs(v.per_prefill - 4e-5) < 2e-6
    assert abs(v.per_logits_row - 2e-5) < 1e-9  # the fake clock does not see the in-process part
    for b, ctx in ((1, 300), (16, 5000), (64, 20000), (100, 30000)):  # 100: beyond the profile
        truth = 1e-3 + 3e-4 * b + 1e-6 * ctx
        assert abs(v.predict(b, 0, ctx) - truth) < 1e-6
    assert abs(p.per_depth - 2e-4) < 1e-9 and abs(p.per_draft - 5e-5) < 1e-9 and p.fixed < 1e-9


def test_fused_heads_are_priced_as_the_proposer_not_in_the_targets_profile():
    """With fused MTP the target call runs the heads for the drafts the policy may take next (one
    more than it gave each request, see ``MTPProposer.target_inputs``), so the heads cost what the
    policy drafts, not a fixed part of every step. The profile's target calls ask for none (and for
    no hidden states): a draft costs what verifying it costs, and the heads are the MTP stage's
    profile, per draft and per chained head. The heads a served call runs are taken out of its
    measured time with that price, so they do not land in the target's running excess too."""
    from lightspec_core.config import SpecMethod
    from lightspec_core.spec.calibrate import ProfileSpec, calibrate

    stages = _FakeStages()
    spec = ProfileSpec(SpecMethod.MTP, 4, 16, 1024, 64, 2048, 1024, 8, fused_mtp=True)
    v, p = calibrate(stages, spec, clock=stages.clock)
    steps = [c for c in stages.target_calls if int(c.query_lens.max()) <= 64]  # not the prompt chunk
    assert all(c.mtp_drafts.size == 0 for c in stages.target_calls)
    # hidden states only for the one-request call that precedes each timing of the MTP stage
    assert all(len(c.query_lens) == 1 for c in steps if c.return_hidden[0]) and any(c.return_hidden[0] for c in steps)
    assert abs(v.draft_cost(1) - 5e-4) < 1e-9 and abs(v.draft_cost(64) - 1e-4) < 1e-9
    for b, ctx in ((1, 300), (16, 5000), (64, 20000)):
        assert abs(v.predict(b, 0, ctx) - (1e-3 + 3e-4 * b + 1e-6 * ctx)) < 1e-6
    assert abs(p.per_depth - 2e-4) < 1e-9 and abs(p.per_draft - 5e-5) < 1e-9
    served, unpriced = CostModel(v, p, overhead=0.0), CostModel(v, p, overhead=0.0)
    served.calibrated = unpriced.calibrated = True
    for _ in range(200):  # 64 requests verifying 2 drafts each, their heads proposing 3 each
        seconds = v.predict(64, 128, 64 * 300) + p.predict(192, 3)
        served.observe_verify(64, 128, 64 * 300, 0, seconds, heads=(192, 3))
        unpriced.observe_verify(64, 128, 64 * 300, 0, seconds)
    assert abs(served.verify_extra) < 1e-6 and abs(unpriced.verify_extra - p.predict(192, 3)) < 1e-6


def test_fused_heads_run_one_draft_beyond_the_policys_choice():
    from lightspec_core.config import SamplingParams
    from lightspec_core.engine.sequence import Sequence
    from lightspec_core.spec.mtp import MTPProposer

    seqs = [
        Sequence(
            f"r{i}", list(range(3, 43)), SamplingParams(max_tokens=mt, temperature=t), detok=None, seed=i, arrival=i
        )
        for i, (mt, t) in enumerate([(50, 0.0), (50, 0.0), (50, 0.0), (3, 0.0), (50, 0.8)])
    ]
    for s in seqs:
        s.num_computed = len(s.token_ids) - 1  # decoding
    fused = MTPProposer(executor=None, max_k=4, vocab_size=16, fused=True)
    inputs = fused.target_inputs(seqs, [True, True, True, True, True], [0, 2, 4, 4, 2])
    # k + 1 up to K; no more than max_tokens leaves room for; a sampled request drafts on the mtp stage
    assert inputs["mtp_drafts"].tolist() == [1, 3, 4, 2, 0] and inputs["return_hidden"][0]
    assert fused.target_inputs(seqs[:2], [False, True], [3, 3])["mtp_drafts"].tolist() == [0, 4]
    seqs[0].num_computed = 20  # its prompt's last chunk: the policy has not chosen its depth yet
    assert fused.target_inputs(seqs[:2], [True, True], [0, 0])["mtp_drafts"].tolist() == [4, 1]


def test_a_draft_models_catch_up_is_priced_apart_from_its_drafts():
    """A request that did not draft for a while (or has just had its prompt) makes the draft model
    catch up on every token it has not seen before its first draft. The profile prices those
    tokens apart (``per_fed``) and the propose calls that carry them are judged with that price:
    measured against drafts alone, a probe after eight quiet steps read as a draft model four
    times dearer than profiled, the policy drafted less, and the next catch-up was longer still."""
    from lightspec_core.config import SpecMethod
    from lightspec_core.spec.calibrate import ProfileSpec, profile_propose

    stages = _FakeStages()
    spec = ProfileSpec(SpecMethod.DRAFT, 4, 16, 1024, 64, 2048, 1024, 8)
    p = profile_propose(stages, spec, {"target", "draft"}, clock=stages.clock)
    assert abs(p.fixed - 3e-4) < 1e-9 and abs(p.per_depth - 2e-4) < 1e-9 and abs(p.per_draft - 5e-5) < 1e-9
    assert abs(p.per_fed - 1e-5) < 1e-9
    priced, unpriced = CostModel(propose=p), CostModel(propose=dataclasses.replace(p, per_fed=0.0))
    for _ in range(100):  # probes: 64 requests draft one each after 8 steps without drafting
        seconds = p.predict(64, 1, fed=64 * 8)
        priced.observe_propose(64, 1, seconds, fed=64 * 8)
        unpriced.observe_propose(64, 1, seconds, fed=64 * 8)
    assert abs(priced.propose_scale - 1.0) < 1e-9
    assert unpriced.propose_scale > 2.0 and unpriced.per_slot(64) > priced.per_slot(64)


def test_a_lone_request_drafts_less_than_each_request_of_a_full_batch():
    """With the calibrated CPU-like profile a draft costs 0.5 ms at batch 1 against a 1.6 ms step,
    but 0.1 ms at batch 64 against a 40 ms step: the same acceptance earns fewer drafts alone."""
    pol = DynamicPolicy(_calibrated(), probe_every=0)
    alone = pol.choose([PolicyInput(4, [0.7] * 4)], base_tokens=1, token_budget=1024, context=300, requests=1).ks
    full = pol.choose(
        [PolicyInput(4, [0.7] * 4)] * 64, base_tokens=64, token_budget=1024, context=64 * 300, requests=64
    ).ks
    assert 1 <= alone[0] < 4
    assert min(full) > alone[0]


def test_measured_target_time_beyond_the_profile_is_a_per_step_cost():
    """Serving adds the same time to every target call (the server's other processes take CPU per
    step, whatever the step carries): steps are predicted as measured, drafts keep their price."""
    cost = _calibrated()
    cost.calibrated = True
    slot, step = cost.per_slot(16), cost.step_seconds(16, 0, 16 * 300)
    for d in (0, 16, 32, 64) * 50:  # every call 20 ms dearer than profiled, whatever its drafts
        cost.observe_verify(16, d, 16 * 300, 0, cost.verify.predict(16, d, 16 * 300) + 0.02)
    assert abs(cost.step_seconds(16, 0, 16 * 300) - (step + 0.02)) < 1e-4
    assert cost.per_slot(16) == slot
    before = cost.step_seconds(16, 0, 16 * 300)
    cost.observe_verify(16, 0, 16 * 300, 0, 100.0)  # one wild outlier moves the estimate by at most 15 %
    assert before < cost.step_seconds(16, 0, 16 * 300) <= before * 1.15 + 1e-12
    for _ in range(400):  # and a stage faster than profiled brings the step down, never below zero
        cost.observe_verify(16, 0, 16 * 300, 0, 1e-4)
    assert 0.0 <= cost.step_seconds(16, 0, 16 * 300) < step


def test_without_a_profile_measured_time_rescales_the_generic_costs():
    cost = CostModel(overhead=0.0)  # generic costs: not calibrated
    slot, step = cost.per_slot(16), cost.step_seconds(16, 0, 16 * 300)
    for _ in range(200):  # the machine runs 1.5x slower than the generic guess
        cost.observe_verify(16, 32, 16 * 300, 0, 1.5 * cost.verify.predict(16, 32, 16 * 300))
        cost.observe_propose(32, 2, 1.5 * cost.propose.predict(32, 2))
    assert abs(cost.per_slot(16) / slot - 1.5) < 0.01
    assert abs(cost.step_seconds(16, 0, 16 * 300) / step - 1.5) < 0.01
    before = cost.verify_scale
    cost.observe_verify(16, 32, 16 * 300, 0, 100.0)  # one wild outlier moves the scale by at most 15 %
    assert before < cost.verify_scale <= before * 1.15 + 1e-12
    for _ in range(200):  # but a stage 50x dearer than its generic estimate is learned in full
        cost.observe_propose(8, 1, 50 * cost.propose.predict(8, 1))
    assert abs(cost.propose_scale / 50 - 1) < 0.05


def test_a_slow_serving_path_does_not_make_drafts_look_dearer():
    """A full batch whose target calls all take twice their profiled time, by the same amount
    whatever they carry: each step's fixed cost grew and a draft's did not, so drafting pays more
    and the policy drafts more: 2 drafts per request without the excess, all 4 with it. Treated as
    a factor (the scale of a generic cost model), the excess prices each draft at nearly twice its
    cost and the policy stops at 3."""
    reqs = [PolicyInput(4, [0.7] * 4)] * 64
    plain = _calibrated()
    plain.calibrated = True
    slow = _calibrated()
    slow.calibrated = True
    excess = slow.verify.predict(64, 0, 64 * 300)
    for d in (0, 64, 128, 256) * 50:
        slow.observe_verify(64, d, 64 * 300, 0, slow.verify.predict(64, d, 64 * 300) + excess)
    base = sum(DynamicPolicy(plain, probe_every=0).choose(reqs, 64, 2048, 64 * 300, requests=64).ks)
    busy = sum(DynamicPolicy(slow, probe_every=0).choose(reqs, 64, 2048, 64 * 300, requests=64).ks)
    assert base == 2 * 64 and busy == 4 * 64


def test_numpy_and_plain_python_allocations_agree():
    """Large batches take the vectorised path, small ones the plain-Python one: same optimum."""
    rng = np.random.default_rng(4)
    for trial in range(30):
        b = int(rng.integers(17, 80))
        cost = CostModel(
            verify=(rng.uniform(1e-3, 2e-2), rng.uniform(1e-5, 5e-4), 1e-6),
            propose=(rng.uniform(0, 2e-3), rng.uniform(1e-6, 1e-4), rng.uniform(0, 1e-3)),
        )
        pol = DynamicPolicy(cost, probe_every=0)
        reqs = [PolicyInput(int(rng.integers(0, 5)), rng.uniform(0.05, 1.0, 4).round(2).tolist()) for _ in range(b)]
        budget = b + int(rng.integers(0, 4 * b))
        vec = pol.choose(reqs, base_tokens=b, token_budget=budget, context=b * 300).ks
        t0 = cost.step_seconds(b, 0, b * 300)
        small = _allocate_lists(
            [r.alphas for r in reqs],
            [r.limit for r in reqs],
            budget - b,
            [cost.per_slot(b)] * b,
            float(b),
            t0,
            t0 + cost.propose_fixed,
            cost.per_depth,
        )[0]
        assert vec == small, trial


def test_a_request_that_rejects_everything_stops_drafting_while_others_go_on():
    """Ten drafted steps of evidence (what a request's decayed counts hold) that its drafts fail
    must outweigh a good global rate: the hopeless request gets no slot, a good one keeps its own."""
    # drafts at 60 us: a slot pays from a gain of about 0.2 on; the hopeless request's estimate is
    # 0.17 (4 pseudo-counts of the global 0.6 against 10 of its own failures), the good one's 0.68
    pol = DynamicPolicy(CostModel(verify=(10e-3, 6e-5), propose=(1e-5, 1e-5, 0.0)), probe_every=0)
    g = [0.6] * 4
    hopeless = request_alphas([10.0], [0.0], g, 4)
    good = request_alphas([10.0, 7.0], [7.0, 5.0], g, 4)
    ks = pol.choose([PolicyInput(4, hopeless)] + [PolicyInput(4, good)] * 15, base_tokens=16, token_budget=512).ks
    assert ks[0] == 0 and min(ks[1:]) == 3


def test_sampled_requests_allocation_is_the_exact_optimum_with_their_logits_cost():
    """Brute force with greedy and sampled requests mixed, where a sampled request's draft also
    costs its logits row: the policy's choice has the highest predicted goodput (both paths)."""
    rng = np.random.default_rng(7)
    for trial in range(60):
        b, big_k = int(rng.integers(1, 5)), 3
        cost = CostModel(
            verify=(rng.uniform(1e-3, 5e-3), rng.uniform(1e-5, 5e-4), rng.uniform(0, 3e-6)),
            propose=(rng.uniform(0, 2e-3), rng.uniform(1e-6, 2e-4), rng.uniform(0, 1e-3)),
        )
        cost.verify.per_logits_row = rng.uniform(0, 1e-3)
        pol = DynamicPolicy(cost, probe_every=0)
        reqs = [
            PolicyInput(
                int(rng.integers(0, big_k + 1)),
                sorted(rng.uniform(0.05, 1.0, big_k), reverse=True),
                bool(rng.integers(0, 2)),
            )
            for _ in range(b)
        ]
        context = int(rng.integers(0, 20000))

        def goodput(ks, reqs=reqs, cost=cost, b=b, context=context):
            sampled = sum(k for k, r in zip(ks, reqs) if r.sampled)
            return _expected(reqs, ks) / (
                cost.step_seconds(b, sum(ks), context, max(ks)) + cost.sampled_extra * sampled
            )

        ks = pol.choose(reqs, base_tokens=b, token_budget=10 * b, context=context).ks
        best = max(goodput(list(alt)) for alt in itertools.product(*[range(r.limit + 1) for r in reqs]))
        assert goodput(ks) >= best * (1 - 1e-12), (trial, ks)
        t0 = cost.step_seconds(b, 0, context)
        costs = [cost.per_slot(b) + (cost.sampled_extra if r.sampled else 0.0) for r in reqs]
        small = _allocate_lists(
            [r.alphas for r in reqs],
            [r.limit for r in reqs],
            9 * b,
            costs,
            float(b),
            t0,
            t0 + cost.propose_fixed,
            cost.per_depth,
        )[0]
        assert goodput(small) >= best * (1 - 1e-12), (trial, small)


def test_a_sampled_request_drafts_less_than_a_greedy_one_when_its_logits_rows_are_dear():
    """Same acceptance, same batch: the request verified by rejection sampling pays a logits row
    per draft (here 0.5 ms against 0.05 ms for the draft itself) and gets fewer drafts."""
    cost = CostModel(verify=(10e-3, 5e-5), propose=(1e-5, 1e-5, 0.0))
    cost.verify.per_logits_row = 5e-4
    pol = DynamicPolicy(cost, probe_every=0)
    greedy, sampled = PolicyInput(4, [0.6] * 4), PolicyInput(4, [0.6] * 4, sampled=True)
    ks = pol.choose([greedy, sampled] * 8, base_tokens=16, token_budget=512).ks
    assert ks[0::2] == [ks[0]] * 8 and ks[1::2] == [ks[1]] * 8
    assert ks[0] > ks[1]
    cost.verify.per_logits_row = 0.0  # without that cost they are treated alike
    ks = pol.choose([greedy, sampled] * 8, base_tokens=16, token_budget=512).ks
    assert ks[0::2] == ks[1::2]


def test_the_scheduler_hands_the_policy_request_alphas_estimates():
    """The scheduler builds the policy's inputs in one pass (the hot path of a decision): plain lists
    for a few requests, arrays for many. Both forms must hold exactly what ``request_alphas`` and the
    per-request caps give (max_tokens, the request's own num_draft_tokens, its KV room), per mode."""
    from lightspec_core.config import SamplingParams
    from lightspec_core.engine.block_manager import BlockManager
    from lightspec_core.engine.scheduler import Scheduler
    from lightspec_core.engine.sequence import Sequence

    class Recorder(StaticPolicy):
        def choose(self, reqs, *a, **kw):
            self.seen = reqs
            return super().choose(reqs, *a, **kw)

    acc = AcceptanceStats(4)
    for _ in range(5):
        acc.observe(4, 2)  # greedy rates move away from the prior; sampled ones stay at it
    pol = Recorder(4)
    # 47 tokens each after the first generated one: 3 blocks of 16, one spare slot in its own blocks
    sched = Scheduler(
        BlockManager(16, 16),
        pol,
        acc,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_draft_tokens=4,
        kv_high_water=0.95,
        speculative=True,
    )
    # (temperature, max_tokens, num_draft_tokens): the third may emit 3 more tokens (so 2 drafts),
    # the fourth asked for 1 draft at most
    specs = [(0.0, 50, None), (0.7, 50, None), (0.0, 4, None), (0.7, 50, 1)]
    seqs = []
    for i, (temp, max_tokens, ndt) in enumerate(specs):
        s = Sequence(
            f"r{i}",
            list(range(3, 49)),
            SamplingParams(max_tokens=max_tokens, temperature=temp, num_draft_tokens=ndt),
            detok=None,
            seed=i,
            arrival=i,
        )
        sched.add(s)
        seqs.append(s)
    for it in sched.schedule().items:  # admission: the prompts are prefilled
        it.seq.num_computed += it.num_new
        it.seq.token_ids.append(5)  # the first generated token
        it.seq.warm = True
    for s in seqs:  # some draft history of their own
        s.record_acceptance(3, 1)
        s.record_acceptance(2, 2)
    # above the KV high-water mark (no free slots counted) a request drafts into its own blocks only:
    # here one spare slot each
    assert sched.blocks.num_free == 4
    assert sched._small_batch(seqs, 0).limits == sched._array_batch(seqs, 0).limits.tolist() == [1, 1, 1, 1]
    sched.schedule()
    small = pol.seen
    assert small.small and len(small) == 4
    free = sched.blocks.num_free * 16
    arrays = sched._array_batch(seqs, free)
    assert not arrays.small
    assert small.limits == arrays.limits.tolist() == [4, 4, 2, 1]
    seqs[0].draft_room = 2  # e.g. the fused MTP drafts the target stage returned for it
    assert sched._small_batch(seqs, free).limits == sched._array_batch(seqs, free).limits.tolist() == [2, 4, 2, 1]
    seqs[0].draft_room = 1 << 30
    assert small.sampled == arrays.sampled.tolist() == [False, True, False, True]
    for i, s in enumerate(seqs):
        sampled = s.params.temperature > 0
        # bit for bit what the per-request helper gives (positions never drafted: the global rate)
        want = request_alphas(s.pos_reached, s.pos_accepted, acc.rates(sampled).tolist(), 4)
        assert small.alphas[i] == arrays.alphas[i].tolist() == want
        assert want[3] == acc.rates(sampled)[3]
    assert small.alphas[0] != small.alphas[1]  # the two modes' global rates differ


def test_the_scheduler_hands_the_policy_the_steps_tokens_context_and_prefill():
    """schedule() counts a step's tokens, prompt-chunk tokens and longest context as it plans (not in
    passes of their own): the policy must get what the plan's items add up to, with a prompt chunk,
    a newly admitted prompt and decoding requests in one step."""
    from lightspec_core.config import SamplingParams
    from lightspec_core.engine.block_manager import BlockManager
    from lightspec_core.engine.scheduler import Scheduler
    from lightspec_core.engine.sequence import Sequence

    class Recorder(StaticPolicy):
        def choose(self, reqs, *a, **kw):
            self.args = a
            return super().choose(reqs, *a, **kw)

    pol = Recorder(2)
    sched = Scheduler(
        BlockManager(64, 16),
        pol,
        AcceptanceStats(4),
        max_num_seqs=8,
        max_num_batched_tokens=100,
        max_draft_tokens=4,
        kv_high_water=0.95,
        speculative=True,
    )
    seqs = [
        Sequence(f"r{i}", list(range(3, 3 + n)), SamplingParams(max_tokens=50), detok=None, seed=i, arrival=i)
        for i, n in enumerate([20, 30, 70])
    ]
    for s in seqs:
        sched.add(s)
    first = sched.schedule()  # 20 + 30 + a 50-token chunk of the third prompt
    assert [it.num_new for it in first.items] == [20, 30, 50] and first.prefill_tokens == 100
    for it in first.items:
        it.seq.num_computed += it.num_new
        if it.samples:
            it.seq.token_ids.append(5)
            it.seq.warm = True
    late = Sequence("r3", list(range(3, 43)), SamplingParams(max_tokens=50), detok=None, seed=3, arrival=3)
    sched.add(late)
    plan = sched.schedule()
    # two decoding requests (1 token each), the rest of the chunked prompt (20), 40 of the new prompt
    # (the budget's remaining 100 - 22 = 78 would allow all of it)
    assert [it.num_new for it in plan.items] == [1, 1, 20, 40]
    assert plan.prefill_tokens == 60
    base, token_budget, context, prefill, requests = pol.args
    assert base == 62 and token_budget == 100 and prefill == 60 and requests == 4
    assert context == 4 * max(it.start + it.num_new for it in plan.items) == 4 * 70
    assert plan.ks == [2, 2, 0, 0]  # only the warm decoding requests draft


def test_confidence_stats_learn_acceptance_per_mode_position_and_bucket():
    stats = ConfidenceStats(3, buckets=10)
    prior = stats.table()
    assert prior.shape == (2, 3, 10)
    assert (np.diff(prior[0, 0]) > 0).all()  # the prior trusts a confident head more
    for _ in range(300):  # a confident first draft accepted, an unsure second one rejected
        stats.observe([0.95, 0.05, 0.5], accepted=1)
    t = stats.table()
    assert t[0, 0, 9] > 0.95 and t[0, 1, 0] < 0.05
    assert t[0, 2, 5] == prior[0, 2, 5]  # a draft after the first rejection was never tested
    assert (t[1] == prior[1]).all()  # sampled drafts learn apart
    stats.observe([0.95], accepted=0, sampled=True)
    assert t[1, 0, 9] > stats.table()[1, 0, 9]


def test_gain_floor_is_the_planned_goodput_times_a_drafts_cost():
    """A draft pays while its expected tokens per second of cost beat the step's goodput, so the
    floor handed to the MTP runner is G x (seconds one draft adds) at the chosen allocation."""
    pol = _policy(c0=10e-3, c_tok=1e-3)
    cost = pol.cost
    assert pol.choose([PolicyInput(4, [0.8] * 4)], base_tokens=1, token_budget=64).floors is None  # not asked for
    pol.floors = True
    floors = pol.choose([PolicyInput(4, [0.8] * 4)], base_tokens=1, token_budget=64).floors
    g = (1 + 0.8 + 0.8**2 + 0.8**3 + 0.8**4) / cost.step_seconds(1, 4, depth=4)
    assert floors == pytest.approx([g * cost.per_slot(1)])
    assert 0.2 < floors[0] < 0.3  # ~0.24: about the 4th draft's own 0.8^4 = 0.41 and below
    # the numpy path (over 64 slots) gives the same floors; a sampled request's draft costs more
    reqs = [PolicyInput(4, [0.8] * 4, sampled=i % 2 == 1) for i in range(20)]
    cost.verify.per_logits_row = 1e-4
    decision = pol.choose(reqs, base_tokens=20, token_budget=400)
    ks = decision.ks
    e = sum(1 + sum(0.8 ** (j + 1) for j in range(k)) for k in ks)
    sampled_drafts = sum(k for k, r in zip(ks, reqs) if r.sampled)
    g = e / (cost.step_seconds(20, sum(ks), depth=max(ks)) + cost.sampled_extra * sampled_drafts)
    want = [g * (cost.per_slot(20) + (cost.sampled_extra if r.sampled else 0.0)) for r in reqs]
    assert decision.floors == pytest.approx(want)
    # nothing drafted (or a probe): no floor
    idle = _policy(c0=10e-3, c_tok=1e-5, p0=50e-3)
    idle.floors = True
    nothing = idle.choose([PolicyInput(4, [0.6] * 4)], base_tokens=1, token_budget=64)
    assert nothing.ks == [0] and nothing.floors is None


def test_bench_scheduler_measures_decisions_that_draft():
    """The decision-time benchmark is only representative if its requests draft as in serving:
    under its cost model good requests draft deep and poor ones not at all (about 1.7 drafts per
    request at 64 requests; with the old generic costs it drafted only on probes, 0.1)."""
    from tools.bench_scheduler import measure

    r = measure(64, 300)
    assert 0.8 < r["drafts_per_request"] < 3.5
    static = measure(16, 100, policy="static")
    assert static["drafts_per_request"] > 3.5  # static:4, every request 4 (bar max_tokens and KV room)
