"""LLMEngine end to end in process: lossless speculation, preemption, streaming, stops, aborts."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import pytest

from lightspec_core import EngineConfig, LLMEngine, SamplingParams
from lightspec_core.corpus import stdlib_files
from lightspec_core.engine.build import build_local_executor
from lightspec_core.spec.acceptance import ConfidenceStats
from lightspec_core.spec.calibrate import profile_propose, profile_verify
from lightspec_core.spec.policy import Decision


def heldout_prompts(n: int, tok_lens=(12, 20, 31, 45, 60, 75, 90, 110)) -> list[str]:
    _, valid = stdlib_files()
    prompts = []
    for i, path in enumerate(valid[3 : 3 + 5 * n : 5]):
        text = path.read_text(encoding="utf-8", errors="replace")
        prompts.append(text[: 4 * tok_lens[i % len(tok_lens)]])
    return prompts


def run(root, prompts, params, **kw):
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), **kw))
    try:
        outs = eng.generate(prompts, params)
        eng.blocks.check_invariants()
        assert eng.blocks.usage() == 0.0, "blocks leaked after all requests ended"
        return outs, eng
    finally:
        eng.close()


@pytest.fixture(scope="module")
def exactness_setup(default_model):
    prompts = heldout_prompts(8)
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    ref, _ = run(default_model, prompts, params, speculation="none", policy="off")
    return default_model, prompts, params, [o.output_token_ids for o in ref]


@pytest.mark.parametrize("method", ["mtp", "draft", "ngram"])
@pytest.mark.parametrize("policy", ["dynamic", "static:3"])
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("tiny_pool", [False, True], ids=["pool", "tiny-pool"])
def test_greedy_speculation_is_lossless(exactness_setup, method, policy, depth, tiny_pool):
    root, prompts, params, ref = exactness_setup
    kw = {"num_kv_blocks": 40, "block_size": 8} if tiny_pool else {}
    outs, eng = run(root, prompts, params, speculation=method, policy=policy, pipeline_depth=depth, **kw)
    assert [o.output_token_ids for o in outs] == ref
    assert all(len(o.output_token_ids) == 64 for o in outs)
    if tiny_pool:
        assert eng.scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"
    if policy.startswith("static"):  # (the dynamic policy may rightly decide not to draft)
        assert sum(o.num_accepted_tokens for o in outs) > 0, "no draft was ever accepted: the test proves nothing"


def test_a_greedy_draft_chain_proposes_what_a_call_per_draft_does_in_one_call(exactness_setup, monkeypatch):
    """The draft model's greedy drafts come from one stage call per step (``draft_chain``): the
    same drafts, hence the same acceptance per request, as a call per draft, in fewer calls."""
    root, prompts, params, ref = exactness_setup
    results = {}
    for chains in (True, False):
        eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), speculation="draft", policy="static:3"))
        try:
            eng.proposer.chains = chains
            calls = []

            def submit(stage, call, calls=calls, inner=eng.executor.submit):
                calls.append(stage)
                return inner(stage, call)

            monkeypatch.setattr(eng.executor, "submit", submit)
            outs = eng.generate(prompts, params)
        finally:
            eng.close()
        assert [o.output_token_ids for o in outs] == ref
        results[chains] = [(o.num_draft_tokens, o.num_accepted_tokens) for o in outs], calls.count("draft")
    assert results[True][0] == results[False][0] and sum(a for _, a in results[True][0]) > 0
    assert results[True][1] < results[False][1] / 2


@pytest.mark.parametrize("chains", [True, False])
def test_the_draft_models_catch_up_reaches_the_cost_model(exactness_setup, monkeypatch, chains):
    """Each propose call reports the tokens the draft model fed beyond one per drafting request:
    the whole prompt (and the token its prefill made) before a request's first drafts, then what
    the last verification left unseen, which is less than the drafts a request was given (see
    ``ProposeCost.per_fed``)."""
    root, prompts, params, ref = exactness_setup
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), speculation="draft", policy="static:3"))
    try:
        eng.proposer.chains = chains
        seen = []
        monkeypatch.setattr(eng.cost, "observe_propose", lambda d, depth, s, fed=0: seen.append((d, depth, fed)))
        outs = eng.generate(prompts[:2], params)
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == ref[:2]
    assert seen[0] == (6, 3, sum(len(o.prompt_token_ids) for o in outs))  # the prompt and its prefill's token, less one
    later = [fed for _, _, fed in seen[1:]]
    assert len(later) > 10 and max(later) <= 2 * 2 and sum(later) > 0


@pytest.mark.parametrize("method", ["none", "mtp", "draft", "ngram"])
def test_prefix_cache_skips_shared_prefill_and_keeps_outputs_exact(exactness_setup, method):
    """Requests that share a prompt prefix with earlier ones compute only the rest: the engine counts
    the prompt tokens it found (vLLM's prefix_cache_hits) and every output equals the one computed
    without the cache, speculation included (drafts are verified against K/V the cache supplied)."""
    root, prompts, params, ref = exactness_setup
    spec = {"speculation": method, "policy": "off" if method == "none" else "dynamic"}
    shared = prompts[7]  # the longest held-out prompt: several full blocks
    followers = [shared + "\n", shared[: len(shared) // 2]]
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), block_size=8, **spec))
    cold = LLMEngine(EngineConfig(model_dir=str(root / "target"), block_size=8, enable_prefix_caching=False, **spec))
    try:
        first = eng.generate(prompts, params)
        assert [o.output_token_ids for o in first] == ref
        queries = eng.stats.counters["prefix_cache_queries_total"]
        assert queries == sum(len(eng.tok.encode(p)) for p in prompts)
        assert eng.stats.counters["prefix_cache_hits_total"] == 0  # distinct prompts: nothing to share
        again = eng.generate([*prompts, *followers], params)
        expected = cold.generate([*prompts, *followers], params)
        assert [o.output_token_ids for o in again] == [o.output_token_ids for o in expected]
        assert [o.output_token_ids for o in again[: len(prompts)]] == ref
        hits = eng.stats.counters["prefix_cache_hits_total"]
        # every repeated prompt finds all of its full blocks but the one holding its last token
        assert hits >= sum((len(eng.tok.encode(p)) - 1) // 8 * 8 for p in prompts)
        assert cold.stats.counters["prefix_cache_hits_total"] == 0
        # a chat's next turn: the last answer's blocks are cached too, not only the prompt's
        turn = [*eng.tok.encode(shared), *first[7].output_token_ids, *eng.tok.encode(" next", add_special_tokens=False)]
        [out] = eng.generate([turn], params)
        assert eng.stats.counters["prefix_cache_hits_total"] - hits > len(eng.tok.encode(shared)) + 32
        assert out.output_token_ids == cold.generate([turn], params)[0].output_token_ids
        eng.blocks.check_invariants()
        assert eng.blocks.usage() == 0.0
    finally:
        eng.close()
        cold.close()


def test_streamed_deltas_concatenate_to_the_full_output(smoke_model):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="ngram"))
    prompt = "naïve café — ünïcödé ✓ 日本語 " * 3
    eng.add_request("r", prompt, SamplingParams(max_tokens=48, ignore_eos=True))
    text, ids, finals = "", [], 0
    while eng.has_unfinished():
        for d in eng.step():
            text += d.new_text
            ids += d.new_token_ids
            finals += d.finished
    assert finals == 1
    assert text == eng.tok.decode(ids)
    assert eng.tok.decode(eng.tok.encode(prompt)) == prompt


def _deltas(eng: LLMEngine, params: dict[str, SamplingParams]) -> dict[str, list]:
    """Every delta of each request, run to completion on ``eng``, which is closed afterwards."""
    try:
        for rid, p in params.items():
            eng.add_request(rid, "def parse(self, text):\n    ", p)
        out: dict[str, list] = {rid: [] for rid in params}
        while eng.has_unfinished():
            for d in eng.step():
                out[d.request_id].append(d)
        return out
    finally:
        eng.close()


@pytest.mark.parametrize("speculation", ["none", "ngram"])
def test_stream_interval_coalesces_deltas_but_the_first_and_the_last(default_model, speculation):
    """vLLM's rule: the first delta goes out at once, the last whatever it holds, every other one
    carries at least the interval's tokens; a request's own interval may raise the engine's, never
    lower it. The tokens and text are the same as delta by delta."""
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    raised = SamplingParams(max_tokens=40, ignore_eos=True, stream_interval=9)
    lowered = SamplingParams(max_tokens=40, ignore_eos=True, stream_interval=1)
    every = _deltas(LLMEngine(EngineConfig(speculation=speculation)), {"a": greedy})["a"]
    eng = LLMEngine(EngineConfig(speculation=speculation, stream_interval=4))
    runs = _deltas(eng, {"engine": greedy, "raised": raised, "lowered": lowered})
    for rid, interval in (("engine", 4), ("raised", 9), ("lowered", 4)):
        ds = runs[rid]
        assert [t for d in ds for t in d.new_token_ids] == [t for d in every for t in d.new_token_ids]
        assert "".join(d.new_text for d in ds) == "".join(d.new_text for d in every)
        assert len(ds[0].new_token_ids) == len(every[0].new_token_ids), "the first delta must not wait"
        assert all(len(d.new_token_ids) >= interval for d in ds[1:-1]), [len(d.new_token_ids) for d in ds]
        assert ds[-1].finished and sum(d.finished for d in ds) == 1
        assert len(ds) < len(every)


def test_stream_interval_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="^stream_interval=0"):
        SamplingParams(stream_interval=0)
    with pytest.raises(ValueError, match="^stream_interval=0"):
        EngineConfig(stream_interval=0)


def test_stop_string_truncates_inside_an_accepted_block(default_model):
    prompt = heldout_prompts(1)[0]
    free, _ = run(default_model, [prompt], SamplingParams(max_tokens=40, ignore_eos=True), speculation="none")
    full = free[0].text
    stop = full[12:15]
    assert stop and stop in full
    outs, _ = run(
        default_model,
        [prompt],
        SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]),
        speculation="ngram",
        policy="static:4",
    )
    o = outs[0]
    assert o.finish_reason == "stop"
    assert o.text == full[: full.index(stop)]
    # no token after the one completing the stop string is emitted
    assert o.output_token_ids == free[0].output_token_ids[: len(o.output_token_ids)]
    assert stop not in o.text


@pytest.mark.parametrize("speculation", ["none", "ngram"])
def test_a_stop_string_inside_a_long_token_ends_the_request_there(default_model, speculation):
    """The embedded tokenizer's indentation tokens hold a newline and up to 48 spaces."""
    prompt = "class Foo:\n    def bar(self, x):\n        for i in range(x):\n            if i:"
    eng = LLMEngine(EngineConfig(model_dir=str(default_model / "target"), speculation=speculation))
    try:
        free = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True))[0]
        pieces = [eng.tok.decode([t]) for t in free.output_token_ids]
        k = next(i for i, p in enumerate(pieces) if "\n" in p)
        assert len(pieces[k]) - pieces[k].index("\n") > 9, "no long token after the newline: proves nothing"
        out = eng.generate(prompt, SamplingParams(max_tokens=40, ignore_eos=True, stop=["\n"]))[0]
    finally:
        eng.close()
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index("\n")]
    assert out.output_token_ids == free.output_token_ids[: k + 1]


