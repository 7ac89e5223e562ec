"""SIGKILL at each point of a step and of a checkpoint's writing: `--resume` afterwards continues from the last
complete checkpoint with exactly the weights of a run never killed; a half-written checkpoint is never taken."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kill_driver import POINTS, run

from rollplex.executors import checkpointing

DRIVER = Path(__file__).with_name("kill_driver.py")
KILL_STEP = 2  # step 1's checkpoint is complete; step 2 is killed


@pytest.fixture
def one_thread():
    """The killed runs compute on one thread each; so do the runs they are compared with (a sum's order, and so
    its rounding, depends on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_a_run_killed_anywhere_resumes_to_the_weights_of_a_run_never_killed(tmp_path, one_thread):
    whole = [r["param_digest"] for r in run(tmp_path / "whole", steps=3)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(DRIVER.parent), *sys.path])}
    procs = {
        point: subprocess.Popen(
            [sys.executable, str(DRIVER), str(tmp_path / point), point, str(KILL_STEP)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for point in POINTS
    }
    assert len(procs) >= 10
    for point, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == -signal.SIGKILL, f"{point}: {err.decode()[-2000:]}"
    for point in POINTS:
        out = tmp_path / point
        assert checkpointing.latest(out) == checkpointing.checkpoint_dir(out, KILL_STEP - 1), point
        resumed = run(out, steps=3, resume=True)
        assert [r["step"] for r in resumed] == [2, 3], point
        assert [r["param_digest"] for r in resumed] == whole[1:], point
