"""SIGKILL at each point of a step and of a checkpoint's writing: `--resume` afterwards continues from the last
complete checkpoint with exactly the weights of a run never killed; a half-written checkpoint is never taken."""

import multiprocessing
import os
import signal
import sys
import traceback
from pathlib import Path

import pytest
import torch
from kill_driver import POINTS, arm, run

from rollplex.executors import checkpointing

KILL_STEP = 2  # step 1's checkpoint is complete; step 2 is killed


@pytest.fixture
def one_thread():
    """The killed runs compute on one thread each; so do the runs they are compared with (a sum's order, and so
    its rounding, depends on the thread count)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _killed_run(out: Path, point: str) -> None:
    """`kill_driver.py OUT POINT KILL_STEP` in a process forked from this one (torch already imported: 11 fresh
    interpreters spend ~25 s importing on 2 cores); its stderr goes to OUT.stderr."""
    os.dup2(os.open(f"{out}.stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115 (Python's writes too, wherever pytest put them)
    try:
        arm(point, KILL_STEP)
        run(out, steps=3)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    os._exit(3)  # not killed: the point was never reached


@pytest.mark.slow
def test_a_run_killed_anywhere_resumes_to_the_weights_of_a_run_never_killed(tmp_path, one_thread):
    whole = [r["param_digest"] for r in run(tmp_path / "whole", steps=3)]
    fork = multiprocessing.get_context("fork")
    procs = {point: fork.Process(target=_killed_run, args=(tmp_path / point, point)) for point in POINTS}
    assert len(procs) >= 10
    for proc in procs.values():
        proc.start()
    for point, proc in procs.items():
        proc.join(timeout=300)
        if proc.exitcode is None:  # hung: fail, leaving no process behind
            proc.kill()
        err = Path(f"{tmp_path / point}.stderr").read_text()
        assert proc.exitcode == -signal.SIGKILL, f"{point}: {err[-2000:]}"
    for point in POINTS:
        out = tmp_path / point
        assert checkpointing.latest(out) == checkpointing.checkpoint_dir(out, KILL_STEP - 1), point
        resumed = run(out, steps=3, resume=True)
        assert [r["step"] for r in resumed] == [2, 3], point
        assert [r["param_digest"] for r in resumed] == whole[1:], point
