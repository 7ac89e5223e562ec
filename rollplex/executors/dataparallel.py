"""Data parallelism: the step's prompt groups shared over DP ranks, each a whole replica of actor and reference.

    torchrun --nproc-per-node 2 -m rollplex run specs/tiny_cpu_dp2.yaml     # cluster: 2 GPUs, train_tp 1

Each rank takes its share of the step's prompts (in rank order), rolls them out, scores them and backpropagates
them. What makes the run the one-process run of the same global batch:
- sampling: on a GPU each sequence's random numbers are keyed by its row in the step's whole batch (`rows`,
  `rollplex.kernels.sampling`); on the CPU each decode step draws the random numbers of every rank's rows and
  keeps its own (`rows`), and a rank whose responses end first draws on until the longest of the step's
  responses ended (`burn`), so every rank's generator follows the one-process run's;
- the loss is normalised by the whole step's tokens (or sequences), summed over ranks (`global_scale`), so that
  summing the ranks' gradients (`all_reduce_grads`, in buckets) gives the one-process gradient; the actor's are
  summed while its last backward of a mini-batch (the one through the prefix) still runs (`OverlappedSum`);
- metrics are reduced over the ranks before rank 0 writes them.
The optimizer state is replicated (each rank steps the same reduced gradients; rank 0 writes checkpoints), or
with `parallel.distributed_optimizer` sharded (ZeRO-1, `rollplex.memory.state_layout.Shard`): each rank updates
its share of the elements, sends their new values to the others, and checkpoints its share.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

BUCKET_BYTES = 32 * 2**20  # gradients all-reduced per flat bucket of FP32 values
IN_FLIGHT = 4  # buckets being summed at once (each holds a flat copy of its gradients until written back)


@dataclass(frozen=True)
class DataParallel:
    """`size` replicas; this process is in replica `rank`; `group` holds the ranks of every replica that share
    this process's tensor-parallel position (the world without tensor parallelism). With `minibatches` M, the
    step's prompts are M mini-batches and each rank takes its part of every one, so that its m-th local
    mini-batch is its part of the step's m-th (the one-process run's)."""

    size: int
    rank: int
    group: dist.ProcessGroup | None = None
    minibatches: int = 1
    device: torch.device | None = None  # where the collectives' tensors live (NCCL: this rank's GPU; gloo: None)

    def share(self, n: int) -> list[int]:
        """This rank's items (prompts) of n: the rank's part of each mini-batch's, in order."""
        block = n // self.minibatches
        per = block // self.size
        return [m * block + self.rank * per + i for m in range(self.minibatches) for i in range(per)]

    def rows(self, num_prompts: int, group_size: int) -> tuple[list[int], int]:
        """(this rank's rows, every rank's rows) in the step's global batch of prompt groups, rows p * N + n."""
        every = num_prompts * self.size
        return [p * group_size + n for p in self.share(every) for n in range(group_size)], every * group_size

    def sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.tolist()

    def max(self, value: float) -> float:
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def gather(self, t: Tensor) -> Tensor:
        """Every rank's `t` (the same shape but for the last dim, padded with zeros), concatenated on dim 0, on
        `t`'s device."""
        width = int(self.max(t.shape[-1]))
        padded = torch.nn.functional.pad(t, (0, width - t.shape[-1])).contiguous()
        sent = padded if self.device is None else padded.to(self.device)
        parts = [torch.empty_like(sent) for _ in range(self.size)]
        dist.all_gather(parts, sent, group=self.group)
        return torch.cat(parts).to(t.device)

    def all_reduce_grads(self, grads: list[Tensor]) -> None:
        """Sums each FP32 gradient over the ranks, in place, in flat buckets of at most BUCKET_BYTES."""
        bucket: list[Tensor] = []
        size = 0
        for g in grads:
            bucket.append(g)
            size += g.numel() * g.element_size()
            if size >= BUCKET_BYTES:
                _reduce_bucket(bucket, self.group)
                bucket, size = [], 0
        if bucket:
            _reduce_bucket(bucket, self.group)


