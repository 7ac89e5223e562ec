"""Compiles made inside a step: a warm step that compiles waits on the host for it, in the middle of a phase.

Two counts, each since the process began: the variants of rollplex's Triton kernels compiled so far (Triton compiles a
variant per device for each new kind of argument: a dtype, a constexpr, an integer equal to 1 or divisible by 16
unless the kernel declares it `do_not_specialize`), and the graphs torch.compile has made (Inductor's regions, a
FlexAttention call; a guard that fails compiles another). `rollplex run` keeps their difference over each step in
its metrics (`compiles`, with the name of each Triton kernel that compiled a variant) and names it in the step's
progress line from the process's second step on, where none is expected.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass

KERNEL_MODULES = "rollplex.kernels."  # the modules whose jitted kernels are counted (those imported)


@dataclass(frozen=True)
class Compiles:
    """Triton kernel variants and torch.compile graphs compiled; `kernels` names the kernel of each variant (sorted,
    a kernel once per variant: `triton` is its length)."""

    triton: int = 0
    torch: int = 0
    kernels: tuple[str, ...] = ()

    def since(self, before: Compiles) -> Compiles:
        kernels = tuple(sorted((Counter(self.kernels) - Counter(before.kernels)).elements()))
        return Compiles(len(kernels), self.torch - before.torch, kernels)

    @property
    def total(self) -> int:
        return self.triton + self.torch


def compiled_so_far() -> Compiles:
    """The process's counts so far: the variants cached in each jitted kernel of the imported `rollplex.kernels`
    modules (none under Triton's interpreter, which compiles nothing), and torch.compile's graphs."""
    kernels = tuple(sorted(_name(k) for k in _kernels() for _ in range(variants(k))))
    return Compiles(triton=len(kernels), torch=_graphs(), kernels=kernels)


def _name(kernel) -> str:
    return getattr(kernel, "__name__", None) or kernel.fn.__name__


def _graphs() -> int:
    if "torch._dynamo.utils" not in sys.modules:  # torch.compile never ran: nothing compiled, nothing to import
        return 0
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _kernels() -> list:
    if "triton" not in sys.modules:  # no kernel was imported: nothing compiled
        return []
    from triton.runtime.jit import KernelInterface

    modules = [m for name, m in list(sys.modules.items()) if name.startswith(KERNEL_MODULES) and m is not None]
    found = {id(v): v for m in modules for v in vars(m).values() if isinstance(v, KernelInterface)}
    return list(found.values())  # once each: a module may import another's kernel


def variants(kernel) -> int:
    """Compiled variants of one jitted kernel over every device: the first of each device's caches holds them (none
    when interpreted)."""
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(cache[0]) for cache in caches.values())
