"""Attention over two key sets, each a dense variable-length call, merged by their log-sum-exps.

What it is: the packed suffix's attention (`PackedPrefixAttention`) as two parts without a mask: each prompt's
response tokens over that prompt's keys, and each response's tokens over its own earlier ones (causal). Each
part returns its output and its log-sum-exp per query and head; the whole softmax is their weighted sum
(FlashAttention's split-KV combine). Backward runs each part's backward with the merged output and log-sum-exp,
which makes every part's probabilities those of the whole softmax (as ring attention does), so the two key
sets' gradients are exact and the query's is their sum.

Why: a masked single call (FlexAttention with a block mask) runs these shapes well below a dense kernel's speed
(`bench/flex_suffix.py`); each part here is plain variable-length attention, so the cascade is as fast as the
dense kernels it is given. The runtime scores on it with cuDNN's ragged kernels (`cudnn_ragged.py`, which picks
between it and FlexAttention); FlashAttention 2's kernels (not tuned for Hopper) gain less (docs/results.md). The
two parts' outputs merge in one kernel on a GPU (`merged`).

Kernels: on a GPU FlashAttention's variable-length forward and backward (`torch.ops.aten._flash_attention_*`,
which take fewer key heads than query heads); elsewhere `ReferenceKernels`, the same contract in plain torch.
Each part may have its own: `PaddedDenseKernels` runs a part without a mask as one dense call per segment
(cuDNN's on a GPU, `CUDNN_PADDED`), padded to few shapes. Layouts (FlashAttention's): queries [T, H, D], keys
and values [Tk, G, D] with H a multiple of G; a part's segments are `cu_q` / `cu_k` int32 offsets (and their
lengths on the host); log-sum-exps are [H, T] float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from rollplex.models.inputs import to_device

if TYPE_CHECKING:
    from rollplex.models.boundary import Boundary
    from rollplex.models.packed import ResponsePack


@dataclass(frozen=True)
class Segments:
    """Query rows cu_q[i]:cu_q[i+1] attend to key rows cu_k[i]:cu_k[i+1] (causal: aligned at their ends)."""

    cu_q: Tensor  # [n + 1] int32
    cu_k: Tensor  # [n + 1] int32
    max_q: int
    max_k: int
    causal: bool
    q_lens: tuple[int, ...] = ()  # on the host, for kernels that loop over segments
    k_lens: tuple[int, ...] = ()

    @staticmethod
    def of(q_lens: list[int], k_lens: list[int], causal: bool, device: torch.device) -> Segments:
        """From host lengths; every segment needs a query and a key."""
        if len(q_lens) != len(k_lens) or not q_lens or min(q_lens) < 1 or min(k_lens) < 1:
            raise ValueError(f"segments need >= 1 query and key each, got {q_lens} and {k_lens}")
        offsets = [
            to_device(torch.tensor([0, *accumulate(lens)], dtype=torch.int32), device) for lens in (q_lens, k_lens)
        ]
        return Segments(offsets[0], offsets[1], max(q_lens), max(k_lens), causal, tuple(q_lens), tuple(k_lens))


class Kernels(Protocol):
    def forward(self, q: Tensor, k: Tensor, v: Tensor, s: Segments, scale: float) -> tuple[Tensor, Tensor, tuple]:
        """(out [T, H, D], lse [H, T] float32, what backward needs of this call)."""

    def backward(
        self, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, s: Segments, scale: float,
        saved: tuple,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """(dq, dk, dv) with probabilities exp(scores - lse) and D = rowsum(dout * out), for the given out/lse."""


def cascade_attention(
    q: Tensor, parts: list[tuple[Tensor, Tensor, Segments]], kernels: Kernels | Sequence[Kernels] | None = None
) -> Tensor:
    """Softmax attention of q [T, H, D] over every part's keys at once: [T, H, D]. kernels: one for every part,
    or one a part."""
    kernels = kernels or (FLASH if q.is_cuda else REFERENCE)
    each = list(kernels) if isinstance(kernels, Sequence) else [kernels] * len(parts)
    flat = [t for k, v, _ in parts for t in (k, v)]
    return _Cascade.apply(q, each, [s for _, _, s in parts], q.shape[-1] ** -0.5, *flat)


class PackedCascadeAttention:
    """`PackedPrefixAttention`'s contract (q [1, H, M, D], k/v [1, G, M, D] of a pack's tokens -> [1, H, M, D])
    as two parts: each run of consecutive tokens answering one prompt over that prompt's real boundary keys, and
    each response over its own earlier tokens. A prompt read by several runs has its keys gathered once per run;
    autograd sums their gradients into the one boundary KV. Host lengths come from the pack and one read of the
    boundary's prompt lengths."""

    def __init__(
        self, boundary: Boundary, pack: ResponsePack, kernels: Kernels | Sequence[Kernels] | None = None
    ) -> None:
        """kernels: as `cascade_attention`'s, the prompts' part first."""
        self.boundary, self.kernels, device = boundary, kernels, pack.index.device
        lens, span = list(boundary.host_prompt_lens) or boundary.prompt_lens.tolist(), boundary.max_prompt_len
        runs: list[list[int]] = []  # [prompt, tokens] of each run of responses answering one prompt
        for prompt, count in zip(pack.rows, pack.counts, strict=True):
            if count and runs and runs[-1][0] == prompt:
                runs[-1][1] += count
            elif count:
                runs.append([prompt, count])
        own = [c for c in pack.counts if c]
        self.prompt_rows = to_device(torch.cat([torch.arange(p * span, p * span + lens[p]) for p, _ in runs]), device)
        self.prompts = Segments.of([n for _, n in runs], [lens[p] for p, _ in runs], False, device)
        self.own = Segments.of(own, own, True, device)

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        prompt_kv = [self._prompt_rows(x[layer]) for x in (self.boundary.keys, self.boundary.values)]
        own_kv = [x[0].transpose(0, 1).contiguous() for x in (k, v)]
        parts = [(*prompt_kv, self.prompts), (*own_kv, self.own)]
        return cascade_attention(q[0].transpose(0, 1).contiguous(), parts, self.kernels).transpose(0, 1)[None]

    def _prompt_rows(self, x: Tensor) -> Tensor:
        """A layer's boundary K or V [P, G, S, D] -> each run's prompt's real rows, end to end, [Tk, G, D]."""
        return x.transpose(1, 2).flatten(0, 1).index_select(0, self.prompt_rows)


