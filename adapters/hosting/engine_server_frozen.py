"""The last module the engine-core server imports (engine_processes.PRELOAD; `calm serve` imports it before it forks
the server from itself: engine_server_fork.py): what it imported (vLLM, torch and
transformers: over a million objects that live as long as any engine core) collected once and frozen, before it forks
anything, as CPython's gc.freeze documentation advises for fork without exec. Every engine core inherits the frozen
heap: the collections vLLM runs while it loads a model (gc.collect() twice, and once more before its own freeze) walk
only the core's own objects (a default gateway's start 31.5 -> 27.9 CPU s when each core froze it itself:
benchmarks/results/engine_start_revision.md), and collecting leaves the server's pages unwritten, so shared."""

import gc

gc.collect()
gc.freeze()
