"""How long a small host-to-device input waits while other streams stream large copies over the host link, as
the actor prefix's inputs do beside a deferred ChunkedAdamW step (`sharing.update_beside_prefix`).

    python bench/link_queue.py --gib 16 --out bench/results/link_queue_h200.json

The streaming side is the optimizer's pipeline over pinned host memory: chunk m loads into device slot m % 3 once
the offload of the chunk that held the slot has ended, a kernel touches it, it offloads. The 'prefix' stream
meanwhile runs stretches of matmuls, each followed by a small pinned input (--small-kib) brought to the device and
a kernel reading it; an input's latency runs from the moment the prefix stream reaches it (an event recorded just
before) to the end of that kernel. After each stretch a side stream also sends --saved-mib device-to-host (a saved
tensor's offload), timed from when it may start to its end. The host keeps two stretches queued ahead. Cases, the
same traffic each:

- idle: nothing streams; the input's own latency
- gated: every chunk's copies enqueued up front, each load behind a wait on the offload that frees its slot and
  each offload behind its kernel (the optimizer's order once the host has run ahead of the device)
- paced: the host enqueues a chunk's load only once its slot is free and its offload once its kernel has ended,
  so that no copy in the queue waits on an event
- pieces: as gated, every copy in 64 MiB pieces
- mapped: as gated, the input read from the pinned host memory by a kernel (no copy engine)
- memset: as gated, the input zeroed on the device by `cudaMemsetAsync` (through cupy) instead of copied in, as
  cuDNN zeroes its attention workspace: whether a memset on the prefix's stream waits behind the streamed copies
- fill: as memset, the input set by a fill kernel (torch's `fill_`) instead

The cases tell a copy engine that serves its queue in order (gated slow, paced fast) from one that gives a small
copy no turn while large ones stream (gated and paced slow, pieces fast) and from a link too full for any copy
(all but mapped slow); memset slow and fill fast, that a device memset queues with the copies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

CASES = ("idle", "gated", "paced", "pieces", "mapped", "memset", "fill")
SLOTS = 3
PIECE_BYTES = 64 << 20


@dataclass
class Pipeline:
    """The optimizer-like pipeline: per chunk a load, a kernel, an offload, each on a stream of its own;
    `enqueue_all` issues every stage at once, `pace` those whose inputs have ended."""

    host: torch.Tensor  # [chunks, elements] fp32, pinned
    slots: torch.Tensor  # [SLOTS, elements] fp32 on the device
    pieces: bool
    streams: tuple = field(default_factory=lambda: tuple(torch.cuda.Stream() for _ in range(3)))
    loaded: list = field(default_factory=list)  # per chunk: the event after its load, its kernel, its offload
    touched: list = field(default_factory=list)
    offloaded: list = field(default_factory=list)

    @property
    def num_chunks(self) -> int:
        return self.host.shape[0]

    def load(self, m: int, wait: bool) -> None:
        stream = self.streams[0]
        if wait and m >= SLOTS:
            stream.wait_event(self.offloaded[m - SLOTS])
        self.loaded.append(self._copy(stream, self.slots[m % SLOTS], self.host[m]))

    def touch(self, m: int) -> None:
        stream = self.streams[1]
        stream.wait_event(self.loaded[m])
        with torch.cuda.stream(stream):
            self.slots[m % SLOTS].mul_(1.0)
        self.touched.append(stream.record_event())

    def offload(self, m: int, wait: bool) -> None:
        stream = self.streams[2]
        if wait:
            stream.wait_event(self.touched[m])
        self.offloaded.append(self._copy(stream, self.host[m], self.slots[m % SLOTS]))

    def enqueue_all(self) -> None:
        """Every stage at once, the waits in the queue."""
        for m in range(self.num_chunks):
            self.load(m, wait=True)
            self.touch(m)
            self.offload(m, wait=True)

    def pace(self) -> None:
        """Every stage whose inputs have ended on the device, its copies without a wait."""
        while len(self.offloaded) < len(self.touched) and self.touched[len(self.offloaded)].query():
            self.offload(len(self.offloaded), wait=False)
        m = len(self.loaded)
        while m < self.num_chunks and (
            m < SLOTS or (len(self.offloaded) > m - SLOTS and self.offloaded[m - SLOTS].query())
        ):
            self.load(m, wait=False)
            self.touch(m)
            m += 1

    def done(self) -> bool:
        return len(self.offloaded) == self.num_chunks and self.offloaded[-1].query()

    def _copy(self, stream: torch.cuda.Stream, dst: torch.Tensor, src: torch.Tensor) -> torch.cuda.Event:
        n = PIECE_BYTES // 4 if self.pieces else dst.numel()
        with torch.cuda.stream(stream):
            for d, s in zip(dst.split(n), src.split(n), strict=True):
                d.copy_(s, non_blocking=True)
        return stream.record_event()


def memset_async():
    """`cudaMemsetAsync` of a device tensor on the current stream (torch's own `zero_` may launch a fill kernel)."""
    import cupy

    def zero(t: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        cupy.cuda.runtime.memsetAsync(t.data_ptr(), 0, t.numel() * t.element_size(), stream)

    return zero


def read_kernel():
    """A Triton kernel that copies n fp32 from src to dst: src may be pinned host memory, read over the link by
    the SMs (a pinned allocation is mapped into the device's address space)."""
    import triton
    import triton.language as tl

    @triton.jit
    def read(src, dst, n, BLOCK: tl.constexpr):
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(dst + offsets, tl.load(src + offsets, mask=offsets < n), mask=offsets < n)

    return lambda src, dst: read[(triton.cdiv(dst.numel(), 1024),)](src, dst, dst.numel(), BLOCK=1024)


@dataclass(frozen=True)
class Buffers:
    """What every case reuses: the state in pinned host memory and its device slots, the other device-to-host
    traffic, the prefix's input and matmul operand."""

    host: torch.Tensor  # [chunks, elements] fp32, pinned
    slots: torch.Tensor  # [SLOTS, elements] fp32
    saved_dev: torch.Tensor  # one saved tensor
    saved_host: torch.Tensor
    small_host: torch.Tensor
    small_dev: torch.Tensor
    a: torch.Tensor

    @staticmethod
    def make(args: argparse.Namespace) -> Buffers:
        elements = (args.chunk_mib << 20) // 4
        chunks = max(SLOTS, (args.gib << 30) // (args.chunk_mib << 20))
        saved, small = (args.saved_mib << 20) // 4, (args.small_kib << 10) // 4
        return Buffers(
            torch.empty(chunks, elements, pin_memory=True),
            torch.zeros(SLOTS, elements, device="cuda"),
            torch.zeros(saved, device="cuda"),
            torch.empty(saved, pin_memory=True),
            torch.ones(small, pin_memory=True),
            torch.empty(small, device="cuda"),
            torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16),
        )


def run_case(case: str, args: argparse.Namespace, b: Buffers) -> dict:
    streaming = case != "idle"
    pipe = Pipeline(b.host if streaming else b.host[:0], b.slots, pieces=case == "pieces")
    read = read_kernel() if case == "mapped" else None
    if read is not None:
        read(b.small_host, b.small_dev)  # compiled before the clock starts
    zero = memset_async() if case == "memset" else None
    torch.mm(b.a, b.a)
    prefix, side = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()

    begin = time.perf_counter()
    if streaming and case != "paced":
        pipe.enqueue_all()
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    saved_marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    while (streaming and not pipe.done()) or len(marks) < args.min_inputs:
        if case == "paced":
            pipe.pace()
        if len(marks) >= 2 and not marks[-2][1].query():
            continue  # two stretches queued ahead already
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(prefix):
            for _ in range(args.matmuls):
                torch.mm(b.a, b.a)
            start.record(prefix)
            if read is not None:
                read(b.small_host, b.small_dev)
            elif zero is not None:
                zero(b.small_dev)
            elif case == "fill":
                b.small_dev.fill_(1.0)
            else:
                b.small_dev.copy_(b.small_host, non_blocking=True)
            b.small_dev.add_(1.0)
            end.record(prefix)
        marks.append((start, end))
        saved_marks.append(timed_on(side, start, lambda: b.saved_host.copy_(b.saved_dev, non_blocking=True)))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - begin
    moved = pipe.host.numel() * 4
    return {
        "case": case,
        "inputs": len(marks),
        "latency_ms": spread(marks),
        "saved_latency_ms": spread(saved_marks),
        "seconds": round(elapsed, 3),
        "state_gb_each_way": round(moved / 1e9, 2),
        "state_gb_s_each_way": round(moved / elapsed / 1e9, 1) if streaming else None,
    }


def timed_on(stream: torch.cuda.Stream, after: torch.cuda.Event, work) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    """`work` on `stream` once `after` has happened there; events around it."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    stream.wait_event(after)
    with torch.cuda.stream(stream):
        start.record(stream)
        work()
        end.record(stream)
    return start, end


def spread(marks: list[tuple[torch.cuda.Event, torch.cuda.Event]]) -> dict[str, float]:
    """Median, 90th percentile and longest of the times between each pair of events, in ms."""
    ms = sorted(s.elapsed_time(e) for s, e in marks)
    return {
        "median": round(statistics.median(ms), 3),
        "p90": round(ms[int(0.9 * (len(ms) - 1))], 3),
        "max": round(ms[-1], 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES))
    ap.add_argument("--gib", type=int, default=16, help="state streamed each way")
    ap.add_argument("--chunk-mib", type=int, default=1024)
    ap.add_argument("--saved-mib", type=int, default=64, help="a saved tensor offloaded after each stretch")
    ap.add_argument("--small-kib", type=int, default=256, help="the prefix's input")
    ap.add_argument("--matmuls", type=int, default=8, help="4096^2 bf16 matmuls between two inputs")
    ap.add_argument("--min-inputs", type=int, default=50)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        sys.exit(f"link_queue: unknown cases {unknown}; choose from {list(CASES)}")
    if not torch.cuda.is_available():
        sys.exit("link_queue: needs a CUDA GPU (it times copies over the host link)")
    buffers, rows = Buffers.make(args), []
    for case in args.cases:
        try:
            rows.append(run_case(case, args, buffers))
        except (ValueError, ImportError) as e:  # triton refusing a pinned host pointer, no cupy: not here
            if case not in ("mapped", "memset"):
                raise
            rows.append({"case": case, "error": str(e).splitlines()[0]})
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args) | {"out": None}}
    result["command"] = "python bench/link_queue.py " + " ".join(sys.argv[1:])
    result["cases"] = rows
    head = "ms (median / p90 / max)"
    print(f"{'case':<8} {'inputs':>6}  {'input ' + head:<30} {'saved ' + head:<30} state GB/s")
    for r in rows:
        if "error" in r:
            print(f"{r['case']:<8} {r['error']}")
            continue
        lat, saved = (
            " / ".join(str(r[k][q]) for q in ("median", "p90", "max")) for k in ("latency_ms", "saved_latency_ms")
        )
        print(f"{r['case']:<8} {r['inputs']:>6}  {lat:<30} {saved:<30} {r['state_gb_s_each_way'] or '-'}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
