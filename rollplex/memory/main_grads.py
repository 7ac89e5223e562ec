"""FP32 main gradients (Megatron's): a post-accumulate-grad hook adds each parameter's fresh low-precision `.grad`
into an FP32 buffer and frees it, so microbatches sum in FP32 and at most one low-precision gradient per parameter
is alive at a time. The buffers exist from the first backward to `zero`. `ChunkedAdamW(fp32_grads=True)` reads them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch


class MainGrads:
    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.params = list(params)
        self.buffers: list[torch.Tensor | None] = [None] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        fold = _weak_fold(self)
        self._hooks = [p.register_post_accumulate_grad_hook(fold) for p in self.params]

    def grad_of(self, i: int) -> torch.Tensor | None:
        """Parameter i's FP32 gradient; a `.grad` set by hand (not by a backward) is folded in first."""
        if self.params[i].grad is not None:
            self.fold(self.params[i])
        return self.buffers[i]

    def zero(self, set_to_none: bool = True) -> None:
        for i, buffer in enumerate(self.buffers):
            if buffer is not None:
                self.buffers[i] = None if set_to_none else buffer.zero_()

    @torch.no_grad()
    def fold(self, p: torch.Tensor) -> None:
        """A parameter's grad is complete: into its FP32 buffer, and the low-precision grad freed."""
        i = self._index[id(p)]
        if self.buffers[i] is None:
            self.buffers[i] = p.grad.to(torch.float32, copy=True)
        else:
            self.buffers[i].add_(p.grad)
        p.grad = None


def _weak_fold(grads: MainGrads) -> Callable[[torch.Tensor], None]:
    """The hook, holding the buffers' owner weakly. A bound method would tie it (and, through the optimizer that
    holds it, a pinned host pool) to the parameters through torch's C++ hook storage, a cycle the garbage collector
    cannot see: a bench's serial engines then outlived it and the next schedule's pool OOM-killed the host."""
    ref = weakref.ref(grads)

    def fold(p: torch.Tensor) -> None:
        if (alive := ref()) is not None:
            alive.fold(p)

    return fold
