"""Building blocks shared by the vision encoder and the language decoder: RMSNorm and the gated (SwiGLU) MLP,
and `gpu_compiled`, which fuses their elementwise chains (and rotary's) on a GPU.

Not here: attention (`attention.py`, `decoder.py`, `vision.py`) and rotary embeddings (`rotary.py`).
"""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from functools import wraps
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.models.packing import packed_linear

Fn = TypeVar("Fn", bound=Callable[..., Tensor | tuple[Tensor, ...]])
RECOMPILE_LIMIT = 64  # compiled variants per function (input ranks, widths, grad modes), beyond which torch runs eager


def gpu_compiled(fn: Fn, *, unbacked: bool = False) -> Fn:
    """`fn`, an elementwise chain on tensors, compiled by Inductor (fused kernels in forward and backward, for any
    lengths) when its first argument is on a GPU, run as it is elsewhere (`.eager`). Unfused, a norm, a rotary or
    a gated activation is several kernels each reading and writing the whole activation; with many of them per
    layer, the training half spends more time in them than in its matmuls. Without grad mode its inputs go in
    detached, so that whether they require grad makes no variant of its own.

    Shapes are torch's automatic dynamic ones: a dimension turns symbolic once it has changed (token counts,
    batch rows), the others (heads, head and hidden widths) stay the constants they are. Packed rows first (the
    vision tower's [S, ...] inputs, `_declare_rows`) are symbolic from the first call: a step's patches arrive in one
    call, so they would change only at the next step and compile the chain again there. Compiled with every
    dimension symbolic, the kernels index through divisions by unknown widths and run slower
    (`bench/prefix_ops.py`: the decoder's norm 1.6x, its q and k rotary 12x). Torch keeps which dimensions
    changed per function, and a call with inputs of another rank turns all of them symbolic; so each layout of
    the inputs (their ranks and last widths: the vision tower's [S, 1280] beside the decoder's [B, T, 2048])
    compiles its own copy of `fn` (`_copy`).

    A chain whose backward sums over a changing dimension (a norm's weight gradient, summed over tokens) takes
    `unbacked`: its changing dimensions turn unbacked symbols rather than backed ones. Inductor picks such a
    sum's strategy by its length's range and guards on that range, so every batch length in a range not seen
    before would compile the chain again, forward and backward (seconds, in the middle of a step, for as long as
    new ranges turn up); an unbacked length admits no guard, and one compile serves every length."""
    return layout_compiled(fn, "inductor", lambda x: x.is_cuda, unbacked=unbacked)


def layout_compiled(
    fn: Fn, backend: str | Callable, applies: Callable[[Tensor], bool], *, unbacked: bool = False
) -> Fn:
    """`gpu_compiled` with torch.compile's `backend`, compiled where `applies(first argument)`."""
    compiled: dict[tuple, Callable[..., Tensor]] = {}
    unbacked_lengths = []  # the config patch, made once (a patch made per call costs its call as much again)

    @wraps(fn)
    def run(*args):
        if torch.compiler.is_compiling() or not applies(args[0]):  # inside a compiled region: part of its graph
            return fn(*args)
        layout = tuple((a.dim(), a.shape[-1] if a.dim() else 0) for a in args if isinstance(a, Tensor))
        if layout not in compiled:
            from torch import _dynamo

            _dynamo.config.recompile_limit = max(_dynamo.config.recompile_limit, RECOMPILE_LIMIT)
            compiled[layout] = torch.compile(_copy(fn, len(compiled)), backend=backend)
        if not torch.is_grad_enabled():
            args = tuple(a.detach() if isinstance(a, Tensor) else a for a in args)
        args = _declare_rows(args, unbacked)
        if not unbacked:
            return compiled[layout](*args)
        if not unbacked_lengths:
            from torch import _dynamo

            unbacked_lengths.append(_dynamo.config.patch(automatic_dynamic_shapes_mark_as="unbacked"))
        with unbacked_lengths[0]:  # read when a call compiles
            return compiled[layout](*args)

    run.eager = fn
    return run  # type: ignore[return-value]


