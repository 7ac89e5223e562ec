"""The GPU's SM clock, memory clock and power draw over a window of host time, sampled by nvidia-smi.

    with ClockLog() as clocks:
        t0 = time.time(); ...; t1 = time.time()
        clocks.window(t0, t1)  # {"sm_mhz": ..., "mem_mhz": ..., "power_w": ..., "samples": n} or None

A bench uses it to tell apart two reasons a memory-bound kernel slows beside compute-bound work on other SMs:
a lower SM clock under the board's power limit, or contention for L2 and HBM at the same clock. nvidia-smi
samples every `period_ms` (50 by default) in a child process, so the bench's own timing is not disturbed; a
window shorter than a few periods has few samples (`samples` says how many). Medians, per quantity.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
from datetime import datetime
from pathlib import Path

QUERY = "timestamp,clocks.sm,clocks.mem,power.draw"
STAMP = "%Y/%m/%d %H:%M:%S.%f"  # nvidia-smi's timestamp, local time (as time.time() is read here)


def parse(lines: list[str]) -> list[tuple[float, float, float, float]]:
    """(host time s, SM MHz, memory MHz, power W) per sample line of `QUERY` (csv, no header, no units); lines
    that are not a whole sample (a partial last line, '[N/A]') are skipped."""
    samples = []
    for line in lines:
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 4:
            continue
        try:
            at = datetime.strptime(fields[0], STAMP).timestamp()
            samples.append((at, *(float(f) for f in fields[1:])))
        except ValueError:
            continue
    return samples


def medians(samples: list[tuple[float, float, float, float]], t0: float, t1: float) -> dict | None:
    """Medians of the samples taken in [t0, t1] (host seconds), or None if there are none."""
    inside = [s for s in samples if t0 <= s[0] <= t1]
    if not inside:
        return None
    sm, mem, power = (statistics.median(s[i] for s in inside) for i in (1, 2, 3))
    return {"sm_mhz": sm, "mem_mhz": mem, "power_w": round(power, 1), "samples": len(inside)}


def first_visible() -> str:
    """nvidia-smi's id of CUDA device 0: the first of CUDA_VISIBLE_DEVICES (an index or a UUID), else 0."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"


class ClockLog:
    """nvidia-smi sampling `QUERY` for one GPU (`index`: nvidia-smi's index or a UUID) while the block runs."""

    def __init__(self, index: str | None = None, period_ms: int = 50) -> None:
        self.index, self.period_ms = index or first_visible(), period_ms
        self.path = Path(tempfile.mkstemp(prefix="gpu_clocks_", suffix=".csv")[1])
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ClockLog:
        command = ["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader,nounits",
                   f"--loop-ms={self.period_ms}", f"--id={self.index}"]  # fmt: skip
        if shutil.which("stdbuf"):  # a line per sample as it is taken (stdout to a file is block-buffered)
            command = ["stdbuf", "-oL", *command]
        with self.path.open("w") as out:
            self.proc = subprocess.Popen(command, stdout=out, stderr=subprocess.DEVNULL)
        return self

    def window(self, t0: float, t1: float) -> dict | None:
        """Medians over [t0, t1]; call it a period or more after t1, once the last sample is written."""
        return medians(parse(self.path.read_text().splitlines()), t0, t1)

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
        self.path.unlink(missing_ok=True)
