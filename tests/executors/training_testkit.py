"""One iteration of the tests' spec with the optimizer's step replaced by a recorder of the gradients it would
read, and a reference that differs from the actor (so that the KL term carries information)."""

from __future__ import annotations

import torch
from run_testkit import loaded

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import Engines, build_engines
from rollplex.executors.record import StepRecord
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan


class GradRecorder:
    """Stands in for the optimizer's step: keeps the (FP32) gradients it would read instead of stepping."""

    def __init__(self, model, optimizer):
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.optimizer, self.grads = optimizer, {}
        self.history: list[dict[str, torch.Tensor]] = []  # each step's, in order (they accumulate: no zero_grad)

    def step(self):
        params = self.optimizer.params
        grads = {self.names[id(p)]: self.optimizer.grad_of(i) for i, p in enumerate(params)}
        self.grads = {n: g.clone() for n, g in grads.items() if g is not None}
        self.history.append(self.grads)
        return torch.tensor(0.0)

    def zero_grad(self):
        pass


def perturb_reference(engines: Engines, scale: float = 0.01) -> None:
    with torch.no_grad():
        for p in engines.reference.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))


def recorded_iteration(schedule: Schedule, text: str | None = None) -> tuple[Engines, StepRecord, list]:
    """Engines (reference perturbed, optimizer recording), the step's record and its examples, of the tests' spec
    or of the spec `text`."""
    spec = loaded() if text is None else parse_spec(text)
    plan = compile_plan(spec, schedule)
    engines = build_engines(plan)
    perturb_reference(engines)
    engines.optimizer = GradRecorder(engines.actor, engines.optimizer)
    examples = batch_at(
        open_dataset(spec.spec.workload.dataset, engines.tokenizer, 3), 0, spec.spec.workload.prompts_per_step
    )
    record = run_iteration(plan.graph, engines, examples)
    return engines, record, examples


def gradients(schedule: Schedule) -> dict[str, torch.Tensor]:
    engines, _, _ = recorded_iteration(schedule)
    return engines.optimizer.grads
