"""What `rollplex run` checks before it builds a model: each problem a spec or the run's options can hold that
would otherwise surface only after minutes of building (a 7B's weights and pinned optimizer state), as one line.

- `--resume`: a complete checkpoint to resume, undamaged since it was written (`checkpointing.damage`), steps left
  after it, and the spec's `checkpointing.identity` as the
  run that wrote it had it (model, first weights, data, seed, dtype, algorithm); without `--resume`, no earlier run's
  checkpoints in the run directory (they would win a later --resume over this run's) and no earlier metrics (a
  run without checkpoints would write over them)
- `run.device: auto` on a machine without a GPU: the plan must fit this machine's memory (a GPU spec would
  otherwise build its models on the CPU until the host runs out)
- `run.init: checkpoint`: the weights' files exist
- `workload.dataset`, `evaluation.dataset`: a file path exists
- `algorithm.rewards`: each `module:function` imports (a registered name was checked when the spec was read)
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rollplex.errors import SpecError
from rollplex.executors import checkpointing
from rollplex.graph.plan import Plan
from rollplex.graph.spec_files import missing_files

GIB = 2**30


def preflight(plan: Plan, out_dir: Path, steps: int, resume: bool) -> None:
    _checkpoints(out_dir, steps, resume)
    if resume and (differs := checkpointing.identity_mismatch(checkpointing.latest(out_dir), plan.loaded)):
        raise SpecError("", f"--resume: {checkpointing.latest(out_dir)} was written with {differs}",
                        "resume with the spec that wrote it, or start a new run with another --out")  # fmt: skip
    check_spec(plan)


def check_spec(plan: Plan) -> None:
    """The spec's checks of the module's docstring (all but the run directory's), as `rollplex bench` makes them."""
    for key, problem in _spec_problems(plan):
        raise plan.loaded.locate(SpecError(key, problem))


def _checkpoints(out_dir: Path, steps: int, resume: bool) -> None:
    found = checkpointing.latest(out_dir)
    if not resume and found is not None:
        raise SpecError("", f"{out_dir} holds an earlier run's checkpoints ({found.name})",
                        "continue it with --resume, or give this run another --out")  # fmt: skip
    metrics = out_dir / "metrics.jsonl"
    if not resume and metrics.is_file() and metrics.stat().st_size > 0:  # a run that ended before its first line: none
        raise SpecError("", f"{out_dir} holds an earlier run's metrics.jsonl", "give this run another --out, or "
                        "remove that run's directory")  # fmt: skip
    if resume and found is None:
        ran = metrics.is_file() and metrics.stat().st_size > 0  # a run that saved none: nothing of it to go on from
        raise SpecError("", f"--resume: no complete checkpoint in {out_dir / 'checkpoints'}",
                        f"start again with another --out, or remove {out_dir}" if ran
                        else "run once without --resume first")  # fmt: skip
    if resume and checkpointing.step_of(found) >= steps:
        raise SpecError("", f"--resume: {found} is step {checkpointing.step_of(found)}, and the run has {steps} steps",
                        f"raise --steps above {checkpointing.step_of(found)} to train on")  # fmt: skip
    if resume and (why := checkpointing.damage(found)):
        earlier = [p for p in checkpointing.complete(out_dir) if p != found]
        hint = f"move it aside to resume from {max(earlier, key=checkpointing.step_of).name}" if earlier else None
        raise SpecError("", f"--resume: {found} is damaged ({why})", hint or "start again with another --out")


def _spec_problems(plan: Plan):
    """(key, problem) for each check of the module's docstring that fails, in its order."""
    from rollplex.data.rewards import load_reward

    loaded = plan.loaded
    spec = loaded.spec
    if spec.run.device == "auto" and not torch.cuda.is_available():
        r, per_node = plan.residency, spec.cluster.gpus_per_node  # on the CPU the host pool shares the same memory
        need = per_node * r.peak_bytes + r.host.needed_bytes_per_node
        have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if need > have:
            yield (
                "run.device",
                (
                    f"auto found no GPU, and the plan needs {need / GIB:.1f} GiB a node (its devices' peaks and host "
                    f"pool), more than this machine's {have / GIB:.1f} GiB; run it on a GPU, or set run.device: cpu to "
                    "try the CPU anyway"
                ),
            )
    yield from missing_files(loaded)
    for reward in spec.algorithm.rewards:
        if ":" in reward.name:
            try:
                load_reward(reward.name)
            except ValueError as e:
                yield "algorithm.rewards", str(e)
            except Exception as e:  # the module's own code failed as it was imported
                yield "algorithm.rewards", f"reward '{reward.name}': importing it raised {type(e).__name__}: {e}"
