"""CUDA graphs of the decode step, one per batch size, sharing one memory pool.

On CUDA, `StepGraphs` warms each size up (compiling the Triton kernels), captures it, largest first, and
replays it; a replay costs one launch instead of ~15 per layer. Elsewhere (CPU tests under the Triton
interpreter) it calls the step directly. Capture writes nothing that a rollout reads before overwriting it,
and the step counter is rewound afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollplex.rollout.step import DecodeStep


class StepGraphs:
    def __init__(self, step: DecodeStep, sizes: tuple[int, ...]) -> None:
        self.step = step
        self.sizes = sizes
        self.variants = (False, True) if step.beside_weights is not None else (False,)  # `beside` of each
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], Tensor] = {}
        if step.logits.is_cuda:
            self._capture()

    def run(self, rows: int, beside: bool = False) -> Tensor:
        """Logits [rows, V] of one decode step over batch rows [0, rows); rows must be a captured size. beside:
        the step's beside kernels (`DecodeStep`), where it has them."""
        beside = beside and self.step.beside_weights is not None
        if not self.graphs:
            return self.step.forward(rows, beside)
        self.graphs[rows, beside].replay()
        return self.outputs[rows, beside]

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows in reversed(self.sizes):
                for beside in self.variants:
                    self.step.forward(rows, beside)  # warm-up: triton compiles, cuBLAS picks its kernels
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[rows, beside] = self.step.forward(rows, beside)
                    self.graphs[rows, beside] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.step.step.zero_()