def test_end_id_stops_generation(smoke_model):
    free, _ = run(smoke_model, ["def f(x):"], SamplingParams(max_tokens=20, ignore_eos=True), speculation="none")
    ids = free[0].output_token_ids
    end = ids[5]
    outs, _ = run(
        smoke_model, ["def f(x):"], SamplingParams(max_tokens=20, ignore_eos=True, end_id=end), speculation="mtp"
    )
    assert outs[0].finish_reason == "stop"
    assert outs[0].output_token_ids == ids[: ids.index(end) + 1]


@pytest.mark.parametrize("speculation", ["none", "mtp"])
def test_max_tokens_none_generates_to_the_end_of_the_context(smoke_model, speculation):
    """vLLM's ``max_tokens=None``: each request gets the rest of the context, whatever its prompt."""
    prompts = ["def f(x):", "import os\n" * 5]
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation=speculation, max_model_len=48))
    try:
        with pytest.raises(ValueError, match=r"^min_tokens=60: the context of 48 tokens leaves \d+ after the prompt"):
            eng.add_request("long", prompts[0], SamplingParams(max_tokens=None, min_tokens=60))
        outs = eng.generate(prompts, SamplingParams(max_tokens=None, ignore_eos=True, min_tokens=3))
    finally:
        eng.close()
    assert len(outs[0].prompt_token_ids) != len(outs[1].prompt_token_ids)
    for out in outs:
        assert out.finish_reason == "length"
        assert len(out.prompt_token_ids) + len(out.output_token_ids) == 48


