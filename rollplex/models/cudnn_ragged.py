"""cuDNN's fused attention over ragged segments, through cudnn-frontend: a `cascade.Kernels` that runs every segment
of a part in one call each way, whatever the segments' count and lengths.

What: a part's segments (query rows cu_q[i]:cu_q[i+1] over key rows cu_k[i]:cu_k[i+1], `cascade.Segments`) sit end
to end in q [T, H, D] and k, v [Tk, G, D]; cuDNN reads each segment where its ragged offsets say and masks past its
real lengths (a padding mask), so nothing is padded or copied. A graph's dimensions are capacities (`Capacity`:
segments, the longest segment's queries and keys, and the queries and keys of all segments together); the real
lengths ride in device tensors. The totals size the backward's float32 workspace (dq's accumulator, and dk and dv at
every query head before grouped heads sum): without them cuDNN sizes it as if every segment were the longest; the
key total shrinks it in one part and grows it in the other, so each backward keeps the smaller of two builds. Each
kernels object keeps its capacities, which start at a floor (the workload's: its prompts, group size, response and
prompt budgets) and only grow, to powers of two: a run builds its graphs once, before its first step
(`build_graphs`), where cuDNN's dense calls build a graph per shape and torch's variable-length cuDNN path one on
every call (docs/results.md, "The packed suffix's attention"). A capacity past a call's needs costs little (the
kernels stop at each segment's real lengths); segments past the real ones have no queries and no keys.

Why: FlexAttention runs the packed suffix at about 0.3 of peak; cuDNN's kernels run its prompt part at 0.65-0.77
(`bench/flex_suffix.py`). cudnn-frontend is NVIDIA's own Python binding of cuDNN's graph API, kept beside cuDNN;
it is an optional dependency (`pip install rollplex[gpu]`): without it, or off a GPU, scoring stays on
FlexAttention (`ragged_attention_available`).

Layouts (the cascade's): queries and outputs [T, H, D], keys and values [Tk, G, D] with H a multiple of G,
log-sum-exps [H, T] float32 (cuDNN's statistics are [T, H]: a transposed view each way).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib.util import find_spec

import torch
from torch import Tensor

from rollplex.models.attention import Attention, PackedPrefixAttention
from rollplex.models.boundary import Boundary
from rollplex.models.cascade import PackedCascadeAttention, Segments
from rollplex.models.inputs import to_device
from rollplex.models.packed import ResponsePack

HEAD_DIMS = (64, 80, 96, 128)  # head sizes whose forward and backward cuDNN runs on Ampere and newer


def ragged_attention_available(device: torch.device) -> bool:
    """Whether `CudnnRaggedKernels` can run on `device`: a CUDA GPU and cudnn-frontend installed."""
    return device.type == "cuda" and find_spec("cudnn") is not None


@dataclass(frozen=True)
class Capacity:
    """What a graph holds: segments, queries and keys of the longest segment, and of all segments together."""

    segments: int = 1
    max_q: int = 1
    max_k: int = 1
    total_q: int = 1
    total_k: int = 1

    def holding(self, s: Segments) -> Capacity:
        """This capacity, grown to powers of two where `s` needs more."""
        need = (len(s.q_lens), s.max_q, s.max_k, sum(s.q_lens), sum(s.k_lens))
        have = (self.segments, self.max_q, self.max_k, self.total_q, self.total_k)
        return Capacity(*(h if h >= n else _capacity(n) for h, n in zip(have, need, strict=True)))


@dataclass(frozen=True)
class _Shape:
    """What one graph is built for: the part's heads and dtype, and its capacities."""

    device: int
    dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    causal: bool
    scale: float
    segments: int
    max_q: int
    max_k: int
    total_q: int
    total_k: int
    deterministic: bool = False  # the backward without atomics: run to run, the same gradients bit for bit


