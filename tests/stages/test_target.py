"""The paged runner against Hugging Face transformers and against contiguous execution."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightspec_core.models.llama import LlamaModel
from lightspec_core.models.paged import PagedBatch, attend_pool, attend_sdpa, bag_rows, row_mask
from lightspec_core.stages.contract import ModelCall
from lightspec_core.stages.target import ModelRunner


def _call(runner: ModelRunner, reqs, tables, sample_all=True):
    """reqs: list of (token ids, start position); returns logits at every fed position [N, V]."""
    ids = np.array([t for toks, _ in reqs for t in toks], np.int64)
    pos = np.array([p for toks, s in reqs for p in range(s, s + len(toks))], np.int64)
    width = max(len(t) for t in tables)
    bt = np.zeros((len(tables), width), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    call = ModelCall(
        ids,
        pos,
        np.array([len(t) for t, _ in reqs], np.int32),
        bt,
        np.arange(len(ids), dtype=np.int64),
        np.array([True]),
        np.array([True]),
    )
    return runner.execute(call)


def _hf_logits(hf, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize("which", ["default", "smoke"])
def test_runner_matches_transformers_on_mixed_batch_and_after_rollback(which, attention, request, monkeypatch):
    """Both attention paths of decode and verify rows (models/cpu_attention.py's kernel where it is
    built, the torch reference) against transformers."""
    from transformers import LlamaForCausalLM

    from lightspec_core.models import cpu_attention

    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "on" if attention == "native" else "off")
    if attention == "native" and cpu_attention.kernel() is None:
        pytest.skip("no C compiler on this machine: the native kernel is not built")

    root = request.getfixturevalue(f"{which}_model")
    target = root / "target"
    hf = LlamaForCausalLM.from_pretrained(str(target), torch_dtype=torch.float32).eval()
    runner = ModelRunner(target, num_blocks=64, block_size=4)
    vocab = runner.config.vocab_size
    rng = np.random.default_rng(0)
    a, b, c = (rng.integers(3, vocab, n).tolist() for n in (13, 6, 9))
    tables = [[5, 9, 1, 30, 2, 7], [11, 3, 40, 41], [20, 21, 22, 23, 24]]

    # step 1: c's prompt is prefilled alone
    _call(runner, [(c[:8], 0)], [tables[2]])
    # step 2: two prefills of different lengths and a decode, packed
    res = _call(runner, [(a, 0), (b, 0), (c[8:9], 8)], tables)
    got = res.logits
    want = np.concatenate([_hf_logits(hf, a), _hf_logits(hf, b), _hf_logits(hf, c)[8:9]])
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    np.testing.assert_array_equal(res.top1_ids, want.argmax(-1))

    # step 3: a verifies 4 "drafts" of garbage; then roll back: only the first is kept and the next
    # step rewrites positions 14.. with other tokens. No copy: stale slots must never be read.
    junk = rng.integers(3, vocab, 4).tolist()
    _call(runner, [(junk, 13)], [tables[0]])
    fresh = rng.integers(3, vocab, 3).tolist()
    res = _call(runner, [(fresh, 14)], [tables[0]])
    seq = a + junk[:1] + fresh
    np.testing.assert_allclose(res.logits, _hf_logits(hf, seq)[14:], atol=1e-4, rtol=0)


def test_runner_returns_logits_of_the_marked_rows_only(smoke_model):
    """A mixed batch marks the sample rows of its sampled requests: exactly those rows' logits come
    back, in order (greedy rows need only their top-1 id); a flag count that does not match the
    sample rows is an error naming the tensor."""
    runner = ModelRunner(smoke_model / "target", num_blocks=16, block_size=4)
    rng = np.random.default_rng(2)
    ids = rng.integers(3, runner.config.vocab_size, 9).astype(np.int64)

    def call(flags):
        return runner.execute(
            ModelCall(
                ids,
                np.arange(9, dtype=np.int64),
                np.array([9], np.int32),
                np.array([[0, 1, 2]], np.int32),
                np.arange(9, dtype=np.int64),
                np.array(flags),
                np.array([False]),
            )
        )

    full = call([True])
    mask = [True, False, False, True, True, False, True, False, False]
    part = call(mask)
    assert part.logits.shape == (4, runner.config.vocab_size)
    np.testing.assert_allclose(part.logits, full.logits[np.flatnonzero(mask)], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(part.top1_ids, full.top1_ids)
    assert call([False]).logits.shape == (0, runner.config.vocab_size)
    with pytest.raises(ValueError, match="return_logits: 2 flags for 9 sample rows"):
        call([True, False])


def test_paged_equals_contiguous_for_random_block_assignments(smoke_model):
    model = LlamaModel.load(smoke_model / "target")
    vocab, bs = model.config.vocab_size, 4
    rng = np.random.default_rng(1)
    for trial in range(5):
        lens = rng.integers(1, 30, size=4).tolist()
        seqs = [torch.tensor(rng.integers(3, vocab, n)) for n in lens]
        need = [-(-n // bs) for n in lens]
        perm = rng.permutation(sum(need) + 7)  # random, non-contiguous, interleaved blocks
        tables, o = [], 0
        for n in need:
            tables.append(perm[o : o + n].tolist())
            o += n
        width = max(need)
        bt = torch.zeros(len(lens), width, dtype=torch.int32)
        for r, t in enumerate(tables):
            bt[r, : len(t)] = torch.tensor(t)
        kv = model.new_kv_cache(len(perm), bs)
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(n) for n in lens])
        batch = PagedBatch.build(
            ids, pos, lens, bt, bs, torch.arange(len(ids)), model.config.num_key_value_heads, model.config.head_dim
        )
        paged = model.forward_paged(batch, kv)
        with torch.no_grad():
            contiguous = torch.cat([model.forward_train(s.unsqueeze(0))[0] for s in seqs])
        torch.testing.assert_close(paged, contiguous, atol=1e-5, rtol=0)


def test_attention_pads_each_request_only_within_its_group():
    """Decoding rows, verification rows and a prompt chunk attend in separate padded grids: a
    decoding request never pays for a 40-token chunk's query length or a far longer context (beyond
    rounding it up to whole blocks)."""
    lens = [1, 1, 1, 5, 3, 40]
    starts = [300, 120, 7, 250, 60, 0]  # position of each request's first new token
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    bt = torch.arange(6 * 20, dtype=torch.int32).view(6, 20)
    batch = PagedBatch.build(
        torch.zeros(sum(lens), dtype=torch.int64), pos, lens, bt, 16, torch.arange(sum(lens)), 2, 8
    )
    shapes = sorted((g.num_requests, g.max_query, g.max_context, g.padded_context) for g in batch.groups)
    assert shapes == [(1, 40, 40, 48), (2, 5, 255, 256), (3, 1, 301, 304)]
    rows = torch.sort(torch.cat([g.token_rows for g in batch.groups])).values
    assert torch.equal(rows, torch.arange(sum(lens)))  # every new token in exactly one group
    decode = next(g for g in batch.groups if g.max_query == 1)  # requests 0, 1, 2: 19 tiles of 2 heads each
    assert decode.tile_rows.view(3, 2, 19)[1, 1, :3].tolist() == [2 * 20 + 1, 2 * 21 + 1, 2 * 22 + 1]


def test_a_chunk_groups_mask_shows_each_query_its_own_and_earlier_keys_and_padding_key_zero():
    """Requests of 9 and 12 new tokens share a chunk group padded to 12 queries: a query at position
    p sees keys 0..p; the shorter request's padded queries see key 0 only (a finite softmax)."""
    pos = torch.cat([torch.arange(3, 12), torch.arange(20, 32)])
    bt = torch.arange(16, dtype=torch.int32).view(2, 8)
    batch = PagedBatch.build(torch.zeros(len(pos), dtype=torch.int64), pos, [9, 12], bt, 4, torch.arange(21), 1, 4)
    (g,) = batch.groups
    mask = g.mask
    assert mask.shape == (2, 1, 12, 32) and mask.dtype == torch.float32
    keys = torch.arange(32)
    for r, first in enumerate((3, 20)):
        for i in range(12):
            p = first + i if r == 1 or i < 9 else -1
            visible = keys <= p if p >= 0 else keys == 0
            assert torch.equal(mask[r, 0, i] == 0, visible), (r, i)
            assert torch.isneginf(mask[r, 0, i][~visible]).all()