def test_generate_refuses_a_batch_whole_when_one_prompt_is_bad(smoke_model):
    """A prompt too long for the context refuses the call; the prompts before it were left queued,
    computed and holding KV blocks, their outputs never collected."""
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), max_model_len=48))
    try:
        with pytest.raises(ValueError, match="^prompt: "):
            eng.generate([[1, 20, 30], [1] * 60], SamplingParams(max_tokens=8))
        assert not eng.has_unfinished() and eng.blocks.num_free == eng.blocks.num_blocks
        (out,) = eng.generate([[1, 20, 30]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(out.output_token_ids) == 8 and not eng.has_unfinished()
    finally:
        eng.close()


@pytest.mark.parametrize(
    ("depth", "caching", "blocks", "block_size", "budget", "length"),
    [(1, False, 16, 16, 100, 160), (2, False, 16, 16, 100, 160), (2, True, 8, 4, 3, 20)],
)
def test_two_prompts_that_fit_the_pool_only_one_at_a_time_both_finish(
    default_model, depth, caching, blocks, block_size, budget, length
):
    """Chunked prefills that each fit the pool but not together. At depth 2 the request in flight
    could not be preempted, so the other preempted itself, was admitted again in the same step,
    took the blocks back, and the two took turns for ever."""
    prompts = [[1, *range(10, 10 + length)], [1, *range(2000, 2000 + length)]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want, _ = run(default_model, prompts, params, speculation="none")
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(default_model / "target"),
            speculation="none",
            num_kv_blocks=blocks,
            block_size=block_size,
            max_num_batched_tokens=budget,
            pipeline_depth=depth,
            enable_prefix_caching=caching,
        )
    )
    try:
        for rid, prompt in zip("ab", prompts):
            eng.add_request(rid, prompt, params)
        out = {rid: [] for rid in "ab"}
        for _ in range(200):
            for d in eng.step():
                out[d.request_id] += d.new_token_ids
            if not eng.has_unfinished():
                break
        assert not eng.has_unfinished(), f"still running after 200 steps, {eng.scheduler.num_preemptions} preemptions"
        assert [out["a"], out["b"]] == [w.output_token_ids for w in want]
        counters = eng.stats.counters
        assert 1 <= eng.scheduler.num_preemptions <= 2
        # the preempted prompt's recompute is neither a second query nor a hit on its own blocks
        assert counters["prefix_cache_queries_total"] == counters["prompt_tokens_total"] == 2 * (length + 1)
        assert counters["prefix_cache_hits_total"] == 0
        eng.blocks.check_invariants()
    finally:
        eng.close()


def test_prompt_tokens_count_once_computed_not_when_queued(smoke_model):
    """vLLM's ``prompt_tokens_total`` counts a prompt at the request's first token: one cancelled
    while it waited computed none."""
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none", max_num_seqs=1))
    try:
        eng.add_request("runs", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        eng.add_request("queued", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
        eng.step()
        eng.abort("queued")
        finals = {d.request_id: d.finish_reason for _ in range(10) for d in eng.step() if d.finished}
        assert finals == {"queued": "cancelled", "runs": "length"}
        assert eng.stats.counters["prompt_tokens_total"] == 3
    finally:
        eng.close()


def test_abort_frees_blocks_and_ends_with_cancelled(smoke_model):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", pipeline_depth=2))
    for i in range(4):
        eng.add_request(f"r{i}", "import os\n" * (i + 1), SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.abort("r1")
    eng.abort("r3")
    finals = {}
    while eng.has_unfinished():
        for d in eng.step():
            if d.finished:
                finals[d.request_id] = d.finish_reason
            if d.request_id in ("r1", "r3") and d.finished:
                assert d.new_text == "" or isinstance(d.new_text, str)
        if "r1" in finals and "r3" in finals:
            eng.abort("r0")
            eng.abort("r2")
    assert finals == {"r0": "cancelled", "r1": "cancelled", "r2": "cancelled", "r3": "cancelled"}
    assert eng.blocks.usage() == 0.0
    eng.blocks.check_invariants()


def test_bad_requests_are_rejected_with_the_field_named(smoke_model):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=8, block_size=8))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("a", list(range(3, 3 + 70)))
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request("b", "")
    with pytest.raises(ValueError, match="max_tokens"):
        eng.add_request("c", "x = 1", SamplingParams(max_tokens=64))
    for field, kw in [
        ("max_tokens", {"max_tokens": 0}),
        ("temperature", {"temperature": -1.0}),
        ("temperature", {"temperature": float("inf")}),
        ("top_p", {"top_p": 0.0}),
        ("top_p", {"top_p": 1.5}),
    ]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    with pytest.raises(ValueError, match="speculation"):
        EngineConfig(speculation="medusa")
    with pytest.raises(ValueError, match="policy"):
        EngineConfig(policy="static:x")


def test_an_end_id_outside_the_vocabulary_is_refused_and_the_batch_keeps_decoding(smoke_model):
    """An end id is first used inside a batched step (masking it under min_tokens): one out of range
    there would fail every request in the batch, so it is refused when the request is added."""
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none"))
    vocab = eng.model_config.vocab_size
    eng.add_request("good", "def f(x):", SamplingParams(max_tokens=6, ignore_eos=True, min_tokens=2))
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match=rf"^end_id={bad}: must be a token id in \[0, {vocab}\)"):
            eng.add_request(f"bad{bad}", "def g():", SamplingParams(max_tokens=6, min_tokens=2, end_id=bad))
    eng.add_request("edge", "def g():", SamplingParams(max_tokens=6, min_tokens=2, end_id=vocab - 1))
    finals = {d.request_id: d for _ in range(40) for d in eng.step() if d.finished}
    assert set(finals) == {"good", "edge"} and finals["good"].finish_reason == "length"


def test_a_top_k_beyond_int32_is_refused_naming_it():
    """The stages carry top_k as int32; a larger one would wrap there (or overflow int64 in torch)."""
    assert SamplingParams(top_k=2**31 - 1).top_k == 2**31 - 1
    for bad in (2**31, 10**20):
        with pytest.raises(ValueError, match=rf"^top_k={bad}: must be in \[0, 2147483647\]"):
            SamplingParams(top_k=bad)


def test_a_max_model_len_below_one_is_refused_naming_it():
    assert EngineConfig(max_model_len=None).max_model_len is None
    for bad in (0, -5):
        with pytest.raises(ValueError, match=rf"^max_model_len={bad}: must be a positive integer"):
            EngineConfig(max_model_len=bad)


@pytest.mark.parametrize("depth", [1, 2])
def test_an_abort_with_an_error_ends_the_request_failed_and_counts_it_as_a_failure(smoke_model, depth):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", pipeline_depth=depth))
    for rid in ("failed", "cancelled", "kept"):
        eng.add_request(rid, "def f(x):", SamplingParams(max_tokens=40, ignore_eos=True))
    eng.step()
    eng.abort("failed", "engine step failed: boom")
    eng.abort("cancelled")
    finals = {d.request_id: d for _ in range(200) for d in eng.step() if d.finished}
    assert (finals["failed"].finish_reason, finals["failed"].error) == ("error", "engine step failed: boom")
    assert finals["cancelled"].finish_reason == "cancelled" and finals["kept"].finish_reason == "length"
    stats = eng.stats.snapshot()
    assert stats["request_failure_total"] == 1 and stats["request_success_total"]["abort"] == 1


def test_higher_priority_is_admitted_first(smoke_model):
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), max_num_seqs=1))
    eng.add_request("low", "a = 1", SamplingParams(max_tokens=3, priority=0))
    eng.add_request("high", "b = 2", SamplingParams(max_tokens=3, priority=5))
    order = []
    while eng.has_unfinished():
        order += [d.request_id for d in eng.step() if d.finished]
    assert order == ["high", "low"]


