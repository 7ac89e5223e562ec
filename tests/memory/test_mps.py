"""`MpsDaemon` against a fake `nvidia-cuda-mps-control` that records its arguments, environment and input;
one GPU test starts the real daemon and runs a client under it."""

from __future__ import annotations

import gc
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from rollplex.memory.mps import MpsDaemon

FAKE = """#!/bin/sh
echo "call $* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY$CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" >> {record}
if [ "$1" = "-d" ]; then
  {start}
else
  read line
  echo "stdin $line" >> {record}
fi
"""
MAKES_PIPE = 'touch "$CUDA_MPS_PIPE_DIRECTORY/control"'


def fake_control(directory: Path, start: str = MAKES_PIPE) -> tuple[Path, Path]:
    """An executable fake control program in `directory`, and the file it records its calls in."""
    record, control = directory / "calls.txt", directory / "nvidia-cuda-mps-control"
    control.write_text(FAKE.format(record=record, start=start))
    control.chmod(0o755)
    return control, record


def calls(record: Path) -> list[str]:
    return record.read_text().splitlines() if record.exists() else []


def test_start_runs_the_control_program_with_d_and_private_directories(tmp_path, monkeypatch):
    control, record = fake_control(tmp_path)
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "40")  # would cap every server: not passed on
    with MpsDaemon(control=control) as mps:
        pipe, log = mps.pipe_directory, mps.log_directory
        assert calls(record) == [f"call -d pipe={pipe} log={log}"]
        for directory in (pipe, log):
            assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert calls(record)[1:] == [f"call  pipe={pipe} log={log}", "stdin quit"]
    assert not os.path.exists(pipe) and not os.path.exists(log)


def test_the_binary_is_found_on_path(tmp_path, monkeypatch):
    _, record = fake_control(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with MpsDaemon():
        pass
    assert calls(record)[0].startswith("call -d ") and calls(record)[-1] == "stdin quit"


def test_client_env_names_the_directories_and_the_active_thread_percentage(tmp_path):
    control, _ = fake_control(tmp_path)
    with MpsDaemon(control=control) as mps:
        dirs = {"CUDA_MPS_PIPE_DIRECTORY": mps.pipe_directory, "CUDA_MPS_LOG_DIRECTORY": mps.log_directory}
        assert mps.client_env() == dirs
        assert mps.client_env(30) == dirs | {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}
        with pytest.raises(ValueError, match="active_thread_percent 0"):
            mps.client_env(0)
    with pytest.raises(RuntimeError, match="start the MPS daemon"):
        mps.client_env()


def test_stopping_twice_or_before_starting_is_fine(tmp_path):
    control, record = fake_control(tmp_path)
    mps = MpsDaemon(control=control)
    mps.stop()
    mps.start()
    mps.stop()
    mps.stop()
    assert [line for line in calls(record) if line.startswith("stdin")] == ["stdin quit"]


def test_a_forgotten_daemon_is_stopped_when_collected(tmp_path):
    control, record = fake_control(tmp_path)
    mps = MpsDaemon(control=control)
    mps.start()
    pipe = mps.pipe_directory
    del mps
    gc.collect()
    assert calls(record)[-1] == "stdin quit" and not os.path.exists(pipe)


def test_a_client_hands_the_daemon_to_a_watcher_that_quits_it_after_the_client_exits(tmp_path):
    control, record = fake_control(tmp_path)
    mps = MpsDaemon(control=control)
    mps.start()
    pipe = mps.pipe_directory
    client = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)"])
    mps.stop_after_exit(client.pid)
    assert not mps.running and "stdin quit" not in calls(record)  # returned at once, the client still runs
    client.wait()
    deadline = time.monotonic() + 10
    while os.path.exists(pipe) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls(record)[-1] == "stdin quit" and not os.path.exists(pipe)
    mps.stop()  # nothing left to stop


def test_a_missing_binary_is_a_one_line_error_naming_it():
    with pytest.raises(RuntimeError, match="no-such-mps-control not found on PATH") as error:
        MpsDaemon(binary="no-such-mps-control").start()
    assert "\n" not in str(error.value)


def test_a_daemon_that_fails_to_start_is_a_one_line_error_and_leaves_nothing(tmp_path, monkeypatch):
    control, _ = fake_control(tmp_path, start='echo "An instance of this daemon is already running" >&2; exit 1')
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.raises(RuntimeError, match=r"-d\) failed with exit 1: An instance of this daemon") as error:
        MpsDaemon(control=control).start()
    assert "\n" not in str(error.value)
    assert os.listdir(tmp_path / "tmp") == []


def test_a_daemon_that_makes_no_pipe_is_an_error(tmp_path):
    control, _ = fake_control(tmp_path, start="exit 0")
    with pytest.raises(RuntimeError, match="created no pipe"):
        MpsDaemon(control=control, timeout_s=0.2).start()


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and shutil.which("nvidia-cuda-mps-control")), reason="needs CUDA and MPS binaries"
)
def test_a_client_with_a_capped_share_runs_a_kernel_under_the_real_daemon():
    with MpsDaemon() as mps:
        script = "import torch; x = torch.ones(1 << 20, device='cuda'); print(int(x.sum()))"
        env = os.environ | mps.client_env(50)
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == str(1 << 20)
        assert os.listdir(mps.log_directory), "the daemon logs into the private directory"
