"""Verification: greedy prefix acceptance and distribution-preserving rejection sampling."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from lightspec_core.spec.sampling import keyed_noise, probs_and_max, probs_from_logits, race, sample_with_uniforms
from lightspec_core.spec.verify import verify_coupled, verify_greedy, verify_rejection


def test_greedy_accepts_matching_prefix_then_target_token():
    assert verify_greedy([5, 7, 9], [5, 7, 8, 1]) == [5, 7, 8]
    assert verify_greedy([5, 7], [5, 7, 3]) == [5, 7, 3]  # all accepted + bonus
    assert verify_greedy([4], [6, 2]) == [6]
    assert verify_greedy([], [3]) == [3]


def _first_token_counts(p, q, n, seed, point_mass=False):
    rng = np.random.default_rng(seed)
    v = len(p)
    counts = np.zeros(v)
    for _ in range(n):
        if point_mass:
            draft = [int(np.argmax(q))]
            qarr = None
        else:
            draft = [int(rng.choice(v, p=q))]
            qarr = q[None]
        out = verify_rejection(draft, qarr, np.stack([p, p]), rng)
        counts[out[0]] += 1
    return counts


@pytest.mark.parametrize("point_mass", [False, True])
def test_rejection_sampling_keeps_target_distribution(point_mass):
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.1, 0.2, 0.3, 0.3])  # a bad proposer
    n = 20000
    counts = _first_token_counts(p, q, n, seed=0, point_mass=point_mass)
    assert chisquare(counts, p * n).pvalue > 1e-3


def test_a_proposal_over_fewer_ids_than_the_target_is_verified_as_zero_past_them():
    """A draft model with fewer padding rows than the target proposes nothing past its rows."""
    gen = np.random.default_rng(0)
    for _ in range(200):
        p = gen.dirichlet(np.ones(12), size=4)
        q = gen.dirichlet(np.ones(9), size=3)  # the draft's 9 rows of the target's 12
        drafts = [int(gen.choice(9, p=row)) for row in q]
        seed = int(gen.integers(1 << 30))
        narrow = verify_rejection(drafts, q, p, np.random.default_rng(seed))
        padded = verify_rejection(drafts, np.pad(q, ((0, 0), (0, 3))), p, np.random.default_rng(seed))
        assert narrow == padded


@pytest.mark.parametrize("proposal", ["nan", "nan-on-its-vocabulary"])
def test_a_proposal_that_is_not_finite_rejects_its_draft_and_draws_from_the_target(proposal):
    """A proposer whose logits were NaN or inf proposes a NaN distribution (a draft model's or MTP
    heads' over a smaller vocabulary: NaN on theirs, 0 past it). Its draft is only a proposal: the
    token comes from the target's distribution, drawn as without drafts."""
    gen = np.random.default_rng(0)
    for _ in range(200):
        p = gen.dirichlet(np.ones(12), size=3)
        q = gen.dirichlet(np.ones(12), size=2)
        q[0] = np.nan
        if proposal == "nan-on-its-vocabulary":
            q[0, 8:] = 0.0
        drafts = [int(gen.integers(8)), int(gen.integers(12))]
        seed = int(gen.integers(1 << 30))
        out = verify_rejection(drafts, q, p, np.random.default_rng(seed))
        assert out == verify_rejection([], None, p[:1], np.random.default_rng(seed))


P = np.array([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
Q = np.array([0.1, 0.1, 0.2, 0.3, 0.2, 0.1])  # a bad proposer, with mass where the target has none


@pytest.mark.parametrize("proposer", ["raced from q", "point mass", "uniform at random"])
def test_coupled_verification_emits_the_draw_without_drafts_so_keeps_the_target_distribution(proposer):
    """Whatever the drafts, each emitted token is the race of the target's distribution with its
    position's noise: the token decoding without drafts draws, so exactly distributed as p."""
    gen = np.random.default_rng(1)
    n = 20000
    counts = np.zeros(len(P))
    accepted = 0
    for seed in range(n):
        noise = np.stack([keyed_noise(seed, j, len(P)) for j in range(3)])
        if proposer == "raced from q":
            drafts = [race(Q, noise[0]), race(Q, noise[1])]
        elif proposer == "point mass":
            drafts = [int(np.argmax(Q))] * 2
        else:
            drafts = [int(d) for d in gen.integers(len(P), size=2)]
        out = verify_coupled(drafts, np.stack([P, P, P]), noise.__getitem__)
        alone = [race(P, noise[j]) for j in range(len(out))]
        assert out == alone and out[:-1] == drafts[: len(out) - 1]
        counts[out[0]] += 1
        accepted += len(out) > 1  # the first draft was accepted
    assert counts[-1] == 0, "drew a token the target gives no probability"
    assert chisquare(counts[:-1], P[:-1] * n).pvalue > 1e-3
    if proposer == "raced from q":
        tv = 0.5 * np.abs(P - Q).sum()
        # the first draft's acceptance: at least (1 - TV)/(1 + TV) for drafts raced with the same noise
        assert accepted / n > (1 - tv) / (1 + tv)


def test_keyed_noise_is_fixed_by_seed_and_position_alone_and_a_shorter_vocabulary_takes_a_prefix():
    a = keyed_noise(7, 12, 4096)
    assert np.array_equal(a, keyed_noise(7, 12, 4096)) and (a > 0).all() and a.dtype == np.float32
    assert not np.array_equal(a, keyed_noise(7, 13, 4096)) and not np.array_equal(a, keyed_noise(8, 12, 4096))
    # a draft model with fewer padding rows races over a prefix of the target's noise
    assert np.array_equal(keyed_noise(7, 12, 4000), a[:4000])
    assert np.array_equal(keyed_noise((1 << 64) - 1, 0, 8), keyed_noise((1 << 64) - 1, 0, 8))


def test_chi_square_detects_a_biased_verifier():
    # negative control: emitting the draft unconditionally yields q, and the test must see it
    rng = np.random.default_rng(0)
    p = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    q = np.array([0.1, 0.1, 0.2, 0.3, 0.3])
    counts = np.bincount(rng.choice(5, size=20000, p=q), minlength=5)
    assert chisquare(counts, p * 20000).pvalue < 1e-6


def test_processed_distribution_applies_temperature_top_k_top_p():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]] * 4)
    temp = torch.tensor([1.0, 0.5, 1.0, 0.0])
    top_k = torch.tensor([0, 0, 2, 0])
    top_p = torch.tensor([0.7, 1.0, 1.0, 1.0])
    probs = probs_from_logits(logits, temp, top_k, top_p)
    full = torch.softmax(logits[0], -1)
    # top-p 0.7: smallest prefix reaching 0.7 mass is tokens {0, 1}
    assert full[0] < 0.7 <= full[0] + full[1]
    torch.testing.assert_close(probs[0], torch.cat([full[:2] / full[:2].sum(), torch.zeros(3)]))
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.5, -1))
    assert (probs[2][2:] == 0).all() and abs(float(probs[2].sum()) - 1) < 1e-6
    assert probs[3].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


