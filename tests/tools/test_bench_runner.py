"""``python tools/bench_runner.py``: the target runner's step cost, on the smoke model."""

from __future__ import annotations

import numpy as np
import torch

from tools import bench_runner


def test_step_call_feeds_q_tokens_per_request_after_the_context():
    call = bench_runner.step_call(batch=2, q=3, context=20, block_size=16, vocab=50, rng=np.random.default_rng(0))
    assert call.input_ids.shape == (6,) and call.query_lens.tolist() == [3, 3]
    assert call.positions.tolist() == [20, 21, 22] * 2
    assert call.block_tables.shape == (2, 2) and len(set(call.block_tables.ravel())) == 4  # no shared blocks
    assert call.sample_indices.tolist() == list(range(6))  # outputs at every token, as verification needs
    scattered = bench_runner.step_call(2, 3, 20, 16, 50, np.random.default_rng(0), pool_blocks=40)
    blocks = scattered.block_tables.ravel()
    assert len(set(blocks)) == 4 and blocks.max() < 40 and blocks.tolist() != [0, 1, 2, 3]


def test_steps_are_timed_per_batch_and_tokens(smoke_model, capsys):
    argv = ["--model-dir", str(smoke_model / "target"), "--batches", "1", "2", "--tokens", "1", "3",
            "--context", "16", "--repeats", "2", "--threads", "1"]  # fmt: skip
    before = torch.get_num_threads()
    res = bench_runner.main(argv)
    assert sorted(res) == [(1, 1), (1, 3), (2, 1), (2, 3)] and all(t > 0 for t in res.values())
    out = capsys.readouterr().out
    assert "| 2 |" in out and "threads: 1" in out
    assert torch.get_num_threads() == before  # the caller's setting is restored
