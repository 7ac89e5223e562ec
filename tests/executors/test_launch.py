"""When `rollplex run` starts a node's ranks itself, and the exit code of a rank that failed. The launch itself:
tests/executors/test_dp_run.py (two ranks train as one process; a spec error said once)."""

from __future__ import annotations

import signal

import pytest

from rollplex.errors import RunFailed
from rollplex.executors.launch import exit_code, launches_here


def test_one_node_of_several_gpus_launches_here_unless_a_launcher_started_this_process(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launches_here(1, 2) and launches_here(1, 8)
    assert not launches_here(1, 1)  # one process: this one
    assert not launches_here(2, 4)  # several nodes: torchrun on each
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's rank
    assert not launches_here(1, 2)


def test_a_ranks_own_exit_code_is_the_commands_and_a_signals_end_is_one_line_naming_the_rank():
    assert exit_code(1, 2, 0) == 0 and exit_code(0, 2, 2) == 2 and exit_code(1, 2, 130) == 130
    with pytest.raises(RunFailed, match="rank 1 of 4 was ended by SIGKILL") as e:
        exit_code(1, 4, -signal.SIGKILL)
    assert e.value.exit_code == 128 + signal.SIGKILL
    with pytest.raises(RunFailed, match=r"rank 0 of 2 was ended by SIGSEGV; the other ranks were stopped$"):
        exit_code(0, 2, -signal.SIGSEGV)
