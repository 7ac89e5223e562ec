"""`bench/module_times.py`: each module call of one op timed under each collector setting (on the CPU the host's
times stand for the device's)."""

from __future__ import annotations

import gc
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def test_module_times_times_every_module_call_of_the_op_under_each_collector(tmp_path):
    out = tmp_path / "times.json"
    command = [sys.executable, str(ROOT / "bench/module_times.py"), "specs/tiny_cpu.yaml", "--warmup", "1"]
    proc = subprocess.run([*command, "--stall-ms", "0", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["op"] == "actor_score.prefix" and list(result["variants"]) == ["python", "manual"]
    for row in result["variants"].values():
        kinds = row["device_ms_by_module"]
        assert {"embed", "vision block", "merger", "layer", "norm", "lm_head"} <= set(kinds)
        assert 0 < sum(kinds.values()) <= row["device_ms"] + 0.1 * len(kinds)  # no module timed inside another
        assert len(row["stalls"]) == row["calls"] > 0  # at 0 ms every call is listed
        assert row["gate_wait_ms"] >= 0.0 and len(row["longest_gate_waits"]) == 8  # modules with parameters
        assert set(row["host_ms_by_module"]) == set(kinds) and row["gate_host_ms"] >= 0.0
    assert result["variants"]["manual"]["gc_ms"] == 0.0  # no collection inside a step under run.manual_gc


def test_module_times_records_the_collections_made_while_it_times(monkeypatch):
    spec = importlib.util.spec_from_file_location("module_times", ROOT / "bench/module_times.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "module_times", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    timer = module.CallTimer({})
    try:
        gc.collect()
        assert timer.collections == []  # not timing
        timer.on = True
        gc.collect(1)
        assert [generation for generation, _, _ in timer.collections] == [1]
    finally:
        gc.callbacks.remove(timer._on_gc)


def test_a_gate_registered_before_the_timer_is_timed_as_the_wait_between_its_two_events(monkeypatch):
    spec = importlib.util.spec_from_file_location("module_times", ROOT / "bench/module_times.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "module_times", module)
    spec.loader.exec_module(module)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    model[0].register_forward_pre_hook(lambda m, args: time.sleep(0.05))  # stands in for a deferred update's gate
    timer = module.CallTimer({}, model)
    try:
        timer.on = True
        model(torch.zeros(1, 4))
        ((name, (before, _), (after, _)),) = timer.gates  # the one module with parameters of its own
        assert name == "0" and before.elapsed_time(after) >= 50.0
    finally:
        gc.callbacks.remove(timer._on_gc)