class CudnnRaggedKernels:
    """`cascade.Kernels` on cuDNN: forward and backward of all of a part's segments in one graph call each.
    `causal` must match the segments' (query i of a segment sees keys up to i, equal lengths); `floor`: the
    capacity its graphs start at; `deterministic`: the backward on cuDNN's deterministic kernels (no atomics in its
    accumulation: reruns give the same gradients bit for bit)."""

    def __init__(self, causal: bool, floor: Capacity = Capacity(), deterministic: bool = False) -> None:
        self.causal, self.capacity, self.deterministic = causal, floor, deterministic

    @staticmethod
    def takes(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
        """Whether cuDNN runs attention of this dtype and head size on `device`: 16 bits on a GPU, a listed size."""
        return ragged_attention_available(device) and dtype in (torch.bfloat16, torch.float16) and head_dim in HEAD_DIMS

    def forward(self, q: Tensor, k: Tensor, v: Tensor, s: Segments, scale: float) -> tuple[Tensor, Tensor, tuple]:
        """(out, lse, saved): saved is the call's graph shape and device lengths, which its backward reuses."""
        assert s.causal == self.causal, "a part's kernels and its segments disagree on the causal mask"
        assert s.q_lens, "cuDNN's ragged call takes segments made from host lengths (`Segments.of`)"
        self.capacity = self.capacity.holding(s)
        shape = self._shape(q, k, scale)
        lens = _Lengths.of(s, shape.segments, q.shape[1], k.shape[1], q.shape[-1], q.device)
        out = torch.empty_like(q)
        stats = q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)  # [T, H]
        _graph(shape, False).run({"q": q, "k": k, "v": v, "o": out, "stats": stats, **lens.by_name}, q.device)
        return out, stats.T, (shape, lens)

    def backward(self, dout, q, k, v, out, lse, s: Segments, scale: float, saved: tuple):
        shape, lens = saved
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        tensors = {"q": q, "k": k, "v": v, "o": out.to(q.dtype), "do": dout, "stats": lse.T.contiguous()}
        _graph(shape, True).run({**tensors, "dq": dq, "dk": dk, "dv": dv, **lens.by_name}, q.device)
        return dq, dk, dv

    def _shape(self, q: Tensor, k: Tensor, scale: float) -> _Shape:
        return self.shape(q.device, q.dtype, q.shape[1], k.shape[1], q.shape[-1], scale)

    def shape(
        self, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, scale: float
    ) -> _Shape:
        """The graph shape of a call with these heads at the kernels' current capacity."""
        c = self.capacity
        return _Shape(
            device=device.index or 0, dtype=dtype, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
            causal=self.causal, scale=scale, segments=c.segments, max_q=c.max_q, max_k=c.max_k, total_q=c.total_q,
            total_k=c.total_k, deterministic=self.deterministic,
        )  # fmt: skip


SuffixKernels = tuple["CudnnRaggedKernels", "CudnnRaggedKernels"]  # the prompt part's, the own part's


def suffix_kernels(
    prompts: int, samples: int, response_tokens: int, prompt_tokens: int, deterministic: bool = False
) -> SuffixKernels:
    """The kernels of `PackedCascadeAttention`'s two parts, their graphs built for batches of up to `prompts`
    prompts' groups of `samples` responses of `response_tokens` (a batch of a group's tokens, N x R, in all), over
    prompts of `prompt_tokens` (a model scores on them once its `suffix_kernels` holds them; larger batches grow
    them); `deterministic`: both backwards on cuDNN's deterministic kernels."""
    group = samples * response_tokens
    prompt_floor = Capacity(prompts, group, prompt_tokens, group, prompts * prompt_tokens)
    own_floor = Capacity(prompts * samples, response_tokens, response_tokens, group, group)
    return (
        CudnnRaggedKernels(causal=False, floor=prompt_floor, deterministic=deterministic),
        CudnnRaggedKernels(causal=True, floor=own_floor, deterministic=deterministic),
    )


