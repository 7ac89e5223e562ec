"""Programmatic dependent launch (Hopper): a kernel launched so may start while the kernel before it drains, and
waits (`gdc_wait`) for that kernel to finish, its writes visible, before it reads what the chain writes.

- `pdl_options`: the launch keywords, so that a kernel never launches early without waiting.
- `enter` / `leave`: where a kernel lets the next one launch (`gdc_launch_dependents`). By default once its own
  work is issued (`leave`; our GEMMs right after they wait). With `ahead`, before it waits: the next launch becomes
  resident while this one still waits or runs, and so on down the chain, so that each of our GEMMs pulls more of
  its weights into L2 (`prefetch_l2`, `prefetch_k`) while the kernels before it run, instead of starting its
  weight stream from HBM only once they are done. Launching early changes no number (every kernel still waits for
  the one before it to finish), and it cannot starve the kernel before: a launch happens only once every program
  of that kernel has started.

Before it waits a dependent reads only what no kernel of the chain writes: the weights, and the step's tables
and state (positions, slots, the step counter, the prompts' lengths, KV and row map), which the ops before the
chain set; the chain's first kernel launches only once the op before it has finished. What it needs first it
reads or pulls into L2 there (a norm's weight, rotary's cos and sin, the attention's row map, a GEMM's first
weight blocks), so that the wait and the kernel before it hide those loads' latency.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PREFETCH_BYTES = 16 << 20  # of an H200's 50 MiB L2: what one GEMM's programs pull in before they wait
LINE_BYTES = 128  # an L2 line


def pdl_options(pdl: bool, x: torch.Tensor, ahead: bool = False) -> dict:
    """The launch keywords of a kernel with a USE_GDC constexpr (and an AHEAD one where `ahead` may be set),
    launched as a programmatic dependent (`pdl`) or not. The CPU interpreter knows no launch_pdl, so it is absent
    when off."""
    assert not pdl or x.is_cuda, "pdl: programmatic dependent launch needs a CUDA GPU (Hopper or newer)"
    assert pdl or not ahead, "ahead: the next launch goes ahead only of a kernel launched with pdl"
    if not pdl:
        return {"USE_GDC": False}
    return {"USE_GDC": True, "launch_pdl": True, **({"AHEAD": True} if ahead else {})}


@triton.jit
def enter(USE_GDC: tl.constexpr, AHEAD: tl.constexpr):
    """A kernel's first step: with AHEAD the next launch may go, then wait for the kernel before."""
    if USE_GDC:
        if AHEAD:
            tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def leave(USE_GDC: tl.constexpr, AHEAD: tl.constexpr):
    """The next launch may go, unless `enter` let it already."""
    if USE_GDC and not AHEAD:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_l2(lines):
    """Pulls the L2 lines at the pointers `lines` into L2, kept ahead of streamed data (evict-last); reads
    nothing into the program and writes nothing."""
    tl.inline_asm_elementwise(
        "prefetch.global.L2::evict_last [$1]; // $0", "=r,l", [lines], dtype=tl.int32, is_pure=False, pack=1
    )


def prefetch_k(num_programs: int, rows_per_program: int, k_per_program: int, element_size: int) -> int:
    """Elements of each weight row a GEMM program pulls into L2 before it waits: a power of two of whole lines,
    at most its part of K, all programs together at most PREFETCH_BYTES; 0 where not a line each fits."""
    budget = PREFETCH_BYTES // (num_programs * rows_per_program * element_size)
    most = min(budget, k_per_program)
    line = LINE_BYTES // element_size
    return 0 if most < line else 1 << (most.bit_length() - 1)


def line_elements(x: torch.Tensor) -> int:
    """Elements of x's dtype in one L2 line."""
    return LINE_BYTES // x.element_size()
