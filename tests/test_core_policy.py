"""Speculation policies on plain lists: goodput maximisation and the static baseline."""

from __future__ import annotations

from lightspec_core.policy import AcceptanceStats, CostModel, DynamicPolicy, PolicyInput, StaticPolicy, request_alphas


def _policy(c0, c_tok, c_draft=0.0, p0=0.0):
    return DynamicPolicy(CostModel(verify=(c0, c_tok), propose=(p0, max(c_draft, 1e-7))))


def test_cheap_verification_speculates_to_the_limit():
    pol = _policy(c0=10e-3, c_tok=0.05e-3)
    assert pol.choose([PolicyInput(4, [0.8] * 4)], base_tokens=1, token_budget=512) == [4]


def test_expensive_tokens_at_high_load_disable_low_acceptance_drafts():
    pol = _policy(c0=10e-3, c_tok=1e-3)
    reqs = [PolicyInput(4, [0.3] * 4) for _ in range(63)] + [PolicyInput(4, [0.99] * 4)]
    ks = pol.choose(reqs, base_tokens=64, token_budget=1024)
    assert ks[:63] == [0] * 63  # G = 64/74 tokens/ms > 0.3 / 1
    assert ks[63] == 4  # 0.99^j stays above G


def test_goodput_is_not_lowered_by_any_single_change():
    pol = _policy(c0=5e-3, c_tok=0.4e-3, c_draft=0.1e-3)
    reqs = [PolicyInput(4, a) for a in ([0.9, 0.8, 0.6, 0.4], [0.5] * 4, [0.95] * 4, [0.1] * 4)]
    ks = pol.choose(reqs, base_tokens=4, token_budget=100)

    def goodput(ks):
        e = 0.0
        for r, k in zip(reqs, ks):
            prod = 1.0
            e += 1
            for j in range(k):
                prod *= r.alphas[j]
                e += prod
        return e / pol.cost.step_seconds(4 + sum(ks), sum(ks))

    best = goodput(ks)
    for i in range(4):
        for d in (-1, 1):
            alt = list(ks)
            alt[i] += d
            if 0 <= alt[i] <= 4:
                assert goodput(alt) <= best + 1e-12


def test_token_budget_and_limits_are_respected():
    pol = _policy(c0=10e-3, c_tok=1e-6)
    ks = pol.choose([PolicyInput(2, [0.9] * 2), PolicyInput(4, [0.9] * 4)], base_tokens=2, token_budget=5)
    assert ks[0] <= 2 and sum(ks) == 3
    assert StaticPolicy(3).choose([PolicyInput(2, [0.5] * 2), PolicyInput(4, [0.5] * 4)], 2, 100) == [2, 3]
    assert StaticPolicy(3).choose([PolicyInput(4, [0.5] * 4)] * 3, 3, 7) == [3, 1, 0]


def test_cost_model_learns_per_token_cost():
    cost = CostModel()
    for n in range(1, 300):
        tokens = 1 + (n * 37) % 200
        cost.verify.observe(tokens, 4e-3 + 2e-4 * tokens)
        cost.propose.observe(n % 9, 1e-3 + 3e-5 * (n % 9))
    assert abs(cost.verify.slope - 2e-4) < 2e-5
    assert abs(cost.step_seconds(100, 0) - 0.024) < 2e-3
    assert abs(cost.per_slot - 2.3e-4) < 3e-5


def test_proposer_overhead_that_drafting_cannot_repay_disables_drafts():
    # 50 ms to propose at all, 0.6 acceptance, cheap verify: one step costs 10 ms without drafts
    pol = _policy(c0=10e-3, c_tok=1e-5, p0=50e-3)
    assert pol.choose([PolicyInput(4, [0.6] * 4)], base_tokens=1, token_budget=64) == [0]
    cheap = _policy(c0=10e-3, c_tok=1e-5, p0=1e-3)
    assert cheap.choose([PolicyInput(4, [0.6] * 4)], base_tokens=1, token_budget=64) == [4]


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


def test_policy_probes_again_after_deciding_not_to_draft():
    pol = _policy(c0=10e-3, c_tok=1e-5, p0=50e-3)  # drafting looks unprofitable
    reqs = [PolicyInput(4, [0.6] * 4), PolicyInput(0, [])]
    decisions = [pol.choose(reqs, base_tokens=2, token_budget=64) for _ in range(16)]
    probes = [i for i, ks in enumerate(decisions) if any(ks)]
    assert probes == [7, 15]  # one probe every 8 idle decisions, never more
    assert decisions[7] == [1, 0]  # one draft for the request that may draft