@pytest.mark.parametrize("q_len", [1, 3, 40])
def test_attention_read_from_the_pool_equals_the_fused_kernel_over_gathered_context(q_len):
    """The two attention routines of a group (sums of pool rows for decoding and verification, the
    fused kernel over gathered tiles for prompt chunks) give the same output on the same pool."""
    gen = torch.Generator().manual_seed(q_len)
    b, heads, kvh, hd, block, blocks = 3, 8, 2, 16, 4, 24
    pos = torch.cat([torch.arange(s, s + q_len) for s in (0, 17, 50)])
    tables = torch.randperm(b * blocks, generator=gen).to(torch.int32).view(b, blocks)
    batch = PagedBatch.build(
        torch.zeros(len(pos), dtype=torch.int64), pos, [q_len] * b, tables, block, torch.arange(len(pos)), kvh, hd
    )
    (g,) = batch.groups
    q = torch.randn(b, q_len, heads, hd, generator=gen)
    keys, values = (torch.randn(b * blocks, kvh, block, hd, generator=gen) for _ in range(2))
    pool_k = keys.transpose(-1, -2).reshape(b * blocks, kvh, -1)  # key tiles are stored [hd, block]
    pool_v = values.reshape(b * blocks, kvh, -1)
    rows = bag_rows(g, heads // kvh, block, hd)
    got = attend_pool(q, pool_k, pool_v, rows, row_mask(g.mask, kvh, heads // kvh, torch.float32))

    def context(pool):  # [blocks, kv, block, hd] -> each request's tiles in order [Bg, kv, P, hd]
        return pool.view(-1, block, hd)[g.tile_rows].view(b, kvh, -1, hd)

    torch.testing.assert_close(got, attend_sdpa(q, context(keys), context(values), g.mask), atol=1e-5, rtol=0)


def _mtp_call(hidden, last_ids, ks, temps, uniforms):
    from lightspec_core.stages.contract import MTPCall

    b = len(ks)
    return MTPCall(
        hidden=hidden,
        last_ids=last_ids,
        num_tokens=np.asarray(ks, np.int32),
        temperature=np.asarray(temps, np.float32),
        top_k=np.zeros(b, np.int32),
        top_p=np.ones(b, np.float32),
        uniforms=uniforms,
        return_probs=np.array([any(t > 0 for t in temps)]),
    )


def test_mtp_rows_with_different_depths_equal_each_row_alone(default_model):
    """The MTP stage runs head j only on rows that asked for more than j drafts; a row's drafts
    and proposal distribution must not depend on which other rows share the call."""
    from lightspec_core.stages.mtp import MTPRunner

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    rng = np.random.default_rng(0)
    b, big_k = 6, runner.num_heads
    hidden = rng.standard_normal((b, runner.target.config.hidden_size)).astype(np.float32)
    last = rng.integers(3, runner.target.config.vocab_size, b).astype(np.int64)
    ks = [0, 4, 1, 3, 0, 2]
    temps = [0.0, 1.0, 0.0, 0.8, 1.0, 1.0]
    u = rng.random((b, big_k)).astype(np.float32)
    res = runner.execute(_mtp_call(hidden, last, ks, temps, u))
    for r in range(b):
        alone = runner.execute(
            _mtp_call(hidden[r : r + 1], last[r : r + 1], ks[r : r + 1], temps[r : r + 1], u[r : r + 1])
        )
        assert res.draft_ids[r].tolist() == alone.draft_ids[0].tolist()
        assert (res.draft_ids[r, ks[r] :] == -1).all() and (res.draft_ids[r, : ks[r]] >= 0).all()
        if temps[r] > 0:
            np.testing.assert_allclose(res.draft_probs[r], alone.draft_probs[0], atol=1e-5)
            assert np.allclose(res.draft_probs[r, : ks[r]].sum(-1), 1.0, atol=1e-4)
            assert not res.draft_probs[r, ks[r] :].any()
    # the default heads propose from their frequency-ranked draft vocabulary only
    vocab = runner.heads.draft_vocab
    assert vocab and len(vocab) == 1024
    outside = np.setdiff1d(np.arange(runner.vocab_size), vocab)
    drafted = res.draft_ids[res.draft_ids >= 0]
    assert len(drafted) == sum(ks) and np.isin(drafted, vocab).all()
    assert not res.draft_probs[:, :, outside].any()


def test_mtp_rows_with_noise_race_their_proposal_and_the_others_draw_as_without(default_model):
    """MTPCall.noise: a sampled row with noise drafts argmax(q / noise) (the race its verification
    runs over the target's distribution), a row with -1 draws by its uniform as in a call without
    noise; a noise of another shape is refused naming the field."""
    from lightspec_core.spec.sampling import keyed_noise, race
    from lightspec_core.stages.mtp import MTPRunner

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    rng = np.random.default_rng(1)
    b, big_k, v = 3, runner.num_heads, runner.vocab_size
    hidden = rng.standard_normal((b, runner.target.config.hidden_size)).astype(np.float32)
    last = rng.integers(3, v, b).astype(np.int64)
    ks, temps = [3, 3, 2], [1.0, 1.0, 0.0]
    u = rng.random((b, big_k)).astype(np.float32)
    noise = np.full((b, big_k, v), -1.0, np.float32)
    noise[0] = np.stack([keyed_noise(5, j, v) for j in range(big_k)])
    call = _mtp_call(hidden, last, ks, temps, u)
    call.noise = noise
    raced = runner.execute(call)
    plain = runner.execute(_mtp_call(hidden, last, ks, temps, u))
    assert [race(raced.draft_probs[0, j], noise[0, j]) for j in range(3)] == raced.draft_ids[0, :3].tolist()
    assert raced.draft_ids[1:].tolist() == plain.draft_ids[1:].tolist()
    # the same proposals: row 0's first (its later ones follow its own drafts), the others' all
    np.testing.assert_allclose(raced.draft_probs[0, 0], plain.draft_probs[0, 0], atol=1e-6)
    np.testing.assert_allclose(raced.draft_probs[1:], plain.draft_probs[1:], atol=1e-6)
    assert raced.draft_ids[0].tolist() != plain.draft_ids[0].tolist()
    call.noise = noise[:, :, :-1]
    with pytest.raises(ValueError, match=rf"^noise: shape \(3, {big_k}, {v - 1}\), expected \(3, {big_k}, {v}\)"):
        runner.execute(call)


@pytest.mark.parametrize("layer", ["native", "torch"])  # cpu_layer's mtp_head, or torch and numpy
def test_folded_mtp_heads_equal_the_trained_modules(default_model, layer, monkeypatch):
    """The serving form of each MTP head (norm weights folded into the next matrix, the token half
    of the input projection as a per-token table, fused gate/up) computes what the trained module
    computes: same next state, same logits over the draft vocabulary, same greedy token."""
    import torch.nn.functional as F

    from lightspec_core.models import cpu_layer
    from lightspec_core.stages.mtp import MTPRunner

    monkeypatch.setenv(cpu_layer.ENV_SWITCH, "on" if layer == "native" else "off")

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    emb = runner.target.model.embed_tokens
    torch.manual_seed(0)
    state = torch.randn(16, runner.target.config.hidden_size) * 3
    tok = torch.randint(0, runner.vocab_size, (16,))
    with torch.inference_mode():
        for module, folded in zip(runner.heads.heads, runner.folded, strict=True):
            ref_state, out = module(state, emb(tok))
            ref_logits = F.linear(out, runner.head_weight)
            got_state, got_logits = folded(state, tok)
            torch.testing.assert_close(got_state, ref_state, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(got_logits, ref_logits, atol=1e-4, rtol=1e-4)
            assert torch.equal(got_logits.argmax(-1), ref_logits.argmax(-1))
            for r in range(3):  # the one-row numpy form of the same head
                np_state, np_logits = folded.one_row(state[r].numpy(), int(tok[r]))
                np.testing.assert_allclose(np_state, ref_state[r].numpy(), atol=1e-4, rtol=1e-4)
                np.testing.assert_allclose(np_logits, ref_logits[r].numpy(), atol=1e-4, rtol=1e-4)
                assert np_logits.dtype == np.float32 and int(np_logits.argmax()) == int(ref_logits[r].argmax())
                if layer == "native":  # one native call for any number of rows: the same bits
                    assert np.array_equal(np_logits, got_logits[r].numpy())
            state, tok = ref_state, runner.vocab_ids[ref_logits.argmax(-1)]
    if layer == "native":
        with pytest.raises(IndexError, match="token id past its table"):
            folded.one_row(state[0].numpy(), runner.vocab_size)


@pytest.mark.parametrize("layer", ["native", "torch"])
def test_lone_greedy_row_drafts_as_in_a_batch(default_model, layer, monkeypatch):
    """A lone greedy request's chain runs in numpy (one_row), a batch's in torch: each row gets the
    same drafts and confidences either way, with and without a confidence stop (the lone row's
    numpy chain computes the confidences and the stop itself)."""
    from lightspec_core.models import cpu_layer
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    monkeypatch.setenv(cpu_layer.ENV_SWITCH, "on" if layer == "native" else "off")

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    rng = np.random.default_rng(3)
    b, h = 12, runner.target.config.hidden_size
    hidden = (rng.standard_normal((b, h)) * 3).astype(np.float32)
    last = rng.integers(3, runner.vocab_size, b)
    ks = rng.integers(1, 5, b).astype(np.int32)

    def call(rows, stop: bool) -> MTPCall:
        n = len(rows)
        return MTPCall(
            hidden=hidden[rows],
            last_ids=last[rows],
            num_tokens=ks[rows],
            temperature=np.zeros(n, np.float32),
            top_k=np.zeros(n, np.int32),
            top_p=np.ones(n, np.float32),
            uniforms=np.zeros((n, 4), np.float32),
            return_probs=np.array([False]),
            min_gain=np.full(n, 0.5 if stop else 0.0, np.float32),
            calibration=_stop_table(5) if stop else np.zeros((0, 0, 0), np.float32),
        )

    numpy_chains = []
    real = runner._one_greedy_row
    runner._one_greedy_row = lambda *a: numpy_chains.append(1) or real(*a)
    for stop in (False, True):
        whole = runner.execute(call(np.arange(b), stop))
        for r in range(b):
            lone = runner.execute(call(np.array([r]), stop))
            assert np.array_equal(lone.draft_ids[0], whole.draft_ids[r]), (stop, r)
            np.testing.assert_allclose(lone.draft_conf[0], whole.draft_conf[r], atol=1e-4)
        if stop:  # the stop did cut some chains short, so both paths were compared on it
            assert ((whole.draft_ids >= 0).sum(1) < ks).any()
    assert len(numpy_chains) == 2 * b  # every lone row took the numpy chain, with a stop table too


def _stop_table(threshold_bucket: int, k: int = 4, buckets: int = 10) -> np.ndarray:
    """Acceptance 1 from ``threshold_bucket`` up, 0 below: with a floor of 0.5 a chain keeps its
    drafts exactly while their confidence is >= threshold_bucket / buckets."""
    table = np.zeros((2, k, buckets), np.float32)
    table[:, :, threshold_bucket:] = 1.0
    return table


def test_mtp_confidence_stop_keeps_a_prefix_of_the_chain_up_to_the_floor(default_model):
    from lightspec_core.stages.mtp import MTPRunner

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    rng = np.random.default_rng(3)
    b, k = 12, runner.num_heads
    hidden = rng.standard_normal((b, runner.target.config.hidden_size)).astype(np.float32) * 2
    last = rng.integers(3, runner.target.config.vocab_size, b).astype(np.int64)
    temps = [0.0] * 6 + [1.0] * 6
    u = rng.random((b, k)).astype(np.float32)
    plain = runner.execute(_mtp_call(hidden, last, [k] * b, temps, u))
    call = _mtp_call(hidden, last, [k] * b, temps, u)
    call.calibration = np.full((2, k, 10), 0.5, np.float32)
    call.min_gain = np.zeros(b, np.float32)  # a table but no floor: the full chain, confidences reported
    full = runner.execute(call)
    assert (full.draft_ids == plain.draft_ids).all()
    np.testing.assert_allclose(full.draft_probs, plain.draft_probs, atol=1e-6)
    assert ((full.draft_conf >= 0) & (full.draft_conf <= 1)).all() and len(np.unique(full.draft_conf)) > b
    call.min_gain = np.full(b, 0.3, np.float32)  # 0.5 >= 0.3 > 0.25: one draft each
    one = runner.execute(call)
    assert ((one.draft_ids >= 0).sum(1) == 1).all() and (one.draft_ids[:, 0] == plain.draft_ids[:, 0]).all()
    assert (one.draft_conf[:, 1:] == 0).all() and not one.draft_probs[:, 1:].any()
    # a step table: drafts survive while confident, and what survives is the unstopped chain's prefix
    call.calibration, call.min_gain = _stop_table(5), np.full(b, 0.5, np.float32)
    cut = runner.execute(call)
    for r in range(b):
        n = int((cut.draft_ids[r] >= 0).sum())
        want = next((j for j in range(k) if full.draft_conf[r, j] < 0.5), k)
        assert n == want, (r, full.draft_conf[r])
        assert cut.draft_ids[r, :n].tolist() == plain.draft_ids[r, :n].tolist()
        # float32: the same rows batched differently may differ in the last bit
        np.testing.assert_allclose(cut.draft_conf[r, :n], full.draft_conf[r, :n], rtol=1e-5)
    assert 0 < (cut.draft_ids >= 0).sum() < b * k, "the floor was meant to stop some chains, not all or none"


def test_a_sampled_drafts_inclusion_does_not_depend_on_its_own_value(default_model):
    """Rejection sampling stays exact only if whether draft j is verified is decided before draft j
    is drawn: a sampled row's confidence is its proposal's top probability, not q of the drawn
    token. So the rows keeping their first draft are the same whatever the random draws."""
    from lightspec_core.stages.mtp import MTPRunner

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    rng = np.random.default_rng(4)
    b, k = 16, runner.num_heads
    hidden = rng.standard_normal((b, runner.target.config.hidden_size)).astype(np.float32) * 2
    last = rng.integers(3, runner.target.config.vocab_size, b).astype(np.int64)
    kept = set()
    for _ in range(20):
        call = _mtp_call(hidden, last, [1] * b, [1.0] * b, rng.random((b, k)).astype(np.float32))
        call.calibration, call.min_gain = _stop_table(2), np.full(b, 0.5, np.float32)
        res = runner.execute(call)
        kept.add(tuple(res.draft_ids[:, 0] >= 0))
    assert len(kept) == 1
    assert 0 < sum(next(iter(kept))) < b, "the floor was meant to keep some first drafts, not all or none"


def test_fused_drafts_follow_greedy_verification_then_equal_the_mtp_stage(default_model):
    """A target stage with MTP heads (``mtp_drafts``) verifies each request's drafts greedily and
    proposes its next drafts from the last accepted row: the accepted counts must be what
    ``verify_greedy`` finds and the drafts what the ``mtp`` stage proposes from that row's hidden
    state and bonus token. Requests: decoding with 2 good drafts and a bad one, a whole prompt, a
    prompt chunk without a sample row, and one that asked for no drafts."""
    from lightspec_core.spec.verify import verify_greedy
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    target = default_model / "target"
    heads = MTPRunner(target, default_model / "mtp")
    runner = ModelRunner(target, 64, 16, heads=heads)
    rng = np.random.default_rng(1)
    vocab = runner.config.vocab_size
    prompt_a = rng.integers(3, vocab, 20).tolist()
    # the true greedy continuation of A: one token per call
    out = [int(_call(runner, [(prompt_a, 0)], [[0, 1]]).top1_ids[-1])]
    for i in range(3):
        out.append(int(_call(runner, [(out[-1:], 20 + i)], [[0, 1]]).top1_ids[-1]))
    drafts = [out[1], out[2], (out[3] + 1) % vocab]  # two right, the third wrong
    reqs = [
        (prompt_a[-1:] + [out[0]] + drafts, 19),  # A: re-feeds its last prompt token, then token + drafts
        (rng.integers(3, vocab, 9).tolist(), 0),  # B: a whole prompt
        (rng.integers(3, vocab, 7).tolist(), 0),  # C: a prompt chunk (no sample row)
        (rng.integers(3, vocab, 5).tolist(), 0),  # D: a whole prompt, no drafts wanted
    ]
    qlens = [len(t) for t, _ in reqs]
    ends = np.cumsum(qlens)
    sample = [*range(1, ends[0]), ends[1] - 1, ends[3] - 1]  # A: its token and each draft; B, D: last row
    tables = [[0, 1], [2, 3], [4, 5], [6, 7]]
    call = ModelCall(
        np.array([t for toks, _ in reqs for t in toks], np.int64),
        np.array([p for toks, s in reqs for p in range(s, s + len(toks))], np.int64),
        np.array(qlens, np.int32),
        np.array(tables, np.int32),
        np.array(sample, np.int64),
        np.array([False]),
        np.array([True]),
        mtp_drafts=np.array([4, 3, 2, 0], np.int32),
        mtp_conf=np.array([True]),
    )
    res = runner.execute(call)
    top1 = res.top1_ids.tolist()
    assert verify_greedy(drafts, top1[:4]) == [out[1], out[2], out[3]]  # 2 accepted, then the bonus
    assert res.accepted.tolist() == [2, 0, -1, -1]
    for b, row, n in ((0, 2, 4), (1, 4, 3)):  # the bonus row: A's third sample row, B's only one
        alone = heads.execute(
            MTPCall(
                hidden=res.hidden[row : row + 1],
                last_ids=np.array([top1[row]], np.int64),
                num_tokens=np.array([n], np.int32),
                temperature=np.zeros(1, np.float32),
                top_k=np.zeros(1, np.int32),
                top_p=np.ones(1, np.float32),
                uniforms=np.zeros((1, heads.num_heads), np.float32),
                return_probs=np.array([False]),
            )
        )
        assert res.next_draft_ids[b].tolist() == alone.draft_ids[0].tolist()
        assert (res.next_draft_ids[b, :n] >= 0).all() and (res.next_draft_ids[b, n:] == -1).all()
        assert ((res.next_draft_conf[b, :n] >= 0) & (res.next_draft_conf[b, :n] <= 1)).all()
    assert (res.next_draft_ids[2:] == -1).all()
    # without heads, or with a count per request missing: a clear error naming the field
    with pytest.raises(ValueError, match="mtp_drafts: this stage has no MTP heads"):
        ModelRunner(target, 64, 16).execute(call)
    call.mtp_drafts = np.array([4, 3], np.int32)
    with pytest.raises(ValueError, match="mtp_drafts: 2 values for 4 requests"):
        runner.execute(call)


def test_lone_row_heads_run_with_numpy_blas_on_one_thread(default_model, monkeypatch):
    """numpy's OpenBLAS pool competes with torch's OpenMP threads for the cores right after a
    forward (a fused target call at one request took 10-12 ms instead of 3-4 on 2 cores): the
    one-row heads run with numpy's BLAS limited to the calling thread, and the limit is lifted after."""
    from threadpoolctl import OpenBLASController, threadpool_info, threadpool_limits

    from lightspec_core.models.mtp_heads import FoldedMTPHead
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    # threadpoolctl lets one Python thread control OpenBLAS's shared pool, the first that set a limit;
    # an earlier test's stage thread may still hold it. This test's thread (where the heads run) takes it.
    monkeypatch.setattr(OpenBLASController._SHARED_STATE, "controlling_thread", None)

    def blas_threads() -> list[int]:  # numpy's own OpenBLAS (numpy.libs/ in the pip wheel): another
        # library's BLAS loaded by an earlier test (scipy's) is not what the heads call
        return [d["num_threads"] for d in threadpool_info() if d["user_api"] == "blas" and "numpy" in d["filepath"]]

    seen = []
    real = FoldedMTPHead.one_row

    def spy(self, state, tok):
        seen.append(blas_threads())
        return real(self, state, tok)

    monkeypatch.setattr(FoldedMTPHead, "one_row", spy)
    runner = MTPRunner(default_model / "target", default_model / "mtp")
    h = runner.target.config.hidden_size
    with threadpool_limits(limits=2, user_api="blas"):  # two threads, as on the 2-core benchmark machine
        before = blas_threads()
        assert before == [2], before  # numpy's OpenBLAS is there to be limited
        out = runner.execute(
            MTPCall(
                hidden=np.ones((1, h), np.float32),
                last_ids=np.array([5]),
                num_tokens=np.array([4], np.int32),
                temperature=np.zeros(1, np.float32),
                top_k=np.zeros(1, np.int32),
                top_p=np.ones(1, np.float32),
                uniforms=np.zeros((1, 4), np.float32),
                return_probs=np.array([False]),
            )
        )
        assert (out.draft_ids[0] >= 0).all()
        assert len(seen) == 4 and all(t == [1] * len(before) for t in seen)
        assert blas_threads() == before


def test_gather_buffers_are_reused_and_a_smaller_step_after_a_larger_one_is_exact(smoke_model):
    """The context keys/values a prompt chunk gathers go to buffers the model keeps between steps:
    a larger step grows them, a smaller one uses their front, and what it computes is bit for bit
    what a runner that never ran the larger step computes."""
    target = smoke_model / "target"
    rng = np.random.default_rng(3)
    used, fresh = (ModelRunner(target, num_blocks=64, block_size=4) for _ in range(2))
    vocab = used.config.vocab_size
    small = rng.integers(3, vocab, 22).tolist()  # two chunks of more than ROW_GROUP_MAX_QUERY tokens
    big = [rng.integers(3, vocab, 30).tolist() for _ in range(3)]
    big_tables = [[8 + 8 * r + i for i in range(8)] for r in range(3)]  # blocks 8..31: not the small request's
    _call(used, [(t, 0) for t in big], big_tables)
    grown = used.model._gather_bufs[0]
    _call(used, [(small[:12], 0)], [list(range(6))])
    _call(fresh, [(small[:12], 0)], [list(range(6))])
    assert used.model._gather_bufs[0].data_ptr() == grown.data_ptr()  # reused, not reallocated
    a = _call(used, [(small[12:], 12)], [list(range(6))])
    b = _call(fresh, [(small[12:], 12)], [list(range(6))])
    np.testing.assert_array_equal(a.logits, b.logits)
    assert fresh.model._gather_bufs[0].numel() < grown.numel()


def test_decoding_over_the_index_budget_gathers_its_context_and_computes_the_same(smoke_model, monkeypatch):
    """Past ``POOL_INDEX_BUDGET`` a decoding group gathers its context for the fused kernel instead of
    reading the pool in place: the logits agree, and the gather buffers show which way it went."""
    from lightspec_core.models import cpu_attention, paged

    monkeypatch.setenv(cpu_attention.ENV_SWITCH, "off")  # the budget is the torch path's
    rng = np.random.default_rng(4)
    runners = [ModelRunner(smoke_model / "target", num_blocks=16, block_size=4) for _ in range(2)]
    vocab = runners[0].config.vocab_size
    prompts = [rng.integers(3, vocab, 11).tolist() for _ in range(2)]
    nxt = rng.integers(3, vocab, 2).tolist()
    tables = [[0, 1, 2], [5, 6, 7]]
    out = []
    for r, budget in zip(runners, [paged.POOL_INDEX_BUDGET, 0]):
        monkeypatch.setattr(paged, "POOL_INDEX_BUDGET", budget)
        _call(r, [(p, 0) for p in prompts], tables)  # 11-token chunks: gathered either way
        r.model._gather_bufs = None
        out.append(_call(r, [([t], 11) for t in nxt], tables))
    assert runners[0].model._gather_bufs is None and runners[1].model._gather_bufs is not None
    np.testing.assert_allclose(out[0].logits, out[1].logits, atol=1e-5, rtol=0)
    np.testing.assert_array_equal(out[0].top1_ids, out[1].top1_ids)


@pytest.mark.parametrize("block", [-1, 8])
def test_a_block_id_outside_the_pool_is_refused_before_anything_is_written(default_model, block):
    """The native kernels write and read the pool where the block tables point: a stage called with
    a wrong table (over BLS, by anyone) must not write outside its pool."""
    runner = ModelRunner(default_model / "target", num_blocks=8, block_size=4)
    before = runner.kv.clone()
    call = ModelCall(
        np.array([5, 6], np.int64),
        np.array([4, 5], np.int64),
        np.array([2], np.int32),
        np.array([[0, block]], np.int32),
        np.array([1], np.int64),
        np.array([False]),
        np.array([False]),
    )
    with pytest.raises(ValueError, match=r"block_tables: block ids must be in 0\.\.7"):
        runner.execute(call)
    assert torch.equal(runner.kv, before)


def _chain_call(reqs, tables, chain=None) -> ModelCall:
    """reqs: (token ids, start position) per request; one sample row each, its last token's."""
    qlens = np.array([len(t) for t, _ in reqs], np.int32)
    bt = np.zeros((len(tables), max(len(t) for t in tables)), np.int32)
    for r, t in enumerate(tables):
        bt[r, : len(t)] = t
    return ModelCall(
        np.array([t for toks, _ in reqs for t in toks], np.int64),
        np.array([p for toks, s in reqs for p in range(s, s + len(toks))], np.int64),
        qlens,
        bt,
        (np.cumsum(qlens) - 1).astype(np.int64),
        np.array([False]),
        np.array([False]),
        draft_chain=np.zeros(0, np.int32) if chain is None else np.array(chain, np.int32),
    )


def test_a_draft_chain_equals_a_call_per_draft_and_leaves_the_same_pool(default_model):
    """``draft_chain``: one call returns what the draft model proposes with a call per draft (each
    draft fed back at the next position), and leaves the K/V of every fed draft in the pool as
    those calls do. Requests draft 4, 1, 0 and 2 tokens."""
    chained = ModelRunner(default_model / "draft", num_blocks=32, block_size=4)
    stepped = ModelRunner(default_model / "draft", num_blocks=32, block_size=4)
    rng = np.random.default_rng(5)
    vocab = chained.config.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in (7, 5, 9, 3)]
    tables = [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9, 10], [11, 12]]
    chain = [4, 1, 0, 2]
    reqs = [(p, 0) for p in prompts]
    res = chained.execute(_chain_call(reqs, tables, chain))
    assert res.next_draft_ids.shape == (4, 4)

    first = stepped.execute(_chain_call(reqs, tables)).top1_ids
    assert np.array_equal(first, res.top1_ids)
    want = [[int(first[r])] if chain[r] else [] for r in range(4)]
    for j in range(1, max(chain)):
        live = [r for r in range(4) if chain[r] > j]
        out = stepped.execute(_chain_call([([want[r][-1]], len(prompts[r]) + j - 1) for r in live],
                                          [tables[r] for r in live])).top1_ids  # fmt: skip
        for n, r in enumerate(live):
            want[r].append(int(out[n]))
    for r in range(4):
        got = res.next_draft_ids[r]
        assert got[: chain[r]].tolist() == want[r] and (got[chain[r] :] == -1).all()
    assert torch.equal(chained.kv, stepped.kv)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"draft_chain": np.array([2], np.int32)}, r"draft_chain: 1 values for 2 requests"),
        ({"draft_chain": np.array([2, -1], np.int32)}, r"draft_chain: values must be >= 0"),
        ({"mtp_drafts": np.array([1, 1], np.int32)}, r"draft_chain: not with mtp_drafts"),
        ({"sample_indices": np.array([0, 4], np.int64)}, r"one sample row must be its last token's"),
        ({"draft_chain": np.array([1, 6], np.int32)}, r"position 8, past its block table"),
    ],
)
def test_a_draft_chain_that_cannot_be_run_is_refused_before_anything_is_written(default_model, change, message):
    runner = ModelRunner(default_model / "draft", num_blocks=8, block_size=4)
    before = runner.kv.clone()
    call = _chain_call([([5, 6, 7], 0), ([8, 9], 2)], [[0], [1, 2]], [2, 1])
    for name, value in change.items():
        setattr(call, name, value)
    with pytest.raises(ValueError, match=message):
        runner.execute(call)
    assert torch.equal(runner.kv, before)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["native-float32", "torch-bfloat16", "torch-float64"]
)
def test_top1_and_finiteness_agree_on_the_native_and_the_torch_paths(dtype):
    """The top-1 ids and the finiteness flag come from the native kernel and numpy for float32 on a
    CPU, and from torch's max for any other dtype or device (a GPU's path, one copy to the host):
    a NaN or +inf anywhere in a row, or no finite logit, makes it not finite; -inf beside a finite
    logit (a vocabulary mask) does not."""
    from lightspec_core.stages.target import _top1_finite

    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0))
    logits[1, 17] = math.nan
    logits[2, 250] = math.inf
    logits[3] = -math.inf
    logits[4, :299] = -math.inf  # masked: one finite logit, the last
    logits[5, 40] = logits[5].max() + 1  # a clear winner in an ordinary row
    ids, finite = _top1_finite(logits.to(dtype))
    assert ids.dtype == np.int64 and finite.dtype == np.bool_
    assert finite.tolist() == [True, False, False, False, True, True]
    assert ids[[0, 4, 5]].tolist() == [int(logits[0].to(dtype).float().argmax()), 299, 40]


