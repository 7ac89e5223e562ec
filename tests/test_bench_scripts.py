"""The GPU measurement scripts under bench/ run end to end on the tiny spec (on the CPU: times only)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("schedule, grouping", [("serial", ["--prompts-per-chunk", "all"]), ("rollplex", [])])
def test_profile_step_times_every_op_of_either_schedule(schedule, grouping):
    command = [sys.executable, str(ROOT / "bench/profile_step.py"), str(ROOT / "specs/tiny_cpu.yaml"),
               "--schedule", schedule, "--kernels", "ref_score.suffix", "--top", "3", *grouping]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    timed = {line.split()[0] for line in out.stdout.splitlines() if line[:1].isalpha() and len(line.split()) == 5}
    # under rollplex the prefixes run beside decode: their befores all come before their afters
    assert {"rollout", "ref_score.prefix", "actor_score.prefix", "ref_score.suffix", "actor_backward"} <= timed
    assert "ref_score.suffix: " in out.stdout and "kernels" in out.stdout
