"""The compile counts `rollplex run` keeps per step: torch.compile's graphs counted as they are made (a real compile
on the CPU, torch's eager backend), and Triton's variants read from each jitted kernel's caches."""

from __future__ import annotations

import sys
import types

import torch

from rollplex.executors import compiles
from rollplex.executors.compiles import Compiles, compiled_so_far


def test_a_new_shape_that_compiles_again_counts_and_a_cached_one_does_not():
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    fn(torch.ones(3))
    before = compiled_so_far()
    fn(torch.ones(3))
    assert compiled_so_far().since(before) == Compiles()
    fn(torch.ones(5))  # static shapes: another graph
    assert compiled_so_far().since(before) == Compiles(triton=0, torch=1)


def test_each_jitted_kernel_of_rollplexs_kernel_modules_counts_its_variants_once(monkeypatch):
    from triton.runtime.jit import JITFunction

    def kernel_fn(x_ptr, n):
        pass

    kernel = JITFunction(kernel_fn)
    kernel.device_caches.update({0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"a": 1}, {}, None, None, None)})
    module = types.ModuleType("rollplex.kernels.fake")
    module.kernel = kernel
    other = types.ModuleType("rollplex.kernels.other")
    other.kernel = kernel  # imported by another kernel module: counted once
    elsewhere = types.ModuleType("elsewhere")
    elsewhere.kernel = JITFunction(kernel_fn)
    elsewhere.kernel.device_caches[0] = ({"a": 1}, {}, None, None, None)
    for m in (module, other, elsewhere):
        monkeypatch.setitem(sys.modules, m.__name__, m)
    assert kernel in compiles._kernels() and elsewhere.kernel not in compiles._kernels()
    assert compiles.variants(kernel) == 3 and compiled_so_far().triton >= 3
    assert compiled_so_far().kernels.count("kernel_fn") == 3  # the fake module's kernel's, not elsewhere's


def test_a_difference_names_the_kernel_of_each_new_variant():
    before = Compiles(3, 1, ("_gemm", "_norm", "_norm"))
    after = Compiles(6, 1, ("_gemm", "_merge", "_norm", "_norm", "_norm", "_norm"))
    assert after.since(before) == Compiles(3, 0, ("_merge", "_norm", "_norm"))
    assert after.since(after) == Compiles()
