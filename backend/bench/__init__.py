"""``lightspec bench``: throughput and latency of speculation configurations through a real Triton server.

One orchestrator model per configuration (``lightspec_none``, ``lightspec_mtp_static_2``,
``lightspec_mtp_dynamic``, ...) in a generated repository; all share the stage models
(``lightspec_target``, ``lightspec_mtp``, ``lightspec_draft``). The server runs with explicit model
control and exactly one orchestrator is loaded at a time: the target stage's KV pool is indexed by
block ids that each orchestrator allocates on its own, so two orchestrators must never use it at
once, while one after the other is safe (a sequence only reads KV slots its own steps wrote).

The client speaks gRPC, a stream per request, every stream on one asyncio channel. Closed loop
(``--concurrency``): C workers each send their next request when the previous one finished. Open
loop (``--rate``): Poisson arrivals; latency counts from the scheduled arrival. Server-side numbers (acceptance length, draft
tokens per step, scheduler decision time) are differences of the ``lightspec:`` metrics scraped
before and after each run. See docs/benchmarks.md.

Modules, in the order data flows: :mod:`.configs` (what runs), :mod:`.workload` (the prompts),
:mod:`.runner` (the server, the sweep), :mod:`.client` (the requests), :mod:`.scrape` (the server's
metrics), :mod:`.stats` (the numbers), :mod:`.report` (table, JSON, plot), :mod:`.command` (the flags).
``--peer vllm`` adds vLLM's CPU build beside it: :mod:`.peer` (its environment, commands and server
process), :mod:`.sse` (one HTTP SSE client for both servers), :mod:`.peer_run` (the side-by-side
sweep), :mod:`.peer_main` (its flags and report).
"""

from .command import build_parser, main

__all__ = ["build_parser", "main"]
