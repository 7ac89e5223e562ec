"""Training checkpoints: weights (HF safetensors), optimizer state, RNG states and the data position.

Lifecycle of a checkpoint directory:

    step-000004.tmp (being written) --os.replace--> step-000004 (complete)

A crash or Ctrl-C while writing leaves only a `.tmp` directory, which loading ignores and the next save
removes; a complete directory is never half-written.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from rollplex.executors.engines import Engines
from rollplex.models.checkpoint import load_checkpoint, save_checkpoint


@dataclass(frozen=True)
class Snapshot:
    """What a checkpoint needs beyond weights and optimizer state, taken when a step completes."""

    step: int
    data_position: int
    torch_rng: torch.Tensor
    sampling_rng: torch.Tensor

    @staticmethod
    def of(step: int, data_position: int, engines: Engines) -> Snapshot:
        return Snapshot(step, data_position, torch.get_rng_state(), engines.generator.get_state())


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step:06d}"


def save(out_dir: Path, snap: Snapshot, engines: Engines) -> Path:
    """Weights and optimizer state as they are now (they must be those of `snap.step`)."""
    final = checkpoint_dir(out_dir, snap.step)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_checkpoint(engines.actor, tmp / "model")
    torch.save(engines.optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save({"torch": snap.torch_rng, "sampling": snap.sampling_rng}, tmp / "rng.pt")
    (tmp / "state.json").write_text(json.dumps({"step": snap.step, "data_position": snap.data_position}))
    if final.exists():
        shutil.rmtree(final)
    tmp.replace(final)
    return final


def latest(out_dir: Path) -> Path | None:
    found = sorted(p for p in (out_dir / "checkpoints").glob("step-*") if not p.name.endswith(".tmp"))
    return found[-1] if found else None


def load(path: Path, engines: Engines) -> Snapshot:
    load_checkpoint(engines.actor, path / "model")
    engines.optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))
    rng = torch.load(path / "rng.pt", weights_only=False)
    torch.set_rng_state(rng["torch"])
    engines.generator.set_state(rng["sampling"])
    state = json.loads((path / "state.json").read_text())
    return Snapshot(state["step"], state["data_position"], rng["torch"], rng["sampling"])
