"""Test kit of the executors tests: the tiny spec `rollplex run` trains, and ways to run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from rollplex.data.rewards import REWARDS
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def char_share(text: str, example) -> float:
    """A reward that differs between random responses, so advantages (and gradients) are not zero."""
    return sum(c in "aeiou0123456789" for c in text) / max(len(text), 1)


REWARDS.setdefault("test_char_share", char_share)

SPEC = """
model: tiny
cluster: {{hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 2, group_size: 3, prompt_tokens: 384, response_tokens: 6, visual_tokens: 18,
            dataset: "synthetic:clevrer@tiny"}}
algorithm: {{kl_coef: {kl}, lr: 1.0e-2, rewards: [{{name: test_char_share}}]}}
run: {{seed: 3, dtype: float32, device: {device}}}
"""


def loaded(kl: float = 0.1, device: str = "cpu"):
    """The tests' spec; on the CPU unless asked, so that a GPU machine runs the same checks (with deterministic
    kernels: the memory-efficient attention backward is otherwise not bitwise repeatable)."""
    text = SPEC.format(kl=kl, device=device)
    return parse_spec(text.replace("device: cuda}", "device: cuda, deterministic: true}"))


def run(tmp_path: Path, schedule: str, steps: int = 2, name: str | None = None, device: str = "cpu", **kw):
    opts = RunOptions(steps, Schedule(schedule), tmp_path / (name or schedule), progress=False, tensorboard=False, **kw)
    return train(loaded(device=device), opts)


def cli(*args: str) -> subprocess.CompletedProcess:
    """`rollplex run specs/tiny_cpu.yaml ARGS` in a fresh interpreter."""
    command = [sys.executable, "-m", "rollplex.cli", "run", str(ROOT / "specs/tiny_cpu.yaml"), *args]
    return subprocess.run(command, capture_output=True, text=True)
