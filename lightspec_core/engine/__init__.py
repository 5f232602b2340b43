"""The engine: the step loop (``engine``), continuous batching (``scheduler``), KV block allocation
(``block_manager``), request state (``sequence``), runtime statistics and outputs."""
