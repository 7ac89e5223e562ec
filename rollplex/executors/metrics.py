"""Per-step metrics: one JSON line per step in `metrics.jsonl`, one per held-out evaluation in `eval.jsonl`, the same
scalars as TensorBoard events (an evaluation's under `eval/`)."""

from __future__ import annotations

import hashlib
import json
import resource
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

_WORDS_PER_CHUNK = 1 << 22  # 64-bit words fingerprinted at a time: bounded scratch memory on the device
_MIXERS = (-0x61C8864680B583EB, -0x3D4D51C2D82B14B1)  # 0x9E3779B97F4A7C15 and 0xC2B2AE3D27D4EB4F as int64


def param_digest(model: nn.Module) -> str:
    """sha256 over every parameter's name, dtype, shape and fingerprint, in name order: equal weights give equal
    digests; different weights, different digests but with negligible probability. A parameter's fingerprint
    is two sums over its bytes read as 64-bit words, each word times an odd multiplier drawn from its position,
    modulo 2^64: computed where the parameter lives (nothing copied to the host), the same in any summation
    order and on any device, and changed by any change to a single word."""
    return Fingerprints.of(model).digest()


@dataclass(frozen=True)
class Fingerprints:
    """`param_digest` in two halves: `of` launches the fingerprints where the parameters live and returns without
    waiting for them; `digest` reads them (one copy to the host) and hashes."""

    heads: tuple[str, ...]  # per parameter in name order: its name, dtype and shape
    sums: torch.Tensor  # [parameters, 2] int64 on the parameters' device

    @staticmethod
    def of(model: nn.Module) -> Fingerprints:
        named = sorted(model.named_parameters(), key=lambda kv: kv[0])
        sums = [_fingerprint(p.detach()) for _, p in named]
        return Fingerprints(
            tuple(f"{name} {p.dtype} {tuple(p.shape)}" for name, p in named),
            torch.stack(sums) if sums else torch.zeros(0, len(_MIXERS), dtype=torch.int64),
        )

    def digest(self) -> str:
        h = hashlib.sha256()
        for head, (first, second) in zip(self.heads, self.sums.cpu().tolist(), strict=True):
            h.update(f"{head} {first} {second};".encode())
        return h.hexdigest()


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    """`param_digest`'s two sums of `t`'s bytes, as an int64 tensor on `t`'s device: on a GPU one fused launch
    (`rollplex.kernels.fingerprint`), on the CPU torch's ops chunk by chunk (`summed`); the same sums."""
    data = t.reshape(-1).view(torch.uint8)
    if data.numel() % 8 or data.storage_offset() % 8:  # a fresh copy, zero-padded to whole words
        data = torch.cat([data, data.new_zeros(-data.numel() % 8)])
    words = data.view(torch.int64)
    if words.is_cuda:
        from rollplex.kernels.fingerprint import fingerprint_words

        return fingerprint_words(words, _MIXERS, torch.zeros(len(_MIXERS), dtype=torch.int64, device=t.device))
    return summed(words)


def summed(words: torch.Tensor) -> torch.Tensor:
    """The two position-weighted sums of words [n] int64 modulo 2^64, with torch's ops over chunks of at most
    `_WORDS_PER_CHUNK` words (bounded scratch memory)."""
    total = torch.zeros(len(_MIXERS), dtype=torch.int64, device=words.device)
    for start in range(0, words.numel(), _WORDS_PER_CHUNK):
        chunk = words[start : start + _WORDS_PER_CHUNK]
        position = torch.arange(start, start + chunk.numel(), dtype=torch.int64, device=words.device)
        for k, mixer in enumerate(_MIXERS):
            weight = position * mixer
            weight = (weight ^ (weight >> 29)) | 1
            total[k] += (chunk * weight).sum()
    return total


def peak_mem_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


class MetricsLog:
    """Appends one line per step (and per evaluation); on resume, drops lines past the checkpoint so each file stays
    one run (rewritten beside and renamed over: a kill meanwhile keeps the old file whole), and TensorBoard drops its
    events past it."""

    def __init__(
        self,
        out_dir: Path,
        *,
        resume_step: int | None = None,
        tensorboard: bool = True,
        evaluation: bool = False,
        evaluations_kept: int | None = None,
    ) -> None:
        """`evaluation`: the run evaluates (a fresh run's eval.jsonl is made, else removed); `evaluations_kept`: the
        last step whose evaluation a resumed run keeps (default `resume_step`; one before where it evaluates again)."""
        self.path = out_dir / "metrics.jsonl"
        self.eval_path = out_dir / "eval.jsonl"
        _start(self.path, resume_step)
        kept = resume_step if resume_step is None or evaluations_kept is None else evaluations_kept
        _start(self.eval_path, kept, create=evaluation)
        purge = None if resume_step is None else resume_step + 1
        self.writer = _tensorboard(out_dir / "tb", purge) if tensorboard else None

    def write(self, record: dict) -> None:
        self._append(self.path, record, "")

    def write_eval(self, record: dict) -> None:
        """An evaluation's line (`executors.evaluation`), keyed by the step whose weights it read."""
        self._append(self.eval_path, record, "eval/")

    def _append(self, path: Path, record: dict, prefix: str) -> None:
        with path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.writer is not None:
            for key, value in _scalars(record, prefix):
                self.writer.add_scalar(key, value, record["step"])
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def _start(path: Path, resume_step: int | None, create: bool = True) -> None:
    """A new run's file empty (`create`: made, else none); a resumed run's without the lines past `resume_step`."""
    if resume_step is None:
        if create:
            path.write_text("")
        else:  # an earlier run's in this directory (one that stopped before its first step's line)
            path.unlink(missing_ok=True)
    elif path.exists():
        kept = [line for line in _whole_lines(path) if json.loads(line)["step"] <= resume_step]
        fresh = path.with_name(path.name + ".tmp")
        fresh.write_text("".join(line + "\n" for line in kept))
        fresh.replace(path)


def _whole_lines(path: Path) -> list[str]:
    """The file's lines but a last one cut short (a run killed while writing it): that step is trained again."""
    lines = path.read_text().splitlines()
    if lines:
        try:
            json.loads(lines[-1])
        except json.JSONDecodeError:
            lines.pop()
    return lines


def _scalars(record: dict, prefix: str = ""):
    for key, value in record.items():
        if isinstance(value, dict):
            yield from _scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and key != "step":
            yield f"{prefix}{key}", value


def _tensorboard(path: Path, purge_step: int | None = None):
    """A writer into `path`; `purge_step`: events of that step and later, an earlier run's, are dropped."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(str(path), purge_step=purge_step)