def _reduce_bucket(grads: list[Tensor], group) -> None:
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    _unflatten(flat, grads)


def _unflatten(flat: Tensor, grads: list[Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


class OverlappedSum:
    """`all_reduce_grads` of an optimizer's gradients started while the last backward before its step runs, as
    torch's DDP does: the parameters in buckets of at most BUCKET_BYTES in the order a backward reaches them
    (the reverse of the model's), each bucket's sum launched (asynchronously) once the backward has accumulated
    the final gradient of every parameter in it. Armed (`arm`) just before that backward, it learns of each
    gradient through a hook that runs after the optimizer's own (which folds it into an FP32 main grad); `finish`,
    before the step, sums what the backward did not reach (gradients of earlier backwards only) and waits.

    A bucket's sum needs a flat copy of its gradients until it is written back: at most IN_FLIGHT of them are
    held (the oldest is waited for and written back before another is sent). `from_backward=False`, for a
    backward that accumulates a parameter more than once (the prefix's reruns: one accumulation per unit and
    prompt group, `rollplex.models.rerun`), so that no accumulation is known to be the last: every bucket is sent
    by `finish`."""

    def __init__(self, dp: DataParallel, optimizer, *, from_backward: bool = True) -> None:
        self.dp, self.optimizer, self.from_backward = dp, optimizer, from_backward
        self.buckets: list[list[int]] = []
        size = 0
        for i in reversed(range(len(optimizer.params))):
            if not optimizer.params[i].requires_grad:
                continue
            nbytes = 4 * optimizer.params[i].numel()  # an FP32 gradient
            if not self.buckets or size + nbytes > BUCKET_BYTES:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += nbytes
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._waiting: list[set[int]] = []
        self._sent: set[int] = set()  # buckets sent since `arm`
        self._launched: list[tuple] = []  # (work, flat, grads) of each bucket sent and not yet written back
        self._hooks: list = []
        self.launched_in_backward = 0  # buckets sent from the backward's hooks (the rest by `finish`)
        self.most_in_flight = 0  # the most flat copies held at once

    def arm(self) -> None:
        """Before the last backward: from now on a gradient the backward accumulates is final (unless
        `from_backward` is off: then `finish` sends everything)."""
        self._waiting = [set(bucket) for bucket in self.buckets]
        self._launched, self._sent, self.launched_in_backward = [], set(), 0
        if not self.from_backward:
            return
        self._hooks = [
            self.optimizer.params[i].register_post_accumulate_grad_hook(lambda _, i=i: self._reached(i))
            for bucket in self.buckets
            for i in bucket
        ]

    def finish(self) -> None:
        """Sends the buckets the backward left, waits for every sum and writes it into the gradients."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for b, waiting in enumerate(self._waiting):
            if waiting:
                self._send(b)
        while self._launched:
            self._write_back_oldest()
        self._waiting = []

    def _reached(self, i: int) -> None:
        b = self._bucket_of[i]
        if b in self._sent:  # its sum may be written back already: a later gradient would be summed twice
            raise RuntimeError(
                f"parameter {i} accumulated again after its bucket was summed: this backward accumulates a "
                "parameter more than once, so its OverlappedSum needs from_backward=False"
            )
        waiting = self._waiting[b]
        waiting.discard(i)
        if not waiting:
            self._send(b)
            self.launched_in_backward += 1

    def _send(self, b: int) -> None:
        self._waiting[b] = set()
        self._sent.add(b)
        grads = [g for g in (self.optimizer.grad_of(i) for i in self.buckets[b]) if g is not None]
        if grads:
            if len(self._launched) == IN_FLIGHT:
                self._write_back_oldest()
            flat = torch.cat([g.flatten() for g in grads])
            self._launched.append((dist.all_reduce(flat, group=self.dp.group, async_op=True), flat, grads))
            self.most_in_flight = max(self.most_in_flight, len(self._launched))

    def _write_back_oldest(self) -> None:
        work, flat, grads = self._launched.pop(0)
        work.wait()  # NCCL: the current stream waits; gloo: the host
        _unflatten(flat, grads)
