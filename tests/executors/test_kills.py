"""SIGKILL at each point of a step and of a checkpoint's writing: `--resume` afterwards continues from the last
complete checkpoint with exactly the weights of a run never killed; a half-written checkpoint is never taken.
On a GPU: a run under the mps policy whose trainer or rollout process is SIGKILLed leaves nothing behind."""

import multiprocessing
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import pytest
import torch
from kill_driver import POINTS, arm, run

from rollplex.executors import checkpointing
from rollplex.memory.mps import MpsDaemon

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


GPU_SPEC = """
model: tiny
cluster: {hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 2, group_size: 2, prompt_tokens: 384, response_tokens: 16, visual_tokens: 8,
           dataset: "synthetic:clevrer@tiny"}
algorithm: {rewards: [{name: brevity}]}
sharing: {policy: mps}
run: {steps: 10000, device: cuda}
"""
FREE_BYTES = "import torch; print(torch.cuda.mem_get_info()[0])"


def _python(script: str, env: dict | None = None) -> str:
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split()[-1]


def _rollout_child(pid: int) -> int:
    """The trainer's spawned rollout process."""
    for entry in Path("/proc").iterdir():
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if entry.name.isdigit() and parent == pid and b"spawn_main" in (entry / "cmdline").read_bytes():
                return int(entry.name)
        except (OSError, ValueError, IndexError):  # gone, or not a process
            pass
    raise AssertionError(f"process {pid} has no rollout child")


def _dead(pid: int) -> bool:
    """Process pid has exited: it is gone, or a zombie (its parent died first and the container's init may
    not reap it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _ours(directory: Path) -> list[str]:
    """rollplex's entries in a temporary directory (a SIGKILLed Python leaves its own `pymp-*` there)."""
    return [name for name in os.listdir(directory) if name.startswith("rollplex-")]


def _processes_naming(text: str) -> dict[int, bytes]:
    """This user's live processes whose environment holds `text`, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "environ").read_bytes():
                found[int(entry.name)] = (entry / "cmdline").read_bytes()[:200]
        except OSError:  # gone, or another user's
            pass
    return found


@pytest.mark.gpu
@pytest.mark.skipif(
    not (torch.cuda.is_available() and shutil.which("nvidia-cuda-mps-control")), reason="needs CUDA and MPS binaries"
)
@pytest.mark.parametrize("victim", ["trainer", "rollout"])
def test_a_gpu_run_killed_leaves_no_daemon_socket_process_or_device_memory(tmp_path, victim):
    free_before = int(_python(FREE_BYTES))
    # the run's temporary directories (MPS pipe and log, IPC sockets) land here: a short path, as the MPS
    # daemon's sockets in it must be (a Unix socket's path has at most 107 bytes)
    private = Path(tempfile.mkdtemp(prefix="rk-", dir="/tmp"))
    try:
        _kill_a_gpu_run(tmp_path, private, victim, free_before)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def _kill_a_gpu_run(tmp_path: Path, private: Path, victim: str, free_before: int) -> None:
    (tmp_path / "spec.yaml").write_text(GPU_SPEC)
    env = os.environ | {"TMPDIR": str(private), "TORCHINDUCTOR_COMPILE_THREADS": "1",
                        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}  # fmt: skip
    out = tmp_path / "run"
    trainer = subprocess.Popen(
        [sys.executable, "-m", "rollplex", "run", str(tmp_path / "spec.yaml"), "--out", str(out), "--quiet",
         "--no-checkpoints"], env=env, stderr=(tmp_path / "stderr").open("w"),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        while not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip():
            assert trainer.poll() is None, (tmp_path / "stderr").read_text()[-2000:]
            assert time.monotonic() < deadline, "no step within 300 s"
            time.sleep(0.2)
        rollout = _rollout_child(trainer.pid)
        os.kill(trainer.pid if victim == "trainer" else rollout, signal.SIGKILL)
        trainer.wait(timeout=120)
    finally:
        trainer.kill()
    err = (tmp_path / "stderr").read_text()
    if victim == "rollout":  # the trainer stops with one line
        said = [line for line in err.splitlines() if line.startswith("rollplex:")]
        assert trainer.returncode == 1 and "Traceback" not in err, err[-2000:]
        assert len(said) == 1 and re.match(r"rollplex: the rollout process (died|is gone)", said[0]), err[-2000:]
    deadline = time.monotonic() + 60
    while (_processes_naming(str(private)) or _ours(private)) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = _processes_naming(str(private))
    assert left == {}, f"the MPS daemon, its server or the rollout process lives on: {left}"
    assert _ours(private) == [], f"MPS or IPC directories were left behind: {_ours(private)}"
    assert _dead(rollout)
    free_after = int(_python(FREE_BYTES))
    assert free_after >= free_before - (256 << 20), f"device memory not given back: {free_before} then {free_after}"
    with MpsDaemon() as mps:  # and the next run starts its own daemon and computes under it
        script = "import torch; x = torch.ones(1 << 20, device='cuda'); print(int(x.sum()))"
        assert _python(script, os.environ | mps.client_env()) == str(1 << 20)
