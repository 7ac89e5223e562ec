"""Runs the kill harness's spec and SIGKILLs itself at one point of one step: `python kill_driver.py OUT POINT STEP`.

Points are ops of the iteration (the handler's work done, before it returns) and the parts of a checkpoint as
they are written. The test (`test_kills.py`) resumes what is left and compares it with a run never killed.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch

from rollplex.executors import checkpointing, runtime
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.ir import NodeKind, Part, Role
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.memory.optimizer import ChunkedAdamW

SPEC = """
model: tiny
cluster: {hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 2, group_size: 2, prompt_tokens: 384, response_tokens: 4, visual_tokens: 8,
           dataset: "synthetic:clevrer@tiny"}
algorithm: {kl_coef: 0.1, lr: 1.0e-2, rewards: [{name: brevity}]}
run: {seed: 5, dtype: float32}
"""
OPS = {
    "rollout": (NodeKind.DECODE, Role.ROLLOUT, Part.WHOLE),
    "reward": (NodeKind.REWARD, None, Part.WHOLE),
    "ref_prefix": (NodeKind.FORWARD, Role.REFERENCE, Part.PREFIX),
    "actor_prefix": (NodeKind.FORWARD, Role.ACTOR, Part.PREFIX),
    "ref_suffix": (NodeKind.FORWARD, Role.REFERENCE, Part.SUFFIX),
    "backward": (NodeKind.BACKWARD, Role.ACTOR, Part.WHOLE),
}
CHECKPOINT_PARTS = ("checkpoint_weights", "checkpoint_optimizer", "checkpoint_rng", "checkpoint_state",
                    "checkpoint_rename")  # fmt: skip
POINTS = (*OPS, "update", *CHECKPOINT_PARTS)


def run(out: Path, steps: int, resume: bool = False) -> list[dict]:
    plan = compile_plan(parse_spec(SPEC))
    return train(plan, RunOptions(steps, out, resume=resume, checkpoint_every=1, progress=False, tensorboard=False))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm(point: str, step: int) -> None:
    """Kills the process at `point` of step `step` (its work done, before it returns)."""
    count = {"steps": 0}

    def at_step() -> bool:
        return count["steps"] == step

    real_iteration = runtime.run_iteration

    def iteration(*args, **kw):
        count["steps"] += 1
        return real_iteration(*args, **kw)

    runtime.run_iteration = iteration
    import rollplex.executors.loop as loop

    loop.run_iteration = iteration
    if point in OPS:  # in rollplex, decode and the prefixes beside it run as `_decode` and `PREFIX_JOBS`
        key = OPS[point]

        def killing(handler):
            def run_then_die(*args, **kw):
                handler(*args, **kw)
                if at_step():
                    die()

            return run_then_die

        def job_then_die(job):
            def run_job(*args, **kw):
                result = yield from job(*args, **kw)
                if at_step():
                    die()
                return result

            return run_job

        if point == "rollout":
            runtime._decode = killing(runtime._decode)
            return
        if key in runtime.PREFIX_JOBS:  # beside decode
            runtime.PREFIX_JOBS[key] = job_then_die(runtime.PREFIX_JOBS[key])
        if key in runtime.HANDLERS:  # alone (the actor's before decode, under `rollout_prefill: auto`)
            runtime.HANDLERS[key] = killing(runtime.HANDLERS[key])
        return
    if point == "update":
        real_step = ChunkedAdamW.step

        def step_then_die(self, *args, **kw):
            result = real_step(self, *args, **kw)
            if at_step():
                die()
            return result

        ChunkedAdamW.step = step_then_die
        return
    real_save, real_torch_save = checkpointing.save_checkpoint, torch.save
    real_write, real_replace = Path.write_text, Path.replace

    def save_checkpoint(*args, **kw):
        real_save(*args, **kw)
        if at_step() and point == "checkpoint_weights":
            die()

    def torch_save(obj, f, *args, **kw):
        real_torch_save(obj, f, *args, **kw)
        name = Path(f).name if isinstance(f, (str, Path)) else ""
        if at_step() and point == "checkpoint_optimizer" and name.startswith("part-"):
            die()
        if at_step() and point == "checkpoint_rng" and name == "rng.pt":
            die()

    def write_text(self, *args, **kw):
        result = real_write(self, *args, **kw)
        if at_step() and point == "checkpoint_state" and self.name == "state.json":
            die()
        return result

    def replace(self, target):
        if at_step() and point == "checkpoint_rename" and self.name.endswith(".tmp"):
            die()
        return real_replace(self, target)

    checkpointing.save_checkpoint, torch.save = save_checkpoint, torch_save
    Path.write_text, Path.replace = write_text, replace


if __name__ == "__main__":
    out, point, kill_step = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    arm(point, kill_step)
    run(out, steps=3)
    sys.exit(3)  # not killed: the point was never reached