@pytest.mark.parametrize("rows", [1, 3])  # a lone greedy row takes the native head, more the torch chain
def test_mtp_states_of_another_width_are_refused_naming_hidden(default_model, rows):
    """The native head took the states' width for its weights' and read past them (a segfault at a
    large width, drafts from garbage at a small one); the torch chain failed on a shape mismatch."""
    from lightspec_core.models import cpu_layer
    from lightspec_core.stages.contract import MTPCall
    from lightspec_core.stages.mtp import MTPRunner

    runner = MTPRunner(default_model / "target", default_model / "mtp")
    h = runner.target.config.hidden_size
    call = MTPCall(
        hidden=np.ones((rows, h + 16), np.float32),
        last_ids=np.full(rows, 5),
        num_tokens=np.full(rows, 2, np.int32),
        temperature=np.zeros(rows, np.float32),
        top_k=np.zeros(rows, np.int32),
        top_p=np.ones(rows, np.float32),
        uniforms=np.zeros((rows, 2), np.float32),
        return_probs=np.array([False]),
    )
    with pytest.raises(ValueError, match=rf"hidden: shape \({rows}, {h + 16}\), expected \({rows}, {h}\)"):
        runner.execute(call)
    if cpu_layer.enabled():  # the kernel itself, as a caller other than the runner would reach it
        with pytest.raises(ValueError, match=f"states of width {h + 16}, the head's hidden size is {h}"):
            cpu_layer.mtp_head(runner.folded[0], np.ones((1, h + 16), np.float32), np.array([5]))


