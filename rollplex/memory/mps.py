"""`MpsDaemon`: a private CUDA MPS control daemon that the runtime starts and stops itself (the `mps` policy).

What it is: the recipe verified on the H200 (DESIGN.md section 6): private pipe and log directories (0700),
`nvidia-cuda-mps-control -d` started with `CUDA_MPS_PIPE_DIRECTORY` / `CUDA_MPS_LOG_DIRECTORY` in its
environment, and `echo quit | nvidia-cuda-mps-control` with the same variables to stop it. `client_env`
gives the variables a client process needs *before it initialises CUDA* (the two directories and, optionally,
`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`): for a child, its environment; for this process, `os.environ` before
torch first touches the GPU. The daemon does not inherit this process's `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`
(in the daemon's environment it would cap every client by default). What it is not: a scheduler (the
percentages are the caller's choice), nor a client of the daemon itself; it needs no GPU and imports
nothing from CUDA.

    STOPPED --start()--> RUNNING (daemon up, directories exist) --stop() / exit / garbage collection--> STOPPED
    RUNNING --stop_after_exit(pid)--> HANDED OVER (a detached watcher quits it once process pid has exited)

`stop` is idempotent and also runs at interpreter exit and on garbage collection (`weakref.finalize`), so the
daemon never outlives the process that started it (a SIGKILL excepted). A process that is itself a client
cannot stop it: `quit` waits for the clients, and this one is still there, so the call only ends at its
timeout. Such a process calls `stop_after_exit()` instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

CONTROL = "nvidia-cuda-mps-control"
PIPE_DIRECTORY = "CUDA_MPS_PIPE_DIRECTORY"
LOG_DIRECTORY = "CUDA_MPS_LOG_DIRECTORY"
ACTIVE_THREAD_PERCENTAGE = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _quit(control: str, env: dict[str, str], directories: tuple[str, ...], timeout_s: float) -> str | None:
    """Sends `quit` to the daemon and removes its directories; the failure as one line, or None. Never raises."""
    try:
        done = subprocess.run([control], input="quit\n", env=env, capture_output=True, text=True, timeout=timeout_s)
        failure = None if done.returncode == 0 else f"exit {done.returncode}: {_one_line(done.stderr or done.stdout)}"
    except (OSError, subprocess.TimeoutExpired) as error:
        failure = _one_line(str(error))
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)
    return None if failure is None else f"stopping the MPS daemon (echo quit | {control}) failed: {failure}"


class MpsDaemon:
    """One MPS control daemon with private directories; a context manager (`with MpsDaemon() as mps: ...`).

    `binary` is looked up on PATH unless `control` names the executable itself (tests inject a fake).
    `timeout_s` bounds each call of the control program and the wait for the daemon's pipe.
    """

    def __init__(self, binary: str = CONTROL, control: str | Path | None = None, timeout_s: float = 30.0) -> None:
        self.binary, self.control, self.timeout_s = binary, control, timeout_s
        self.pipe_directory: str | None = None
        self.log_directory: str | None = None
        self._control: str | None = None
        self._env: dict[str, str] = {}
        self._finalizer: weakref.finalize | None = None

    def __enter__(self) -> MpsDaemon:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._finalizer is not None and self._finalizer.alive

    def start(self) -> None:
        """Creates the directories and starts the daemon; a one-line RuntimeError if it cannot."""
        if self.running:
            raise RuntimeError(f"the MPS daemon with pipe directory {self.pipe_directory} is already running")
        control = self._resolve()
        pipe, log = tempfile.mkdtemp(prefix="rollplex-mps-pipe-"), tempfile.mkdtemp(prefix="rollplex-mps-log-")
        inherited = {k: v for k, v in os.environ.items() if k != ACTIVE_THREAD_PERCENTAGE}  # else: every server's cap
        env = inherited | {PIPE_DIRECTORY: pipe, LOG_DIRECTORY: log}
        failure = self._launch(control, env, pipe)
        if failure is not None:
            _quit(control, env, (pipe, log), self.timeout_s)  # whatever half-started, and the directories
            raise RuntimeError(failure)
        self.pipe_directory, self.log_directory = pipe, log
        self._control, self._env = control, env
        self._finalizer = weakref.finalize(self, _quit, control, env, (pipe, log), self.timeout_s)

    def stop(self) -> None:
        """Quits the daemon and removes its directories; does nothing if it is not running."""
        failure = self._finalizer() if self._finalizer is not None else None
        self._finalizer, self.pipe_directory, self.log_directory = None, None, None
        if failure is not None:
            raise RuntimeError(failure)

    def stop_after_exit(self, pid: int | None = None) -> None:
        """Hands the daemon to a detached watcher that sends `quit` and removes the directories once process
        `pid` (default: this one, a client) has exited; returns at once. Does nothing if it is not running."""
        if not self.running:
            return
        self._finalizer.detach()
        watch = 'while kill -0 "$0" 2>/dev/null; do sleep 0.1; done; echo quit | "$1"; rm -rf "$2" "$3"'
        subprocess.Popen(
            ["sh", "-c", watch, str(pid or os.getpid()), self._control, self.pipe_directory, self.log_directory],
            env=self._env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip
        self._finalizer, self.pipe_directory, self.log_directory = None, None, None

    def client_env(self, active_thread_percent: int | None = None) -> dict[str, str]:
        """The variables a client must have before it initialises CUDA; the SM share (1-100 %) if given."""
        if not self.running:
            raise RuntimeError("start the MPS daemon before asking for its client environment")
        if active_thread_percent is not None and not 1 <= active_thread_percent <= 100:
            raise ValueError(f"active_thread_percent {active_thread_percent} must be in 1..100 (or None: no cap)")
        env = {PIPE_DIRECTORY: self.pipe_directory, LOG_DIRECTORY: self.log_directory}
        if active_thread_percent is not None:
            env[ACTIVE_THREAD_PERCENTAGE] = str(active_thread_percent)
        return env

    def _resolve(self) -> str:
        if self.control is not None:
            if not os.access(self.control, os.X_OK):
                raise RuntimeError(f"MPS control program {self.control} does not exist or is not executable")
            return str(self.control)
        found = shutil.which(self.binary)
        if found is None:
            raise RuntimeError(f"{self.binary} not found on PATH: install NVIDIA's MPS binaries or pick another policy")
        return found

    def _launch(self, control: str, env: dict[str, str], pipe: str) -> str | None:
        """Runs `control -d` and waits for the daemon's pipe to appear; the failure as one line, or None."""
        try:
            done = subprocess.run([control, "-d"], env=env, capture_output=True, text=True, timeout=self.timeout_s)
        except (OSError, subprocess.TimeoutExpired) as error:
            return f"starting the MPS daemon ({control} -d) failed: {_one_line(str(error))}"
        if done.returncode != 0:
            output = _one_line(done.stderr or done.stdout)
            return f"starting the MPS daemon ({control} -d) failed with exit {done.returncode}: {output}"
        deadline = time.monotonic() + self.timeout_s
        while not os.listdir(pipe):
            if time.monotonic() > deadline:
                return f"the MPS daemon ({control} -d) created no pipe in {pipe} within {self.timeout_s:g} s"
            time.sleep(0.01)
        return None