def test_a_tiny_temperature_is_greedy_s_limit_not_nan():
    logits = torch.tensor([[10.0, 5.0, -3.0, 2.0], [1.0, 4.0, float("-inf"), 0.5]])  # -inf: an end token masked
    for t in (1e-30, 1e-39, 1e-45):  # 1e-39 and 1e-45 are float32 denormals: logits / t overflows
        probs = probs_from_logits(logits, torch.full((2,), t), torch.zeros(2, dtype=torch.int64), torch.ones(2))
        assert torch.equal(probs, torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0]])), (t, probs)


def test_a_row_without_top_p_keeps_its_tail_beside_a_row_with_it():
    """A row's distribution must not depend on its batch: in float32 a row's running sum reaches 1
    before its long tail ends, and a top_p of 1 must keep that tail all the same."""
    gen = torch.Generator().manual_seed(0)
    row = torch.cat([torch.tensor([12.0, 11.0, 10.0]), torch.randn(4093, generator=gen) - 6.0])
    logits = torch.stack([row, row])
    alone = probs_from_logits(logits[:1], torch.ones(1), torch.zeros(1, dtype=torch.int64), torch.ones(1))
    beside = probs_from_logits(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64), torch.tensor([1.0, 0.9]))
    assert torch.equal(beside[0], alone[0]) and int((alone[0] == 0).sum()) == 0
    assert int((beside[1] == 0).sum()) > 4000  # the other row did get its nucleus


def test_inverse_cdf_sampling_follows_probs():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(20000, 1)
    u = torch.from_numpy(np.random.default_rng(3).random(20000).astype(np.float32))
    counts = np.bincount(sample_with_uniforms(probs, u).numpy(), minlength=4)
    assert counts[1] == 0
    assert chisquare(counts[[0, 2, 3]], np.array([0.1, 0.6, 0.3]) * 20000).pvalue > 1e-3


def test_the_row_maxima_tell_the_rows_without_a_distribution_and_masking_is_no_fault():
    logits = torch.randn(5, 32, generator=torch.Generator().manual_seed(0))
    logits[1, 3] = float("nan")
    logits[2, 4] = float("inf")
    logits[3] = float("-inf")  # every token masked: nothing to sample
    logits[4, :16] = float("-inf")  # masked tokens beside finite ones: a distribution
    args = (
        torch.tensor([1.0, 1.0, 1.0, 0.0, 0.7]),
        torch.tensor([0, 0, 5, 0, 3]),
        torch.tensor([1.0, 1.0, 1.0, 1.0, 0.9]),
    )
    probs, row_max = probs_and_max(logits, *args)
    torch.testing.assert_close(probs, probs_from_logits(logits, *args), rtol=0, atol=0, equal_nan=True)
    assert torch.isfinite(row_max).tolist() == [True, False, False, False, True]
    assert row_max[0] == logits[0].max() and row_max[4] == logits[4].max()
    assert torch.isfinite(probs[[0, 4]]).all() and (probs[4, :16] == 0).all()