class FlakyExecutor:
    """Wraps the local executor; the first call to ``stage`` fails like a crashed stage model."""

    def __init__(self, inner, stage: str = "target"):
        self.inner, self.stage, self.failed = inner, stage, False

    def submit(self, stage, call):
        if stage == self.stage and not self.failed:
            self.failed = True
            f = Future()
            f.set_exception(RuntimeError(f"stage lightspec_{stage} crashed"))
            return f
        return self.inner.submit(stage, call)

    def profile(self, stage, spec):  # timed through this executor, so its failure reaches the profile
        timing = profile_verify if stage == "target" else profile_propose
        return timing(self, spec, set(self.inner.runners))

    def close(self):
        self.inner.close()


def test_stage_failure_fails_the_micro_batch_and_engine_keeps_serving(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", profile_stages=False)
    eng = LLMEngine(cfg, executor=FlakyExecutor(build_local_executor(cfg)))
    out = eng.generate(["x = 1", "y = 2"], SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in out] == ["error", "error"]
    assert "crashed" in out[0].error
    assert eng.blocks.usage() == 0.0
    again = eng.generate(["x = 1"], SamplingParams(max_tokens=4))[0]
    assert again.finish_reason == "length" and len(again.output_token_ids) == 4


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("stage", ["mtp", "draft"])
def test_a_failed_proposer_stage_fails_its_micro_batch_only_and_the_queue_is_served_exactly(smoke_model, stage, depth):
    """As a failed target call: the requests of the step whose drafting failed end with the stage's
    error; the requests waiting behind it are served, token for token as without the failure."""
    cfg = EngineConfig(
        model_dir=str(smoke_model / "target"),
        speculation=stage,
        mtp="local",
        policy="static:3",
        max_num_seqs=1,
        pipeline_depth=depth,
        profile_stages=False,
    )  # local: the mtp stage is called
    prompts, params = ["x = 1", "def f(a):", "import os\n"], SamplingParams(max_tokens=8, ignore_eos=True)
    want = LLMEngine(cfg).generate(prompts, params)
    flaky = FlakyExecutor(build_local_executor(cfg), stage)
    eng = LLMEngine(cfg, executor=flaky)
    out = eng.generate(prompts, params)
    assert flaky.failed, "the proposer stage was never called: the test proves nothing"
    assert (out[0].finish_reason, out[0].error) == ("error", f"stage failure: stage lightspec_{stage} crashed")
    assert [o.output_token_ids for o in out[1:]] == [o.output_token_ids for o in want[1:]]
    assert [o.finish_reason for o in out[1:]] == ["length", "length"]
    assert eng.blocks.usage() == 0.0 and eng.stats.snapshot()["request_failure_total"] == 1
    eng.close()


def test_dynamic_engine_profiles_its_stages_while_it_loads(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", max_num_seqs=8)
    eng = LLMEngine(cfg)
    assert eng.cost.calibrated and not eng.profile_pending and eng.cost.verify.sizes.tolist() == [1, 2, 4, 8]
    out = eng.generate(["x = 1"], SamplingParams(max_tokens=8))[0]
    assert (
        out.output_token_ids
        == LLMEngine(EngineConfig(model_dir=cfg.model_dir, speculation="none"))
        .generate(["x = 1"], SamplingParams(max_tokens=8))[0]
        .output_token_ids
    )


def test_an_engine_told_to_profile_later_profiles_before_its_first_step(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", max_num_seqs=8)
    eng = LLMEngine(cfg, profile_now=False)  # a server whose stages load after the engine
    assert not eng.cost.calibrated and eng.profile_pending
    eng.generate(["x = 1"], SamplingParams(max_tokens=4))
    assert eng.cost.calibrated and not eng.profile_pending


def test_dynamic_engine_publishes_what_its_policy_believes_a_step_costs(smoke_model):
    """Gauges of the cost model the dynamic policy plans with: a draft's price at the current batch,
    the target's measured excess over its profile and the step's overhead; a static engine has none."""
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp", max_num_seqs=8)
    eng = LLMEngine(cfg)
    eng.generate(["x = 1", "y = 2"], SamplingParams(max_tokens=8))
    snap = eng.stats.snapshot()
    # the last step ran with no request left running: the price is quoted at a batch of one
    assert (
        snap["policy_draft_cost_seconds"] == pytest.approx(eng.cost.per_slot(1))
        and snap["policy_draft_cost_seconds"] > 0
    )
    assert snap["policy_step_excess_seconds"] == eng.cost.verify_extra != 0.0  # measured, not the initial 0
    assert snap["policy_step_overhead_seconds"] == eng.cost.overhead
    static = LLMEngine(EngineConfig(model_dir=cfg.model_dir, speculation="mtp", policy="static:2"))
    static.generate(["x = 1"], SamplingParams(max_tokens=4))
    assert not any(k.startswith("policy_") for k in static.stats.snapshot())


def test_a_failed_profile_leaves_generic_costs_and_serving_intact(smoke_model):
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="mtp")
    eng = LLMEngine(cfg, executor=FlakyExecutor(build_local_executor(cfg)))  # fails the profile's first call
    out = eng.generate(["x = 1", "y = 2"], SamplingParams(max_tokens=4))
    assert [o.finish_reason for o in out] == ["length", "length"]
    assert not eng.cost.calibrated and eng.blocks.usage() == 0.0


@pytest.mark.parametrize("fused", [False, True], ids=["mtp-stage", "fused"])
def test_confidence_stop_shortens_chains_and_stays_lossless(exactness_setup, fused):
    """With ``confidence_stop`` the dynamic policy's MTP chains stop where the heads' confidence
    says a draft does not pay: some granted slots go unused, the confidence table learns from what
    is verified, and greedy output is still exactly plain greedy decoding. (The policy's floors
    depend on measured stage times; a fixed floor of 0.5 makes the stops certain here.)"""
    root, prompts, params, ref = exactness_setup
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(root / "target"),
            speculation="mtp",
            policy="dynamic",
            confidence_stop=True,
            mtp="fused" if fused else "local",
        )
    )
    policy, choose = eng.scheduler.policy, eng.scheduler.policy.choose
    assert policy.floors  # the policy computes floors for this engine's stop

    def choose_with_floor(reqs, *args, **kw):
        ks = choose(reqs, *args, **kw).ks
        return Decision(ks, [0.5] * len(ks) if any(ks) else None)

    policy.choose = choose_with_floor
    try:
        outs = eng.generate(prompts, params)
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == ref
    assert eng.stats.counters["spec_decode_num_stopped_drafts_total"] > 0
    assert sum(o.num_accepted_tokens for o in outs) > 0
    if fused:  # the stop cut the target stage's drafts, with the confidences it returned
        assert eng.stats.counters["spec_decode_num_fused_drafts_total"] == sum(o.num_draft_tokens for o in outs)
        learned = eng.proposer.confidence.table() != ConfidenceStats(eng.scheduler.max_k).table()
        assert learned[0, :, 1:].any(), "only the zero-confidence bucket learned: no confidences came back"
    assert (eng.proposer.confidence.table() != ConfidenceStats(eng.scheduler.max_k).table()).any()
    outs, eng = run(root, prompts, params, speculation="mtp", policy="dynamic")  # the default: off
    assert [o.output_token_ids for o in outs] == ref
    assert eng.proposer.confidence is None and eng.stats.counters["spec_decode_num_stopped_drafts_total"] == 0
    assert not eng.scheduler.policy.floors


