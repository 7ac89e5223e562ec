"""CUDA graphs of the decode step, one per batch size and number of prompts its rows span, sharing one memory pool.

On CUDA, `StepGraphs` warms each (rows, prompts) up (compiling the Triton kernels), captures it, largest first,
and replays it; a replay costs one launch instead of ~15 per layer. The prompt count fixes the decode attention's
grid and prompt chunk (`rollplex.kernels.decode_attention`); `batch.prompt_counts` says which counts a batch size
can meet. Elsewhere (CPU tests under the Triton interpreter) it calls the step directly. Capture writes nothing
that a rollout reads before overwriting it, and the step counter is rewound afterwards.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollplex.rollout.batch import prompt_counts
from rollplex.rollout.step import DecodeStep


class StepGraphs:
    def __init__(self, step: DecodeStep, sizes: tuple[int, ...]) -> None:
        self.step = step
        self.sizes = sizes
        self.prompt_counts = prompt_counts(sizes, step.shape.num_samples, step.shape.num_prompts)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        if step.logits.is_cuda:
            self._capture()

    def run(self, rows: int, prompts: int) -> Tensor:
        """Logits [rows, V] of one decode step over batch rows [0, rows) spanning `prompts` prompts (the first of
        the step's `batch_prompts`); rows must be a captured size and prompts one of its counts."""
        assert prompts in self.prompt_counts[rows], f"{rows} rows over {prompts} prompts: not a captured case"
        if not self.graphs:
            return self.step.forward(rows, prompts)
        self.graphs[rows, prompts].replay()
        return self.outputs[rows, prompts]

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows in reversed(self.sizes):
                for prompts in reversed(self.prompt_counts[rows]):
                    self.step.forward(rows, prompts)  # warm-up: triton compiles, cuBLAS picks its kernels
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[rows, prompts] = self.step.forward(rows, prompts)
                    self.graphs[rows, prompts] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.step.step.zero_()