@pytest.mark.parametrize("attention", ["on", "off"], ids=["native", "torch"])
@pytest.mark.parametrize("prompt", [4, 12], ids=["few-rows", "gathered-chunk"])
def test_a_nan_left_in_a_freed_block_does_not_reach_the_request_that_reads_it_next(tmp_path, monkeypatch,
                                                                                   attention, prompt):  # fmt: skip
    """A request whose token embeds to NaN (a broken checkpoint) leaves NaN keys and values in its
    block; the next request given that block reads none of those slots, yet a weight of 0 times NaN
    made its logits NaN on every attention path (native, in place from the pool, gathered for SDPA).
    After a step whose logits were not finite, the stage zeroes the slots past each context."""
    from lightspec_core.models import cpu_attention
    from lightspec_core.models.hf_config import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=64,
                      tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaModel(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight[63] = math.nan
    model.save(tmp_path / "broken")
    monkeypatch.setenv(cpu_attention.ENV_SWITCH, attention)

    def step(runner, ids, start):
        n = len(ids)
        call = ModelCall(np.array(ids, np.int64), np.arange(start, start + n), np.array([n], np.int32),
                         np.array([[2]], np.int32), np.array([n - 1]), np.array([True]), np.array([False]))  # fmt: skip
        return runner.execute(call)

    used, fresh = (ModelRunner(tmp_path / "broken", num_blocks=4, block_size=16) for _ in range(2))
    assert not step(used, [5, 6, 7, 63, *range(8, 20)], 0).finite.any()  # fills block 2, then is failed
    b_prompt = list(range(1, prompt + 1))
    got = [step(used, b_prompt, 0), step(used, [5], prompt)]
    want = [step(fresh, b_prompt, 0), step(fresh, [5], prompt)]
    for g, w in zip(got, want):
        assert g.finite.all() and g.top1_ids.tolist() == w.top1_ids.tolist()
        np.testing.assert_allclose(g.logits, w.logits, rtol=1e-5, atol=1e-5)