def _declare_rows(args: tuple, unbacked: bool) -> tuple:
    """`args` where every tensor argument of rank >= 2 (parameters aside) has the same first dimension, above 1: a
    count of packed rows (or of padded batch rows), declared dynamic (unbacked under `unbacked`), so the call
    compiles with it symbolic rather than static first and again at the next count. Marked on aliases, so that no
    mark stays on the caller's tensors."""
    rows = [i for i, a in enumerate(args) if isinstance(a, Tensor) and a.dim() >= 2 and not isinstance(a, nn.Parameter)]
    counts = {args[i].shape[0] for i in rows}
    if len(counts) != 1 or counts.pop() < 2:
        return args
    from torch._dynamo import decorators

    mark = decorators.mark_unbacked if unbacked else decorators.maybe_mark_dynamic
    declared = list(args)
    for i in rows:
        declared[i] = args[i].view_as(args[i])
        mark(declared[i], 0)
    return tuple(declared)


def _copy(fn: Callable, index: int) -> Callable:
    """`fn` with a code object of its own, named `fn_<index>`: torch keys compiled variants and the dimensions it
    has seen change by a function's code and name, so each copy keeps its own."""
    name = f"{fn.__name__}_{index}"
    code = fn.__code__.replace(co_name=name, co_qualname=f"{fn.__qualname__}_{index}")
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x * rsqrt(mean(x^2) + eps) in float32 over the last dimension, cast back to x's dtype, then times
    `weight` in that dtype (as HF does). On a GPU rollplex's kernels (`kernels.rms_norm`: each tensor read once
    forward and once backward, where Inductor's kernels for the chain read x and dy twice); inside a compiled
    region, and off a GPU, the chain below (`torch_rms_norm`)."""
    if x.is_cuda and not torch.compiler.is_compiling():
        from rollplex.kernels.rms_norm import rms_norm as fused  # Triton: imported on a GPU only

        return fused(x, weight, eps)
    return torch_rms_norm(x, weight, eps)


def torch_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


@gpu_compiled
def packed_silu_mul(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of one [gate; up] projection's output [..., 2 I] (`packing.packed_linear`): its backward
    writes the whole output's gradient in one kernel."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 and returned in the input's dtype (as HF does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); the vision blocks use biases, the decoder does not."""

    def __init__(self, dim: int, hidden: int, *, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(packed_silu_mul(packed_linear(x, (self.gate_proj, self.up_proj))))


def compile_halves(units: Iterable[nn.Module]) -> None:
    """Each unit's two halves around its attention (`before_attention(x, cos, sin)` -> q, k, v and
    `after_attention(x, out)`: a decoder layer's norm, QKV projections and rotary, then its o_proj, residuals, norm
    and MLP; a vision block's likewise) each run as one region compiled by Inductor on a GPU (`gpu_compiled`: the
    token counts unbacked, so one compile serves every unit, per grad mode, layout and model whose parameters
    differ in `requires_grad`, and most lengths; the chains inside trace into the region). Their elementwise work fuses
    with the GEMMs' neighbours and autograd sees one node a half; the attention stays outside with its own kernels.
    Elsewhere the halves run as they are. Patched per instance as bound methods (a deep copy rebinds them to its
    own units); recompute (`memory.offload.recompute_methods`) wraps them as it wraps the plain ones."""
    for unit in units:
        unit.before_attention = types.MethodType(_compiled_before, unit)
        unit.after_attention = types.MethodType(_compiled_after, unit)


def _before(x: Tensor, cos: Tensor, sin: Tensor, unit: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
    return type(unit).before_attention(unit, x, cos, sin)


def _after(x: Tensor, out: Tensor, unit: nn.Module) -> Tensor:
    return type(unit).after_attention(unit, x, out)


_before_region, _after_region = gpu_compiled(_before, unbacked=True), gpu_compiled(_after, unbacked=True)


def _compiled_before(unit: nn.Module, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return _before_region(x, cos, sin, unit)


def _compiled_after(unit: nn.Module, x: Tensor, out: Tensor) -> Tensor:
    return _after_region(x, out, unit)
