"""SIGTERM and SIGHUP stop a run as Ctrl-C does: `stop_signals` raises `Stopped` where the process is, the gate holds
every stop signal while an update must finish and raises the first that came, and `rollplex run` sent SIGTERM mid-run
saves its last completed step, says so in one line and exits 143."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rollplex.errors import Stopped
from rollplex.executors.signals import InterruptGate, stop_signals

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_stop_signal_raises_stopped_inside_the_block_and_the_handlers_come_back_after(signum):
    before = signal.getsignal(signum)
    with pytest.raises(Stopped) as stopped, stop_signals():
        os.kill(os.getpid(), signum)
        time.sleep(1)  # the handler runs at the next bytecode: never reached
    assert stopped.value.signum == signum and stopped.value.exit_code == 128 + signum
    assert signal.getsignal(signum) is before


def test_the_gate_holds_every_stop_signal_and_raises_the_first_that_came_at_release():
    gate = InterruptGate()
    with stop_signals():
        gate.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGHUP)  # a lower number, after: both arrive while held, nothing raised
        time.sleep(0.01)
        with pytest.raises(Stopped) as stopped:
            gate.release()
        assert stopped.value.signum == signal.SIGTERM
        gate.hold()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert gate.release(raise_pending=False) == signal.SIGTERM  # reported, not raised
        assert gate.release() is None


def test_a_signal_the_process_ignores_stays_ignored(monkeypatch):
    """Under nohup SIGHUP is ignored: neither the run's handlers nor the gate turn it back on."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with stop_signals():
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
            gate = InterruptGate()
            gate.hold()
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.01)
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN and gate.release() is None
    finally:
        signal.signal(signal.SIGHUP, previous)


def test_rollplex_run_sent_sigterm_saves_its_last_step_says_so_in_one_line_and_exits_143(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollplex", "run", str(ROOT / "specs" / "tiny_cpu.yaml"), "--out", str(out),
         "--steps", "100000", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
    )  # fmt: skip
    metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
    while (not metrics.is_file() or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143
    steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines()]
    saved = out / "checkpoints" / f"step-{steps[-1]:06d}"
    (line,) = [x for x in err.splitlines() if x.startswith("rollplex:")]
    assert (
        line
        == f"rollplex: interrupted (SIGTERM); step {steps[-1]} is saved in {saved}: go on with --resume --out {out}"
    )
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [saved.name]
