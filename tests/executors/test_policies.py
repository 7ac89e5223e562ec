"""`mps_session`: under the mps policy the CLI starts a private MPS daemon and makes this process its client
before CUDA starts, and puts everything back afterwards (a fake control program stands in for NVIDIA's)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from rollplex.errors import SpecError
from rollplex.executors.policies import decode_kernels_for, mps_session
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan

SPEC = """
model: tiny
cluster: {{hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 2, group_size: 2, prompt_tokens: 384, response_tokens: 4, visual_tokens: 18}}
sharing: {{policy: {policy}, mps_trainer_percent: {percent}}}
run: {{device: {device}}}
"""
FAKE = """#!/bin/sh
echo "$* $CUDA_MPS_PIPE_DIRECTORY" >> {record}
if [ "$1" = "-d" ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; else read line; echo "$line" >> {record}; {stop}; fi
"""


def fake_control(directory: Path, stop: str = "true") -> Path:
    (directory / "nvidia-cuda-mps-control").write_text(FAKE.format(record=directory / "calls.txt", stop=stop))
    (directory / "nvidia-cuda-mps-control").chmod(0o755)
    return directory / "calls.txt"


def spec(policy: str = "mps", percent: str = "50", device: str = "auto"):
    """The compiled plan of a spec with this policy (what `mps_session` reads)."""
    return compile_plan(parse_spec(SPEC.format(policy=policy, percent=percent, device=device)))


def test_the_process_is_a_client_inside_the_session_and_the_daemon_quits_after_it_exits(tmp_path, monkeypatch):
    record = fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    before = dict(os.environ)
    with mps_session([spec()]):
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.environ["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "50" and Path(pipe, "control").exists()
    assert dict(os.environ) == before
    # `quit` waits for the clients, this process among them: a watcher sends it once this process has exited
    assert record.read_text().splitlines() == [f"-d {pipe}"] and Path(pipe).exists()


def _sit_in_a_session(path: str, inside: Path) -> None:
    os.environ["PATH"] = path
    with mps_session([spec()]):
        inside.touch()
        time.sleep(60)


def test_a_trainer_killed_inside_the_session_still_has_its_daemon_quit(tmp_path):
    record = fake_control(tmp_path)
    trainer = multiprocessing.get_context("fork").Process(
        target=_sit_in_a_session, args=(f"{tmp_path}{os.pathsep}{os.environ['PATH']}", tmp_path / "inside")
    )
    trainer.start()
    deadline = time.monotonic() + 30
    while not (tmp_path / "inside").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.join()
    (started, pipe) = record.read_text().splitlines()[0].split()
    while Path(pipe).exists() and time.monotonic() < deadline:  # the watcher quits it, then removes the pipe
        time.sleep(0.05)
    assert started == "-d" and record.read_text().splitlines()[1:] == [f" {pipe}", "quit"]
    assert not Path(pipe).exists()


def test_a_session_without_the_trainer_cap_is_a_client_at_the_full_share(tmp_path, monkeypatch):
    fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", raising=False)
    with mps_session([spec()], cap_trainer=False):
        assert "CUDA_MPS_PIPE_DIRECTORY" in os.environ and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in os.environ


@pytest.mark.parametrize("specs", [[spec("green")], [spec(device="cpu")]])
def test_no_daemon_for_other_policies_or_on_the_cpu(tmp_path, monkeypatch, specs):
    record = fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with mps_session(specs):
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert not record.exists()


def test_two_trainer_percentages_in_one_process_are_a_spec_error():
    with (
        pytest.raises(SpecError, match="one process has one MPS percentage"),
        mps_session([spec(), spec(percent="30")]),
    ):
        pass


@pytest.mark.parametrize(("major", "name"), [(9, "NVIDIA H200"), (8, "NVIDIA A100-SXM4-80GB")])
def test_auto_decode_kernels_are_the_fused_ones_on_hopper_and_cublas_before_it(monkeypatch, major, name):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    assert decode_kernels_for("auto", cuda) == ("rollplex_fused" if major >= 9 else "cublas")
    assert decode_kernels_for("rollplex", cuda) == "rollplex"
    if major >= 9:
        assert decode_kernels_for("rollplex_pdl", cuda) == "rollplex_pdl"
    else:
        with pytest.raises(SpecError, match=f"rollplex_pdl needs a Hopper or newer GPU, not {name}"):
            decode_kernels_for("rollplex_pdl", cuda)
