"""Where `rollplex run`'s start-up goes: `python bench/startup_times.py run SPEC [run options]`.

Runs the CLI with the start-up's stages timed (building each model, the optimizer and its pinned host pool, the
rollout, the dataset) and each step's `run_iteration`; prints `[startup] NAME SECONDS (at SECONDS)` to stderr.
"""

from __future__ import annotations

import functools
import sys
import time

import rollplex.cli as cli
import rollplex.executors.engines as engines
import rollplex.executors.loop as loop
import rollplex.memory.host_pool as host_pool

START = time.perf_counter()


def timed(module, name: str) -> None:
    """Replaces module.name by a wrapper that prints each call's seconds."""
    inner = getattr(module, name)

    @functools.wraps(inner)
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        out = inner(*args, **kwargs)
        now = time.perf_counter()
        print(f"[startup] {name} {now - began:.1f}s (at {now - START:.1f})", file=sys.stderr, flush=True)
        return out

    setattr(module, name, wrapper)


for stage in ("_initial_model", "make_optimizer", "make_remote_rollout", "make_rollout", "make_reference_pager"):
    timed(engines, stage)
timed(host_pool, "_pin")
for stage in ("build_engines", "open_dataset", "run_iteration"):
    timed(loop, stage)

if __name__ == "__main__":
    sys.exit(cli.main())
