"""Per-step metrics: one JSON line per step in `metrics.jsonl`, the same scalars as TensorBoard events."""

from __future__ import annotations

import hashlib
import json
import resource
from pathlib import Path

import torch
from torch import nn


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's name and bytes, in name order: equal digests, equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def peak_mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLog:
    """Appends one line per step; on resume, drops lines past the checkpoint so the file stays one run."""

    def __init__(self, out_dir: Path, *, resume_step: int | None = None, tensorboard: bool = True) -> None:
        self.path = out_dir / "metrics.jsonl"
        if resume_step is None:
            self.path.write_text("")
        elif self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if json.loads(line)["step"] <= resume_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self.writer = _tensorboard(out_dir / "tb") if tensorboard else None

    def write(self, record: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in _scalars(record):
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _scalars(record: dict, prefix: str = ""):
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and key != "step":
            yield f"{prefix}{key}", value


def _tensorboard(path: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(path))
