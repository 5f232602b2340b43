"""Step cost of the target runner: B requests x q new tokens each (decode q=1, verify q=1+k).

python tools/bench_runner.py [--model-dir DIR] [--batches 1 8 32 64] [--tokens 1 5] [--threads N] [--scatter]

Each request has ``--context`` tokens already in the paged KV pool; the step feeds q tokens per
request and returns outputs at all of them (as a verification step does). Prints the median of
``--repeats`` runs, and the ratio of the q-token step to the 1-token step at the same batch.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from lightspec_core.config import default_model_dir
from lightspec_core.stages.contract import ModelCall
from lightspec_core.stages.memory import keep_freed_memory
from lightspec_core.stages.target import ModelRunner


def step_call(batch: int, q: int, context: int, block_size: int, vocab: int, rng, pool_blocks: int = 0) -> ModelCall:
    """``pool_blocks``: draw the requests' blocks at random from a pool of that many (as a server's
    pool is after requests came and went); 0: consecutive blocks."""
    per = -(-(context + q) // block_size)
    if pool_blocks:
        tables = rng.permutation(pool_blocks)[: batch * per].astype(np.int32).reshape(batch, per)
    else:
        tables = np.arange(batch * per, dtype=np.int32).reshape(batch, per)
    return ModelCall(
        input_ids=rng.integers(3, vocab, batch * q).astype(np.int64),
        positions=np.tile(np.arange(context, context + q), batch).astype(np.int64),
        query_lens=np.full(batch, q, np.int32),
        block_tables=tables,
        sample_indices=np.arange(batch * q, dtype=np.int64),
        return_logits=np.array([False]),
        return_hidden=np.array([True]),
    )


def measure(model_dir: str, batches, tokens, context=128, repeats=15, block_size=16, scatter=False) -> dict:
    max_b = max(batches)
    num_blocks = max_b * (-(-(context + max(tokens)) // block_size))
    runner = ModelRunner(model_dir, num_blocks=num_blocks, block_size=block_size)
    rng = np.random.default_rng(0)
    out = {}
    for b in batches:
        for q in tokens:
            call = step_call(b, q, context, block_size, runner.config.vocab_size, rng, num_blocks if scatter else 0)
            runner.execute(call)  # warm-up
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.execute(call)
                times.append(time.perf_counter() - t0)
            out[(b, q)] = float(np.median(times))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python tools/bench_runner.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=default_model_dir())
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 5])
    ap.add_argument("--context", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--scatter", action="store_true", help="block tables drawn at random from the pool (a served pool)")
    a = ap.parse_args(argv)
    keep_freed_memory()  # as the server's stage processes do
    threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        res = measure(a.model_dir, a.batches, a.tokens, a.context, a.repeats, scatter=a.scatter)
    finally:
        torch.set_num_threads(threads)  # callers in the same process (tests) keep their setting
    q0 = a.tokens[0]
    print(f"threads: {a.threads or threads}")
    print("| batch | " + " | ".join(f"{q} tok/req (ms)" for q in a.tokens) + f" | ratio {a.tokens[-1]}/{q0} |")
    print("|---|" + "---|" * (len(a.tokens) + 1))
    for b in a.batches:
        cells = " | ".join(f"{res[(b, q)] * 1e3:.2f}" for q in a.tokens)
        print(f"| {b} | {cells} | {res[(b, a.tokens[-1])] / res[(b, q0)]:.2f} |")
    return res


if __name__ == "__main__":
    main()