def test_on_launched_runs_once_per_step_between_launch_and_completion(smoke_model):
    """The server sends a step's responses from ``on_launched`` of the next step: it must come once
    per ``step()``, after the next micro-batch is submitted and before the engine waits for it."""
    eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), num_kv_blocks=64, block_size=16))
    seen = []
    eng.add_request("a", "def f(x):", SamplingParams(max_tokens=6, ignore_eos=True))
    try:
        steps = 0
        while eng.has_unfinished():
            eng.step(on_launched=lambda: seen.append(len(eng._inflight)))
            steps += 1
    finally:
        eng.close()
    assert len(seen) == steps and steps >= 2
    assert seen == [1] * steps  # the step's micro-batch was in flight when the callback ran


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("tiny_pool", [False, True], ids=["pool", "tiny-pool"])
def test_fused_mtp_is_lossless_and_greedy_requests_skip_the_mtp_stage(exactness_setup, depth, tiny_pool):
    """With ``fused_mtp`` the target stage proposes greedy requests' drafts along with each step:
    output is still plain greedy decoding (with preemption and recompute too), the ``mtp`` stage is
    never called for greedy requests, and every draft came fused. Sampled requests still draft on
    the ``mtp`` stage, and their outputs are those of the unfused engine (same draws)."""
    root, prompts, params, ref = exactness_setup
    kw = {"num_kv_blocks": 40, "block_size": 8} if tiny_pool else {}
    eng = LLMEngine(
        EngineConfig(
            model_dir=str(root / "target"),
            speculation="mtp",
            policy="static:3",
            pipeline_depth=depth,
            mtp="fused",
            **kw,
        )
    )
    calls = []
    submit = eng.executor.submit
    eng.executor.submit = lambda stage, call: (calls.append(stage) if stage == "mtp" else None) or submit(stage, call)
    try:
        outs = eng.generate(prompts, params)
        assert [o.output_token_ids for o in outs] == ref
        assert calls == [], "a greedy request drafted on the mtp stage"
        drafts = sum(o.num_draft_tokens for o in outs)
        assert drafts > 0 and eng.stats.counters["spec_decode_num_fused_drafts_total"] == drafts
        if tiny_pool:
            assert eng.scheduler.num_preemptions > 0, "the tiny pool was meant to force preemption"
        mixed = [
            SamplingParams(max_tokens=24, temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=True) for i in range(4)
        ]
        fused_out = eng.generate(prompts[:4], mixed)
        assert calls, "sampled requests draft on the mtp stage"
    finally:
        eng.close()
    plain, _ = run(
        root, prompts[:4], mixed, speculation="mtp", policy="static:3", pipeline_depth=depth, mtp="local", **kw
    )
    assert [o.output_token_ids for o in fused_out] == [o.output_token_ids for o in plain]


