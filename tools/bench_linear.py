"""A step's matrix products: the native kernel (models/cpu_linear.c), numpy, torch.

python tools/bench_linear.py [--model-dir DIR] [--rows 1 5 16 64 320] [--threads N]

One "step" multiplies ``rows`` activation rows by every weight matrix of the model as the runner
holds them (fused q/k/v and gate/up, o, down, LM head), each matrix once. The model's weights are
copied until the set outgrows the last-level cache (``--working-set``), and the steps go round the
copies, so each step reads its weights from memory as a served model does (other work runs between
its steps). Prints the median step time of each path and torch's time over the kernel's (whose
weights are packed before the timing, as a model's are at its first step). numpy runs at one row
only, on one thread (its matrix-vector product is the fallback there, kept to one thread by the
runner).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
import torch.nn.functional as F
from threadpoolctl import threadpool_limits

from lightspec_core.config import default_model_dir
from lightspec_core.models import cpu_linear
from lightspec_core.models.llama import LlamaModel


def step_weights(model: LlamaModel) -> list[torch.Tensor]:
    """The matrices of one step, in the order the runner uses them."""
    out = []
    for layer in model.model.layers:
        a, mlp = layer.self_attn, layer.mlp
        out += [a.fused[0], a.o_proj.weight.detach(), mlp.fused[0], mlp.down_proj.weight.detach()]
    return [*out, model.lm_head.weight.detach()]


def paths(rows: int) -> dict:
    """name -> product(x, w) for the paths measured at ``rows``."""
    out = {"torch": F.linear}
    if cpu_linear.kernel() is not None:
        out["native"] = cpu_linear.linear
    if rows == 1:
        out["numpy"] = lambda x, w: torch.from_numpy(w.numpy() @ x.numpy()[0])[None]
    return out


def measure(model_dir: str, rows_list, repeats=9, working_set_mb=96) -> dict:
    model = LlamaModel.load(model_dir)
    model.fuse_projections()
    weights = step_weights(model)
    size = sum(w.numel() * w.element_size() for w in weights)
    sets = [weights] + [[w.clone() for w in weights] for _ in range(max(0, -(-working_set_mb * 2**20 // size) - 1))]
    if cpu_linear.kernel() is not None:
        for w in (w for ws in sets for w in ws):
            cpu_linear.packed(w)
    gen = torch.Generator().manual_seed(0)
    res = {}
    with torch.inference_mode(), threadpool_limits(1, user_api="blas"):  # numpy on one thread, as the runner
        for rows in rows_list:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen) for w in weights}
            fns = paths(rows)
            want = [F.linear(xs[w.shape[1]], w) for w in weights]
            for name, fn in fns.items():  # every path computes the same products before it is timed
                for w, ref in zip(weights, want):
                    torch.testing.assert_close(fn(xs[w.shape[1]], w), ref, atol=1e-3, rtol=1e-4, msg=name)
            times = {name: [] for name in fns}
            for r in range(repeats):
                for name, fn in fns.items():  # interleaved, so the host's drift touches every path alike
                    t0 = time.perf_counter()
                    for w in sets[r % len(sets)]:
                        fn(xs[w.shape[1]], w)
                    times[name].append(time.perf_counter() - t0)
            for name, ts in times.items():
                res[(rows, name)] = float(np.median(ts))
    return res


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python tools/bench_linear.py", description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", default=default_model_dir())
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 5, 16, 64, 320])
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--working-set", type=int, default=96, help="MB of weight copies the steps go round")
    ap.add_argument("--threads", type=int, default=0, help="threads (0: torch's default)")
    a = ap.parse_args(argv)
    threads = torch.get_num_threads()
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        res = measure(a.model_dir, a.rows, a.repeats, a.working_set)
    finally:
        torch.set_num_threads(threads)
    print(f"threads: {a.threads or threads}")
    print("| rows | native (ms) | numpy (ms) | torch (ms) | torch / native |")
    print("|---|---|---|---|---|")
    for rows in a.rows:
        cell = {n: (f"{res[(rows, n)] * 1e3:.2f}" if (rows, n) in res else "-") for n in ("native", "numpy", "torch")}
        ratio = f"{res[(rows, 'torch')] / res[(rows, 'native')]:.2f}" if (rows, "native") in res else "-"
        print(f"| {rows} | {cell['native']} | {cell['numpy']} | {cell['torch']} | {ratio} |")
    return res


if __name__ == "__main__":
    main()
