"""Every Triton kernel of rollplex reads only globals that compiled Triton accepts. Triton's CPU interpreter (what
the kernel tests run on here) reads any global, the compiler only modules, jitted functions and
`tl.constexpr(...)` values: a plain `X = 1.0` read inside a kernel passes every CPU test and fails on the GPU."""

from __future__ import annotations

import builtins
import importlib
import pkgutil
import types

import triton.language as tl
from triton.runtime.jit import KernelInterface  # jitted, or interpreted under TRITON_INTERPRET

import rollplex.kernels


def kernels() -> list:
    found = []
    for info in pkgutil.iter_modules(rollplex.kernels.__path__):
        module = importlib.import_module(f"rollplex.kernels.{info.name}")
        own = [v for v in vars(module).values() if isinstance(v, KernelInterface)]
        found += [v for v in own if v.fn.__module__ == module.__name__]
    return found


def test_kernels_read_no_plain_globals():
    found = kernels()
    assert len(found) > 10  # the decode ops, GEMMs, attention, sampling, the LM head's scores
    plain = []
    for kernel in found:
        fn = kernel.fn
        for name in fn.__code__.co_names:
            if name not in fn.__globals__:
                continue  # an attribute name (tl.load, x.to), or a builtin
            value = fn.__globals__[name]
            fine = isinstance(value, types.ModuleType | KernelInterface | tl.constexpr | type)
            fine = fine or callable(value) or hasattr(builtins, name)
            if not fine:
                plain.append(f"{fn.__module__}.{fn.__name__} reads {name} = {value!r}")
    assert not plain, "; ".join(plain)