def test_fused_heads_under_a_static_policy_draft_its_depth_only(exactness_setup):
    """The target stage's heads make as many next drafts as a static policy verifies, not one per
    head (each costs a head's pass over the batch's rows), and output stays plain greedy."""
    root, prompts, params, ref = exactness_setup
    eng = LLMEngine(EngineConfig(model_dir=str(root / "target"), speculation="mtp", policy="static:1", mtp="fused"))
    asked = []
    submit = eng.executor.submit

    def spy(stage, call):
        if stage == "target":
            asked.extend(int(n) for n in call.mtp_drafts)
        return submit(stage, call)

    eng.executor.submit = spy
    try:
        outs = eng.generate(prompts, params)
    finally:
        eng.close()
    assert [o.output_token_ids for o in outs] == ref
    assert max(asked) == 1 and sum(o.num_accepted_tokens for o in outs) > 0


class LateAnswerExecutor:
    """Delivers each target answer ``delay`` seconds after the stage stamped it (``t_done``): what a
    thread that keeps the interpreter after the answer arrives does to a done-callback's stamp."""

    def __init__(self, inner, delay: float):
        self.inner, self.delay = inner, delay
        self.durations = []  # each target call's own time, submit to stamp

    def submit(self, stage, call):
        import threading
        import time

        t0 = time.perf_counter()
        inner = self.inner.submit(stage, call)
        if stage != "target":
            return inner
        self.durations.append(getattr(inner, "t_done", time.perf_counter()) - t0)
        outer: Future = Future()

        def deliver():
            time.sleep(self.delay)
            if hasattr(inner, "t_done"):  # an executor without stamps: the engine stamps on delivery
                outer.t_done = inner.t_done
            outer.set_result(inner.result())

        threading.Thread(target=deliver, daemon=True).start()
        return outer

    def close(self):
        self.inner.close()


