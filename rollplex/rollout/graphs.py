"""CUDA graphs of the decode step, one per batch size and attention chunk, sharing one memory pool.

On CUDA, `StepGraphs` warms each (rows, prompts) up (compiling the Triton kernels), captures it, largest first,
and replays it; a replay costs one launch instead of ~15 per layer. The prompt count fixes the decode attention's
grid and prompt chunk (`rollplex.kernels.decode_attention`): `batch.prompt_counts` says which counts a batch size
can meet, and counts that share a chunk share one graph (`DecodeAttentionShape.launch_count`). Elsewhere (CPU
tests under the Triton interpreter) it calls the step directly. Capture writes nothing that a rollout reads
before overwriting it; the step counter is rewound before each warm-up (a warm-up advances it, and a counter past
the response cache would write outside it) and after the last capture.
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
        self.launch_count = step.attention.shape.launch_count
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        if step.logits.is_cuda:
            self._capture()

    def run(self, rows: int, prompts: int) -> Tensor:
        """Logits [rows, V] of one decode step over batch rows [0, rows) spanning `prompts` prompts (the first of
        the step's `batch_prompts`); rows must be a captured size and prompts one of its counts."""
        assert prompts in self.prompt_counts[rows], f"{rows} rows over {prompts} prompts: not a captured case"
        launched = self.launch_count(prompts)
        if not self.graphs:
            return self.step.forward(rows, launched)
        self.graphs[rows, launched].replay()
        return self.outputs[rows, launched]

    @property
    def cases(self) -> tuple[tuple[int, int], ...]:
        """The (rows, launched prompt count) pairs captured, in capture order: largest first."""
        return tuple(
            (rows, prompts)
            for rows in reversed(self.sizes)
            for prompts in sorted({self.launch_count(n) for n in self.prompt_counts[rows]}, reverse=True)
        )

    def _capture(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for rows, prompts in self.cases:
                self.step.step.zero_()
                self.step.forward(rows, prompts)  # warm-up: triton compiles, cuBLAS picks its kernels
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[rows, prompts] = self.step.forward(rows, prompts)
                self.graphs[rows, prompts] = graph
        torch.cuda.current_stream().wait_stream(stream)
        self.step.step.zero_()