def build_graphs(
    kernels: SuffixKernels, device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> int:
    """Builds both parts' graphs, forward and backward, at their current capacities (the floors, before a first
    call) for q [T, heads, head_dim] and keys [Tk, kv_heads, head_dim], and returns the largest workspace one of
    them takes (bytes; a call allocates its graph's workspace while it runs): a cuDNN that refuses these shapes
    raises here (cuDNN's error), before a step's first scoring call, and the first call finds its graphs built. A
    device without an index is the current one, where the model's tensors go."""
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    shapes = [part.shape(device, dtype, heads, kv_heads, head_dim, head_dim**-0.5) for part in kernels]
    return max(_graph(shape, backward).workspace for shape in shapes for backward in (False, True))


def scoring_attention(
    boundary: Boundary, pack: ResponsePack, kernels: SuffixKernels | None, x: Tensor, head_dim: int
) -> Attention:
    """A scoring batch's attention (x: its embeddings): the cascade on cuDNN's ragged calls where `kernels` are set
    and cuDNN takes x's dtype and the model's head size on x's device, else FlexAttention (a GPU) or SDPA with a
    dense mask (the CPU)."""
    if kernels is not None and CudnnRaggedKernels.takes(x.device, x.dtype, head_dim):
        return PackedCascadeAttention(boundary, pack, kernels)
    return PackedPrefixAttention(boundary, pack)


@dataclass(frozen=True)
class _Lengths:
    """A call's per-segment device tensors: lengths [n, 1, 1, 1] int32 and element offsets [n + 1, 1, 1, 1] int64,
    padded to the graph's n segments with empty segments at the end."""

    q_lens: Tensor
    k_lens: Tensor
    q_offsets: Tensor  # of q, o, do and dq: token offset x H x D
    k_offsets: Tensor  # of k, v, dk and dv: x G x D
    stats_offsets: Tensor  # of the statistics: x H

    @staticmethod
    def of(s: Segments, n: int, heads: int, kv_heads: int, head_dim: int, device: torch.device) -> _Lengths:
        q_lens = list(s.q_lens) + [0] * (n - len(s.q_lens))
        k_lens = list(s.k_lens) + [0] * (n - len(s.k_lens))
        lens = torch.tensor([q_lens, k_lens], dtype=torch.int64)
        starts = torch.nn.functional.pad(lens.cumsum(1), (1, 0))  # [2, n + 1] token offsets
        widths = torch.tensor([[heads * head_dim], [kv_heads * head_dim], [heads]])
        offsets = torch.cat([starts, starts[:1]]) * widths  # [3, n + 1]: q, k, stats
        packed = to_device(
            torch.cat([lens.flatten(), offsets.flatten()]), device
        )  # one copy the host does not wait for
        q_lens_d, k_lens_d = packed[:n].int(), packed[n : 2 * n].int()
        q_off, k_off, stats_off = packed[2 * n :].view(3, n + 1)
        view = (-1, 1, 1, 1)
        return _Lengths(
            q_lens_d.view(view), k_lens_d.view(view), q_off.view(view), k_off.view(view), stats_off.view(view)
        )

    @property
    def by_name(self) -> dict[str, Tensor]:
        """The tensors under the names of a graph's tensors (`_graph`): each ragged tensor's offsets, the lengths."""
        q, k = self.q_offsets, self.k_offsets
        offsets = {"q_off": q, "o_off": q, "do_off": q, "k_off": k, "v_off": k, "stats_off": self.stats_offsets}
        return {"q_lens": self.q_lens, "k_lens": self.k_lens, **offsets}


def _capacity(n: int) -> int:
    """n rounded up to a power of two (at least 1)."""
    return 1 << max(0, n - 1).bit_length()


class _Graph:
    """One built cuDNN graph and its tensors by name (`_graph`)."""

    def __init__(self, graph, tensors: dict, workspace: int) -> None:
        self.graph, self.tensors, self.workspace = graph, tensors, workspace

    def run(self, values: dict[str, Tensor], device: torch.device) -> None:
        import cudnn

        handle = _handle(device.index or 0)
        cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        pack = {t: values[name] for name, t in self.tensors.items()}
        workspace = torch.empty(self.workspace, dtype=torch.uint8, device=device)
        self.graph.execute(pack, workspace, handle=handle)


@cache
def _handle(device: int):
    import cudnn

    with torch.cuda.device(device):
        return cudnn.create_handle()


@cache
def _graph(shape: _Shape, backward: bool, /) -> _Graph:
    """The forward or backward graph of `shape`, built once per process. Positional only: the cache keys a
    keyword call apart from a positional one, which would build the graph again. The backward is built twice, told
    both totals and the query total alone, and keeps the smaller workspace: told the key total, cuDNN sizes the
    own part's smaller and the prompt part's larger (its keys are the prompts', many more than its queries),
    with kernels of equal time (docs/results.md, "The packed suffix's attention on cuDNN's ragged calls"). A build
    cuDNN refuses (`_refusal`) leaves the other; both refused raise the second's error; any other error is raised."""
    if not backward:
        return _build(shape, False, key_total=False)
    builds, refused = [], None
    for told in (True, False):
        try:
            builds.append(_build(shape, True, key_total=told))
        except Exception as error:
            if not _refusal(error):
                raise
            refused = error
    if not builds:
        raise refused
    return min(builds, key=lambda g: g.workspace)


def _refusal(error: Exception) -> bool:
    """Whether `error` is cuDNN refusing a graph: its "not supported" error, or the RuntimeError cudnn-frontend raises
    for a graph it cannot validate or build. A TypeError or AttributeError is a bug in the build, not a refusal."""
    if isinstance(error, RuntimeError):
        return True
    import cudnn

    return isinstance(error, cudnn.cudnnGraphNotSupportedError)


def _build(shape: _Shape, backward: bool, key_total: bool) -> _Graph:
    """A forward or backward graph of `shape`; key_total: the backward is told the keys' total (the queries' always)."""
    import cudnn

    io = cudnn.data_type.BFLOAT16 if shape.dtype == torch.bfloat16 else cudnn.data_type.HALF
    graph = cudnn.pygraph(
        io_data_type=io, intermediate_data_type=cudnn.data_type.FLOAT, compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(shape.device),
    )  # fmt: skip
    n, d = shape.segments, shape.head_dim
    tensors: dict = {}

    def offsets(name: str):
        tensors[name] = graph.tensor(
            name=name, dim=[n + 1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT64
        )
        return tensors[name]

    def ragged(name: str, heads: int, length: int, out=None):
        """A [n, heads, length, d] tensor whose segments lie end to end as [tokens, heads, d] rows."""
        dim, stride = [n, heads, length, d], [heads * d, d, heads * d, 1]
        t = out if out is not None else graph.tensor(name=name, dim=dim, stride=stride, data_type=io)
        if out is not None:
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io)
        t.set_ragged_offset(offsets(name + "_off"))
        tensors[name] = t
        return t

    def stats_tensor(t):
        """The statistics as [tokens, heads] float32 rows, end to end."""
        t.set_dim([n, shape.heads, shape.max_q, 1]).set_stride([shape.heads, 1, shape.heads, 1])
        t.set_data_type(cudnn.data_type.FLOAT).set_ragged_offset(offsets("stats_off"))
        tensors["stats"] = t
        return t

    lens = [
        graph.tensor(name=name, dim=[n, 1, 1, 1], stride=[1, 1, 1, 1], data_type=cudnn.data_type.INT32)
        for name in ("q_lens", "k_lens")
    ]
    tensors["q_lens"], tensors["k_lens"] = lens
    q = ragged("q", shape.heads, shape.max_q)
    k = ragged("k", shape.kv_heads, shape.max_k)
    v = ragged("v", shape.kv_heads, shape.max_k)
    common = dict(
        attn_scale=shape.scale, use_padding_mask=True, seq_len_q=lens[0], seq_len_kv=lens[1],
        use_causal_mask=shape.causal,
    )  # fmt: skip
    if not backward:
        o, stats = graph.sdpa(name="forward", q=q, k=k, v=v, generate_stats=True, **common)
        ragged("o", shape.heads, shape.max_q, out=o)
        stats_tensor(stats.set_output(True))
    else:
        o = ragged("o", shape.heads, shape.max_q)
        do = ragged("do", shape.heads, shape.max_q)
        stats = stats_tensor(
            graph.tensor(name="stats", dim=[n, shape.heads, shape.max_q, 1], stride=[1, 1, 1, 1],
                         data_type=cudnn.data_type.FLOAT)
        )  # fmt: skip
        totals = {"max_total_seq_len_q": shape.total_q} | ({"max_total_seq_len_kv": shape.total_k} if key_total else {})
        if shape.deterministic:  # asked for only then: the default build stays the one cuDNN has always chosen
            totals["use_deterministic_algorithm"] = True
        dq, dk, dv = graph.sdpa_backward(name="backward", q=q, k=k, v=v, o=o, dO=do, stats=stats, **totals, **common)
        for name, t, heads, length in (
            ("dq", dq, shape.heads, shape.max_q), ("dk", dk, shape.kv_heads, shape.max_k),
            ("dv", dv, shape.kv_heads, shape.max_k),
        ):  # fmt: skip
            dim, stride = [n, heads, length, d], [heads * d, d, heads * d, 1]
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(io)
            t.set_ragged_offset(tensors["q_off" if name == "dq" else "k_off"])
            tensors[name] = t
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return _Graph(graph, tensors, graph.get_workspace_size())
