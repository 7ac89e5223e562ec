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
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, Tensor] = {}
        if step.logits.is_cuda:
            self._capture()

    def run(self, rows: int) -> Tensor:
        """Logits [rows, V] of one decode step over batch rows [0, rows); rows must be a captured size."""
        if not self.graphs:
            return self.step.forward(rows)
        self.graphs[rows].replay()
        return self.outputs[rows]

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows in reversed(self.sizes):
                self.step.forward(rows)  # warm-up: triton compiles, cuBLAS picks its kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[rows] = self.step.forward(rows)
                self.graphs[rows] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.step.step.zero_()
