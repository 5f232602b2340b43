"""vLLM's ``LLM.generate`` on given prompts, the in-process peer of ``tools/bench_engine.py --peer vllm``.

python tools/peer_vllm_inprocess.py < plan.json   # with a vLLM environment's python

Runs under the python of a vLLM environment (``lightspec bench --peer-venv-create`` makes one), so it
imports nothing of LightSpec. Reads a JSON plan on stdin::

    {"model": DIR, "prompts": [...], "max_tokens": 128, "batches": [1, 64], "rounds": 3,
     "config": "ngram", "speculative": {...vLLM's speculative config, or null...},
     "engine_args": {...the rest of LLM's arguments, as the serving bench gives vLLM's server...}}

and prints one JSON line per batch: the median-high time of ``rounds`` runs, the throughput, and the
greedy output ids of the last run (the caller compares them with LightSpec's). One configuration per
process: vLLM's engine core is a child process that one ``LLM`` owns until the interpreter exits.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def rows_for(llm, name: str, plan: dict) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=plan["max_tokens"], temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    rows = []
    for batch in plan["batches"]:
        prompts = plan["prompts"][:batch]
        llm.generate(prompts[:2], warm, use_tqdm=False)
        times, outputs = [], []
        for _ in range(plan["rounds"]):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            outputs = [list(o.outputs[0].token_ids) for o in outs]
        seconds = statistics.median_high(times)
        tokens = sum(len(ids) for ids in outputs)
        rows.append({"engine": "vllm", "config": name, "batch": batch, "tokens": tokens, "seconds": seconds,
                     "throughput_tok_s": tokens / seconds, "outputs": outputs})  # fmt: skip
    return rows


def main() -> None:
    argparse.ArgumentParser(prog="python tools/peer_vllm_inprocess.py", description=__doc__.split("\n")[0]).parse_args()
    plan = json.load(sys.stdin)
    from vllm import LLM

    llm = LLM(model=plan["model"], speculative_config=plan["speculative"], **plan["engine_args"])
    for row in rows_for(llm, plan["config"], plan):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":  # vLLM's engine core starts by spawn: the plan is read in the main process only
    main()
