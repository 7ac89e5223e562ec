"""What `rollplex run` says while it trains: a line a step where progress goes to a log (naming what stalled the
step), bars per step and phase on a terminal, and lines above the bars (an evaluation's)."""

from __future__ import annotations

import sys

from rollplex.graph.ir import Phase, steps


def step_line(record: dict, total: int, warm: bool = True) -> str:
    """A step's line where progress goes to a log rather than a terminal; it names what stalled the step
    (`_stalls`)."""
    return (
        f"step {record['step']}/{total}: {record['time_s']['step']:.2f} s, reward {record['reward_mean']:.3f}, "
        f"loss {record['loss']:.4f}{stalls(record, warm)}"
    )


def stalls(record: dict, warm: bool) -> str:
    """What made the step wait on the host, else '': the allocator's retries of a cudaMalloc (', 4 allocator retries
    (phase 1: 1, phase 2: 3)'), which wait for the device, and in a `warm` step (not the process's first) its
    compiles (', 2 compiles (triton 1: _norm_backward, torch 1)')."""
    phases = {p: n for p, n in record.get("alloc_retries_by_phase", {}).items() if n}
    where = ", ".join(f"phase {p}: {n}" for p, n in phases.items())
    text = f", {sum(phases.values())} allocator retries ({where})" if phases else ""
    compiles = record.get("compiles", {})
    counts = {kind: compiles.get(kind, 0) for kind in ("triton", "torch") if compiles.get(kind, 0)}
    if warm and counts:
        names = ", ".join(sorted(set(compiles.get("kernels", ()))))
        kinds = ", ".join(
            f"{kind} {n}" + (f": {names}" if kind == "triton" and names else "") for kind, n in counts.items()
        )
        text += f", {sum(counts.values())} compiles ({kinds})"
    return text


def say(line: str, bar=None) -> None:
    """A line on stderr, above the progress `bar` where there is one."""
    if bar is not None:
        bar.write(line, file=sys.stderr)
    else:
        print(line, file=sys.stderr, flush=True)


def step_bars(it, enabled: bool, start: int, total: int):
    if not enabled:
        return it
    from tqdm import tqdm

    return tqdm(it, desc="steps", initial=start, total=total, unit="step", dynamic_ncols=True)


class PhaseBars:
    """One progress bar per phase of the step, advanced op by op (a no-op without progress)."""

    def __init__(self, g, step: int, enabled: bool) -> None:
        self.bars = {}
        if enabled:
            from tqdm import tqdm

            for p in Phase:
                n = len({x for s in steps(g) if s.phase is p for x in s.ops})
                self.bars[p] = tqdm(
                    total=n, desc=f"  step {step} {p.title}", leave=False, unit="op", dynamic_ncols=True
                )

    def __enter__(self):
        return lambda o: self.bars[o.phase].update(1) if self.bars else None

    def __exit__(self, *exc) -> None:
        for b in self.bars.values():
            b.close()