class _Cascade(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, kernels: list[Kernels], segments: list[Segments], scale: float, *kv: Tensor) -> Tensor:
        outs = [kernels[i].forward(q, kv[2 * i], kv[2 * i + 1], s, scale) for i, s in enumerate(segments)]
        out, lse = merged([(o, part_lse) for o, part_lse, _ in outs], q.dtype)
        ctx.kernels, ctx.segments, ctx.scale, ctx.saved = kernels, segments, scale, [s for _, _, s in outs]
        ctx.save_for_backward(q, out, lse, *kv)
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, out, lse, *kv = ctx.saved_tensors
        dout, dq, dkv = dout.contiguous(), None, []
        for i, s in enumerate(ctx.segments):
            grads = ctx.kernels[i].backward(dout, q, kv[2 * i], kv[2 * i + 1], out, lse, s, ctx.scale, ctx.saved[i])
            dq = grads[0] if dq is None else dq + grads[0]
            dkv += grads[1:]
        return dq, None, None, None, *dkv


def merged(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The whole softmax's output [T, H, D] in `dtype` and log-sum-exp [H, T] float32 from each part's (out, lse):
    each output weighted by e^(its lse - the whole's). Every query has keys in some part (the cascade's own part
    holds its token). Two parts on a GPU merge in one kernel (`kernels.lse_merge`); elsewhere in torch ops, in
    float32 (`torch_merged`)."""
    if len(parts) == 2 and parts[0][0].is_cuda:
        from rollplex.kernels.lse_merge import merge_two

        return merge_two(*parts[0], *parts[1], dtype)
    return torch_merged(parts, dtype)


def torch_merged(parts: list[tuple[Tensor, Tensor]], dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """`merged` in torch ops on any device (the form its kernel replaces on a GPU)."""
    lse = torch.logsumexp(torch.stack([part_lse for _, part_lse in parts]), dim=0)
    return sum(o.float() * (part_lse - lse).exp().T[..., None] for o, part_lse in parts).to(dtype), lse


class FlashKernels:
    """FlashAttention 2's variable-length kernels as torch ships them (fewer key heads than query heads allowed).
    Its log-sum-exps of a variable-length call are [H, T]."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, s: Segments, scale: float) -> tuple[Tensor, Tensor, tuple]:
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, s.causal, False, scale=scale
        )
        return out, lse, (rng, unused)

    def backward(self, dout, q, k, v, out, lse, s: Segments, scale: float, saved: tuple):
        rng, unused = saved
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, s.cu_q, s.cu_k, s.max_q, s.max_k, 0.0, s.causal, rng, unused, scale=scale
        )


