"""What it costs to separate two dependent steps of decode-sized work on one GPU, three ways: a kernel boundary in
a CUDA graph (plain launches), a boundary between programmatic dependents (Hopper's PDL, as the fused decode
chain launches), and a grid-wide barrier inside one persistent kernel (each program arrives on a counter, then
waits until every program has).

    python bench/grid_sync.py --phases 8 72 --out bench/results/grid_sync_h100.json

A phase: program i reads the word that program (i + 1) % n wrote in the phase before (through L2, never L1) and
writes it plus one, so each phase needs another program's last write; after K phases every word is K (checked).
n is the GPU's SM count, one small program an SM, all resident at once (a grid barrier needs that). A way's cost a
phase is the slope of its graph's replay time between two phase counts, so the fixed costs of a replay cancel. A
decode step of the 3B is 36 layers of nine dependent kernels (`rollplex.rollout.step`): this is the part of each
boundary that no kernel's work hides. Off a GPU (the tests) the kernels run under Triton's interpreter with one
program (a barrier of one passes at once), times from the host clock.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import triton
import triton.language as tl
from decode import replay_seconds  # bench/: this folder

from rollplex.bench.provenance import source_commit
from rollplex.kernels.pdl import pdl_options


@triton.jit
def phase_kernel(buf, phase, n, USE_GDC: tl.constexpr):
    """One phase as its own launch: row phase + 1 of buf from row `phase`."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
    i = tl.program_id(0)
    value = tl.load(buf + phase * n + (i + 1) % n, cache_modifier=".cg")
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
    tl.store(buf + (phase + 1) * n + i, value + 1)


@triton.jit
def grid_barrier(counter, arrivals):
    """Waits until `arrivals` programs in all have arrived on `counter` (this one included): the program's stores,
    a CTA barrier, one release arrival, then acquire reads until the count is reached. Every program of the grid
    must be resident at once, or the first ones wait forever for the rest."""
    tl.debug_barrier()
    tl.atomic_add(counter, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < arrivals:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")


@triton.jit
def barrier_kernel(buf, counter, n, PHASES: tl.constexpr):
    """Every phase in one launch, a grid barrier after each (the counter counts every arrival of the launch)."""
    i = tl.program_id(0)
    for phase in range(PHASES):
        value = tl.load(buf + phase * n + (i + 1) % n, cache_modifier=".cg")
        tl.store(buf + (phase + 1) * n + i, value + 1)
        grid_barrier(counter, n * (phase + 1))


def calls(way: str, phases: int, buf: torch.Tensor, counter: torch.Tensor, n: int) -> list:
    """The launches of `phases` phases one way."""
    if way == "barrier":

        def persistent() -> None:
            counter.zero_()
            barrier_kernel[(n,)](buf, counter, n, PHASES=phases)

        return [persistent]
    options = pdl_options(way == "pdl", buf)
    return [lambda p=p: phase_kernel[(n,)](buf, p, n, **options) for p in range(phases)]


def measure(ways: list[str], phase_counts: tuple[int, int], replays: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    n = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 1
    fewer, more = phase_counts
    counter = torch.zeros(1, dtype=torch.int32, device=device)
    result = {"programs": n, "phases": list(phase_counts), "replays": replays, "ways": {}}
    for way in ways:
        seconds = {}
        for phases in phase_counts:
            buf = torch.zeros(phases + 1, n, dtype=torch.int32, device=device)
            seconds[phases] = replay_seconds(calls(way, phases, buf, counter, n), replays)
            if not torch.equal(buf[phases], torch.full_like(buf[phases], phases)):
                raise SystemExit(f"grid_sync: {way} left words other than {phases} after {phases} phases")
            if way == "barrier" and int(counter) != n * phases:
                raise SystemExit(f"grid_sync: {int(counter)} arrivals on the barrier, not {n} programs x {phases}")
        per_phase = (seconds[more] - seconds[fewer]) / (more - fewer)
        result["ways"][way] = {"seconds": {str(k): v for k, v in seconds.items()}, "us_per_phase": per_phase * 1e6}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--phases", nargs=2, type=int, default=[8, 72], metavar=("FEWER", "MORE"))
    ap.add_argument("--ways", nargs="+", default=["plain", "pdl", "barrier"], choices=["plain", "pdl", "barrier"])
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args()
    fewer, more = args.phases
    if not 1 <= fewer < more:
        sys.exit("grid_sync: --phases takes two counts, 1 <= FEWER < MORE")
    if "pdl" in args.ways and not torch.cuda.is_available():
        sys.exit("grid_sync: the pdl way needs a CUDA GPU (Hopper or newer); pass --ways plain barrier")
    result = measure(args.ways, (fewer, more), args.replays if torch.cuda.is_available() else 1)
    result.update(commit=source_commit(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    print(f"{result['programs']} programs, {fewer} and {more} phases")
    for way, row in result["ways"].items():
        print(f"{way:8s} {row['us_per_phase']:8.2f} us a phase")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
