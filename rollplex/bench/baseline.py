"""Baseline runs saved for later benches: serial (`rollplex bench --save-serial` / `--serial-from`) and unsplit
(`--save-unsplit` / `--unsplit-from`). A run measured once stands in for that schedule in later benches of the
spec, if it was measured as they would measure it (`baseline_key`: the schedule, the spec less rollplex's own
sharing settings, the step counts) on the same kind of GPU. The file holds everything but the final weights,
and serial's noise floor when the bench measured one.
Not here: running schedules (`harness.py`) and comparing them (`document.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex.bench.harness import ScheduleRun, gpu_name
from rollplex.graph.ir import Schedule
from rollplex.graph.load import LoadedSpec


def baseline_key(loaded: LoadedSpec, steps: int, warmup: int, schedule: Schedule = Schedule.SERIAL) -> str:
    """What a baseline depends on: its schedule, the spec less rollplex's own sharing settings (serial's prefix
    grouping and whether rollout runs in its own process stay in), and the step counts."""
    spec = loaded.spec
    sharing = spec.sharing.model_dump(include={"prompts_per_chunk", "layers_per_chunk"})
    document = {
        "schedule": schedule.value,
        "spec": spec.model_dump(mode="json", exclude={"sharing", "schedule"}),
        "sharing": sharing | {"rollout_in_own_process": spec.sharing.policy == "mps"},
        "steps": steps,
        "warmup": warmup,
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class NoiseFloor:
    """Serial's first-step gradient sketch rerun with rollplex's prefix grouping (`prompts_per_chunk`, None: all)."""

    grads: torch.Tensor
    prompts_per_chunk: int | None


def save_baseline(path: Path, run: ScheduleRun, key: str, command: str, floor: NoiseFloor | None = None) -> None:
    """A baseline run for later benches (`--serial-from`, `--unsplit-from`): everything but the final weights,
    and serial's noise floor when the bench measured one."""
    fields = {f.name: getattr(run, f.name) for f in dataclasses.fields(run) if f.name != "params"}
    path.parent.mkdir(parents=True, exist_ok=True)
    floor_doc = None if floor is None else dataclasses.asdict(floor)
    torch.save({"key": key, "command": command, "gpu": gpu_name(), "run": fields, "floor": floor_doc}, path)


def load_baseline(path: Path, key: str) -> tuple[ScheduleRun, str, NoiseFloor | None]:
    """The run saved at `path`, its command and noise floor (None if not measured); a ValueError unless it was
    measured as this bench would measure it (`baseline_key`) on this kind of GPU."""
    saved = torch.load(path, weights_only=False)
    if saved["key"] != key:
        raise ValueError(
            f"{path} was measured under another schedule, spec, grouping or step count ({saved['command']})"
        )
    if saved["gpu"] != gpu_name():
        raise ValueError(f"{path} was measured on {saved['gpu']}, this is {gpu_name()}")
    floor = saved.get("floor")
    return ScheduleRun(**saved["run"]), saved["command"], None if floor is None else NoiseFloor(**floor)