class ReferenceKernels:
    """The same contract in plain torch, segment by segment (the CPU's kernels and the GPU tests' oracle)."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, s: Segments, scale: float) -> tuple[Tensor, Tensor, tuple]:
        out, lse = torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        for (a, b), (c, d) in _bounds(s):
            scores = _scores(q[a:b], k[c:d], s.causal, scale)  # [H, n, m] float32
            lse[:, a:b] = scores.logsumexp(-1)
            p = (scores - lse[:, a:b, None]).exp()
            out[a:b] = torch.einsum("hnm,mhd->nhd", p, _heads(v[c:d], q.shape[1]).float()).to(q.dtype)
        return out, lse, ()

    def backward(self, dout, q, k, v, out, lse, s: Segments, scale: float, saved: tuple):
        dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
        heads, group = q.shape[1], q.shape[1] // k.shape[1]
        for (a, b), (c, d) in _bounds(s):
            p = (_scores(q[a:b], k[c:d], s.causal, scale) - lse[:, a:b, None]).exp()  # [H, n, m]
            do, vh, kh = dout[a:b].float(), _heads(v[c:d], heads).float(), _heads(k[c:d], heads).float()
            dp = torch.einsum("nhd,mhd->hnm", do, vh)
            ds = p * (dp - (do * out[a:b].float()).sum(-1).T[..., None])
            dq[a:b] = torch.einsum("hnm,mhd->nhd", ds, kh) * scale
            dk_h = torch.einsum("hnm,nhd->mhd", ds, q[a:b].float()) * scale
            dv_h = torch.einsum("hnm,nhd->mhd", p, do)
            dk[c:d] = dk_h.unflatten(1, (-1, group)).sum(2)
            dv[c:d] = dv_h.unflatten(1, (-1, group)).sum(2)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class PaddedDenseKernels:
    """A part without a mask as one dense call per segment (`DenseCall`: cuDNN's on a GPU), each segment's
    queries padded with zero rows to the next of `query_bucket` x 1, 1.25, 1.5, 1.75, 2, 2.5, ... (four sizes a
    doubling: at most a quarter more rows) and its keys and values with zero rows to a whole `key_bucket`, so
    that a kernel built for each shape it meets (cuDNN builds a graph per shape, tens of milliseconds) meets
    few.

    A zero key scores 0 against every query and a zero value adds nothing to the output: with n padded keys the
    call's log-sum-exp is log(Z + n) for the segment's own log(Z), which is recovered as lse + log1p(-n e^-lse)
    (exact in float32 unless every real score is far below zero, Z < 1e-6 n), and its output is the call's times
    e^(lse_call - lse). Backward is given the whole softmax's output and log-sum-exp: a zero key adds nothing to
    dq and the padded keys' own gradients are dropped, so it is exact. Padded queries have zero gradient in,
    zero output and a log-sum-exp of 0; their rows are dropped."""

    def __init__(self, dense: DenseCall, query_bucket: int = 256, key_bucket: int = 512) -> None:
        self.dense, self.query_bucket, self.key_bucket = dense, query_bucket, key_bucket

    def forward(self, q: Tensor, k: Tensor, v: Tensor, s: Segments, scale: float) -> tuple[Tensor, Tensor, tuple]:
        assert not s.causal, "padded dense calls take a part without a mask"
        out = q.new_empty(q.shape, dtype=torch.promote_types(q.dtype, torch.float32))
        lse = q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
        saved = []
        for (a, b), (c, d) in _bounds(s):
            rows, keys = _bucket(b - a, self.query_bucket), -(-(d - c) // self.key_bucket) * self.key_bucket
            call_out, call_lse, call = self.dense.forward(
                padded_rows(q[a:b], rows), padded_rows(k[c:d], keys), padded_rows(v[c:d], keys), scale
            )
            call_lse = call_lse[:, : b - a]
            own = call_lse + torch.log1p(-(keys - (d - c)) * torch.exp(-call_lse))
            out[a:b] = call_out[: b - a].float() * torch.exp(call_lse - own).T[..., None]
            lse[:, a:b] = own
            saved.append(call)
        return out, lse, tuple(saved)

    def backward(self, dout, q, k, v, out, lse, s: Segments, scale: float, saved: tuple):
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        for ((a, b), (c, d)), call in zip(_bounds(s), saved, strict=True):
            rows, keys = _bucket(b - a, self.query_bucket), -(-(d - c) // self.key_bucket) * self.key_bucket
            grads = self.dense.backward(
                padded_rows(dout[a:b], rows), padded_rows(q[a:b], rows), padded_rows(k[c:d], keys),
                padded_rows(v[c:d], keys), padded_rows(out[a:b], rows), padded_rows(lse[:, a:b].T, rows).T,
                scale, call,
            )  # fmt: skip
            dq[a:b], dk[c:d], dv[c:d] = grads[0][: b - a], grads[1][: d - c], grads[2][: d - c]
        return dq, dk, dv


class DenseCall(Protocol):
    """Attention of one segment's queries over its keys, q [n, H, D], k and v [m, G, D]: every key, or (a causal
    call, n = m) query i over keys 0..i."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
        """(out [n, H, D], lse [H, n] float32, what backward needs of this call)."""

    def backward(self, dout, q, k, v, out, lse, scale: float, saved: tuple) -> tuple[Tensor, Tensor, Tensor]:
        """(dq, dk, dv) with probabilities exp(scores - lse) and D = rowsum(dout * out), for the given out/lse."""

    def takes(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Whether the call runs tensors of these dtypes and head sizes (q [n, H, D], k and v [m, G, D])."""


CUDNN_FIRST = 91501  # SDPA runs attention on cuDNN first from 9.15.1 (older ones gave wrong results at some lengths)


class CudnnDense:
    """cuDNN's fused attention as torch ships it (`torch.ops.aten._scaled_dot_product_cudnn_attention` and its
    backward), on [1, heads, length, D] views of the [length, heads, D] rows (the layout cuDNN reads best). Keys
    and values go in with their own G heads where this torch's cuDNN path takes that (found at the first call),
    else repeated to H heads and their gradients summed back. `causal`: query i sees keys 0..i (equal lengths)."""

    def __init__(self, causal: bool = False) -> None:
        self.causal = causal
        self.grouped: bool | None = None  # whether cuDNN takes fewer key heads than query heads

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
        if self.grouped is None:
            try:
                out = self._forward(q, k, v, scale, grouped=True)
                self.grouped = True
                return out
            except RuntimeError:
                self.grouped = False
        return self._forward(q, k, v, scale, self.grouped)

    def takes(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Where SDPA would run these tensors on cuDNN in training: a cuDNN that SDPA puts first (`CUDNN_FIRST`),
        and its checks passed by such inputs requiring grad (so that a checkpoint's first pass, without grad, and
        its rerun get the same answer). Called directly, cuDNN's kernels run what its checks refuse: float32 comes
        back NaN without an error."""
        version = torch.backends.cudnn.version() if q.is_cuda else None
        if version is None or version < CUDNN_FIRST:
            return False
        params = torch.backends.cuda.SDPAParams(
            *(_bhsd(x.detach().requires_grad_()) for x in (q, k, v)), None, 0.0, self.causal, True
        )
        return torch.backends.cuda.can_use_cudnn_attention(params, False)

    def _forward(self, q, k, v, scale: float, grouped: bool) -> tuple[Tensor, Tensor, tuple]:
        heads = q.shape[1]
        k, v = (x if grouped else _heads(x, heads) for x in (k, v))
        out, lse, *call = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhsd(q), _bhsd(k), _bhsd(v), None, True, 0.0, self.causal, False, scale=scale
        )
        return out[0].transpose(0, 1), lse.reshape(heads, -1), tuple(call[:6])

    def backward(self, dout, q, k, v, out, lse, scale: float, saved: tuple):
        heads, groups = q.shape[1], k.shape[1]
        kh, vh = (x if self.grouped else _heads(x, heads) for x in (k, v))
        cum_q, cum_k, max_q, max_k, seed, offset = saved
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            _bhsd(dout), _bhsd(q), _bhsd(kh), _bhsd(vh), _bhsd(out.to(q.dtype)), lse.contiguous().view(1, heads, -1, 1),
            seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, self.causal, scale=scale,
        )  # fmt: skip
        dq, dk, dv = (x[0].transpose(0, 1) for x in (dq, dk, dv))
        if not self.grouped:
            dk, dv = (x.unflatten(1, (groups, heads // groups)).sum(2) for x in (dk, dv))
        return dq, dk, dv


class MathDense:
    """`DenseCall` in plain torch (float32 inside): `PaddedDenseKernels`' oracle off a GPU. `causal`: as
    `CudnnDense`'s."""

    def __init__(self, causal: bool = False) -> None:
        self.causal = causal

    def takes(self, q: Tensor, k: Tensor, v: Tensor) -> bool:
        """Any tensors: plain torch runs every dtype and shape."""
        return True

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
        s = Segments.of([q.shape[0]], [k.shape[0]], self.causal, q.device)
        out, lse, _ = REFERENCE.forward(q, k, v, s, scale)
        return out, lse, (s,)

    def backward(self, dout, q, k, v, out, lse, scale: float, saved: tuple):
        return REFERENCE.backward(dout, q, k, v, out, lse, saved[0], scale, ())


def _bhsd(x: Tensor) -> Tensor:
    """[length, heads, D] -> [1, heads, length, D], a view."""
    return x[None].transpose(1, 2)


def padded_rows(x: Tensor, rows: int) -> Tensor:
    """x [n, ...] with zero rows appended up to `rows`."""
    missing = rows - x.shape[0]
    return torch.cat([x, x.new_zeros(missing, *x.shape[1:])]) if missing else x


def _bucket(n: int, first: int) -> int:
    """The smallest size >= n of first x (1, 1.25, 1.5, 1.75) x 2^k (whole rows, at least one)."""
    size = first
    while True:
        for quarter in range(4):
            candidate = max(1, size + size * quarter // 4)
            if candidate >= n:
                return candidate
        size *= 2


def _bounds(s: Segments) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    if s.q_lens:
        q, k = [0, *accumulate(s.q_lens)], [0, *accumulate(s.k_lens)]
    else:
        q, k = s.cu_q.tolist(), s.cu_k.tolist()
    return [((q[i], q[i + 1]), (k[i], k[i + 1])) for i in range(len(q) - 1)]


def _heads(x: Tensor, heads: int) -> Tensor:
    """[m, G, D] -> [m, H, D]: each key head repeated for its group of query heads."""
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def _scores(q: Tensor, k: Tensor, causal: bool, scale: float) -> Tensor:
    scores = torch.einsum("nhd,mhd->hnm", q.float(), _heads(k, q.shape[1]).float()) * scale
    if causal:  # aligned at the ends: query i of n sees keys up to i + m - n
        n, m = q.shape[0], k.shape[0]
        seen = torch.arange(m, device=q.device)[None, :] <= torch.arange(n, device=q.device)[:, None] + (m - n)
        scores = scores.masked_fill(~seen, float("-inf"))
    return scores


FLASH, REFERENCE = FlashKernels(), ReferenceKernels()
CUDNN_PADDED = PaddedDenseKernels(CudnnDense())
