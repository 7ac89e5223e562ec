"""`param_digest`'s fingerprint of one tensor in one launch (`rollplex.executors.metrics`).

The fingerprint of words w_0 .. w_{n-1} (a tensor's bytes read as 64-bit words) is, per mixer M, the sum over i of
w_i * (((i * M) ^ ((i * M) >> 29)) | 1), all modulo 2^64 (wrapping int64 arithmetic, arithmetic shift). Eager torch
spends about fifteen launches and a scratch tensor per 4M-word chunk on it; here each program reads its block of
words once, forms both weights from the positions in registers and adds its two partial sums into the output
with atomics. Integer sums modulo 2^64 do not depend on their order, so the result equals the eager one bit for
bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # words a program reads


@triton.jit
def fingerprint_kernel(words_ptr, out_ptr, n, M0: tl.constexpr, M1: tl.constexpr, BLOCK: tl.constexpr):
    """Adds block `program_id`'s two position-weighted sums of words [n] int64 into out [2] int64."""
    position = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = position < n
    words = tl.load(words_ptr + position, mask=mask, other=0)
    first = position * M0
    first = (first ^ (first >> 29)) | 1
    second = position * M1
    second = (second ^ (second >> 29)) | 1
    tl.atomic_add(out_ptr, tl.sum(words * first, axis=0))
    tl.atomic_add(out_ptr + 1, tl.sum(words * second, axis=0))


def fingerprint_words(words: torch.Tensor, mixers: tuple[int, int], out: torch.Tensor) -> torch.Tensor:
    """out [2] int64 (zeros) += the fingerprint of words [n] int64 (contiguous) under the two mixers; returns out."""
    assert words.dtype == out.dtype == torch.int64 and words.is_contiguous() and out.shape == (2,)
    n = words.numel()
    if n:
        fingerprint_kernel[(triton.cdiv(n, BLOCK),)](words, out, n, M0=mixers[0], M1=mixers[1], BLOCK=BLOCK)
    return out