def test_target_latency_is_when_the_stage_answered_not_when_the_engine_noticed(smoke_model):
    """The target stage's latency (its metric and the policy's cost model) ends at the future's
    ``t_done``, stamped where the stage answered, not when the engine's thread got to look."""
    cfg = EngineConfig(model_dir=str(smoke_model / "target"), speculation="none", profile_stages=False)
    late = LateAnswerExecutor(build_local_executor(cfg), delay=0.2)
    eng = LLMEngine(cfg, executor=late)
    out = eng.generate(["x = 1"], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    eng.close()
    assert len(out.output_token_ids) == 3
    seen = [
        v
        for name, v, labels in eng.stats.drain_observations()
        if name == "stage_latency_seconds" and labels == {"stage": "target"}
    ]
    assert len(seen) == len(late.durations) == 3
    for latency, own in zip(seen, late.durations):  # each answer reached the engine 200 ms after its stamp
        assert own <= latency < own + 0.1


@pytest.mark.parametrize("threaded", [False, True])
def test_local_stage_futures_carry_the_time_the_stage_answered(threaded):
    import time

    from lightspec_core.stages.executor import LocalExecutor

    class Runner:
        def execute(self, call):
            time.sleep(0.01)
            if call == "fail":
                raise ValueError("bad call")
            self.end = time.perf_counter()
            return call

    runner = Runner()
    ex = LocalExecutor({"s": runner}, threaded=threaded)
    fut = ex.submit("s", "ok")
    assert fut.result() == "ok"
    assert runner.end <= fut.t_done <= time.perf_counter()
    bad = ex.submit("s", "fail")
    with pytest.raises(ValueError, match="bad call"):
        bad.result()
    assert bad.t_done <= time.perf_counter()
    ex.close()


def _calls():
    import numpy as np

    from lightspec_core.stages.contract import ModelCall

    def call(query_lens):
        return ModelCall(input_ids=np.zeros(sum(query_lens), np.int64), positions=np.zeros(sum(query_lens), np.int64),
                         query_lens=np.array(query_lens, np.int32), block_tables=np.zeros((len(query_lens), 1), np.int32),
                         sample_indices=np.zeros(0, np.int64), return_logits=np.array([False]),
                         return_hidden=np.array([False]))  # fmt: skip

    return call([1, 1, 1]), call([1, 5, 1]), call([40])


@pytest.mark.parametrize("threaded", [False, True])
def test_decode_only_calls_run_on_decode_threads_and_the_others_on_the_engine_threads(threaded):
    import torch

    from lightspec_core.stages.executor import LocalExecutor

    class Runner:
        def execute(self, call):
            return torch.get_num_threads()

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        ex = LocalExecutor({"target": Runner()}, threaded=threaded, decode_threads=1)
        decode, verify, prefill = _calls()
        got = [ex.submit("target", c).result() for c in (decode, verify, decode, prefill, decode)]
        assert got == [1, 3, 1, 3, 1]
        ex.set_threads(2)  # what a shard is told when another shard gets work (engine.shards)
        assert [ex.submit("target", c).result() for c in (decode, verify, prefill)] == [1, 2, 2]
        ex.close()
        unchanged = LocalExecutor({"target": Runner()})
        assert unchanged.submit("target", decode).result() == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


class _NiceRunner:
    """Reports the nice value of the thread that runs the call."""

    def execute(self, call):
        return os.getpriority(os.PRIO_PROCESS, 0)


def _in_own_thread(fn):
    """``fn()`` on a thread of its own: a thread's priority, once raised, stays with that thread."""
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.mark.skipif(os.geteuid() != 0, reason="raising a thread's priority needs root (CAP_SYS_NICE); CI runs as root")
@pytest.mark.parametrize("threaded", [False, True])
def test_a_lone_decoding_thread_runs_at_decode_nice_and_every_other_call_at_its_own(threaded):
    import torch

    from lightspec_core.stages.executor import LocalExecutor

    decode, verify, prefill = _calls()
    before = torch.get_num_threads()

    def run(decode_threads):
        own = os.getpriority(os.PRIO_PROCESS, 0)
        ex = LocalExecutor({"target": _NiceRunner()}, threaded=threaded, decode_threads=decode_threads, decode_nice=-7)
        try:
            return own, [ex.submit("target", c).result() for c in (decode, verify, decode, prefill, decode, verify)]
        finally:
            ex.close()

    try:
        torch.set_num_threads(2)
        own, got = _in_own_thread(lambda: run(1))
        assert got == [-7, own, -7, own, -7, own]
        # decoding on two threads: the OpenMP workers would stay at the process's priority, so none is raised
        own, got = _in_own_thread(lambda: run(2))
        assert got == [own] * 6
    finally:
        torch.set_num_threads(before)


def test_without_cap_sys_nice_decoding_keeps_its_priority_and_says_why_once(monkeypatch, caplog):
    from lightspec_core.stages import executor

    def refused(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(executor.os, "setpriority", refused)
    decode, verify, _ = _calls()
    ex = executor.LocalExecutor({"target": _NiceRunner()}, decode_threads=1, decode_nice=-10)

    def run():
        return os.getpriority(os.PRIO_PROCESS, 0), [ex.submit("target", c).result() for c in (decode, verify, decode)]

    with caplog.at_level("WARNING", logger="lightspec"):
        own, got = _in_own_thread(run)
    assert got == [own] * 3
    refusals = [r.getMessage() for r in caplog.records if "decode_nice -10" in r.getMessage()]
    assert len(refusals) == 1 and "CAP_SYS_NICE" in refusals[0]
    with pytest.raises(ValueError, match=r"decode_nice=5: must be in -20..0"):
        EngineConfig(decode_nice=5)


def test_decode_threads_reach_the_engine_steps_and_leave_outputs_unchanged(smoke_model):
    import torch

    from lightspec_core.stages.executor import decodes_only

    with pytest.raises(ValueError, match=r"decode_threads=-2: must be 0 \(the default\) or a positive integer"):
        EngineConfig(decode_threads=-2)
    with pytest.raises(ValueError, match=r"num_threads=-1"):
        EngineConfig(num_threads=-1)
    before = torch.get_num_threads()
    prompts, params = ["def f(x):", "class A:\n    def g(self):"], SamplingParams(max_tokens=12, ignore_eos=True)
    try:
        outs = {}
        for decode_threads in (0, 1):
            eng = LLMEngine(EngineConfig(model_dir=str(smoke_model / "target"), speculation="none", num_threads=2,
                                         decode_threads=decode_threads))  # fmt: skip
            runner, seen = eng.executor.runners["target"], []
            execute = runner.execute

            def spy(call, execute=execute, seen=seen):
                seen.append((decodes_only(call), torch.get_num_threads()))
                return execute(call)

            runner.execute = spy
            outs[decode_threads] = [o.output_token_ids for o in eng.generate(prompts, params)]
            eng.close()
            assert {t for decoding, t in seen if not decoding} == {2}  # the prompts
            assert {t for decoding, t in seen if decoding} == {decode_threads or 2}
        assert outs[1] == outs[0]
    finally:
        torch.set_num_threads(before)
