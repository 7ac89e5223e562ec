"""Weight-sharing classification between the trainer (TP t) and rollout (TP r = t / q) for every LLM tensor.

Layout algebra: a rank's shard of a column-parallel tensor is an ordered list of `Segment`s, runs of rows
of a logical component (q, k, v; gate, up; vocab rows), stored back to back. Training is laid out like
Megatron-Core (fused QKV interleaved per query group, fused gate/up per rank, row-parallel o/down);
rollout like vLLM (grouped QKV: all q, then k, then v). A rollout shard is bound over the q training
shards that cover it, concatenated in rank order. Then:

  Case 1  the concatenation equals the rollout order (identical or nested sharding, replicated tensors),
          or differs only by a block order the rollout kernel reads through a view of its GEMM output
          (gate/up: the gated activation pairs equal-size halves elementwise, per sub-shard)
  Case 2  row-parallel ([O, I] split on I): stored transposed ([I, O]) every shard is a contiguous slab
  Case 3  anything else (QKV with several query groups per rollout rank): the rollout layout is rebuilt
          in a separate buffer after each update

`bind_plan` below is the same code the runtime uses to bind parameters; the planner only sums it up.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from rollplex.layout.shapes import BF16, ParamFamily, Sharding, family_params_per_rank, llm_families
from rollplex.models.config import TextConfig


class Case(IntEnum):
    SHARED = 1
    TRANSPOSED = 2
    COPIED = 3


@dataclass(frozen=True, slots=True)
class Segment:
    component: str
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class Classified:
    family: ParamFamily
    case: Case
    reason: str


def merge(segments: list[Segment]) -> tuple[Segment, ...]:
    """Joins runs that continue each other (same component, stop == next start)."""
    out: list[Segment] = []
    for s in segments:
        if out and out[-1].component == s.component and out[-1].stop == s.start:
            out[-1] = Segment(s.component, out[-1].start, s.stop)
        else:
            out.append(s)
    return tuple(out)


def _kv_head_range(t: TextConfig, tp: int, rank: int) -> range:
    kv = t.num_key_value_heads
    if kv % tp == 0:
        return range(rank * kv // tp, (rank + 1) * kv // tp)
    return range(rank // (tp // kv), rank // (tp // kv) + 1)  # replicated KV head


def qkv_megatron(t: TextConfig, tp: int, rank: int) -> tuple[Segment, ...]:
    """Per query group g: its q heads, then k_g, then v_g (Megatron-Core's fused QKV)."""
    d, hpg = t.head_dim, t.heads_per_group
    heads = range(rank * t.num_attention_heads // tp, (rank + 1) * t.num_attention_heads // tp)
    segs: list[Segment] = []
    for g in _kv_head_range(t, tp, rank):
        qs = [h for h in heads if h // hpg == g]
        segs += [Segment("q", qs[0] * d, (qs[-1] + 1) * d), Segment("k", g * d, (g + 1) * d)]
        segs.append(Segment("v", g * d, (g + 1) * d))
    return merge(segs)


def qkv_vllm(t: TextConfig, tp: int, rank: int) -> tuple[Segment, ...]:
    """All of the rank's q heads, then its k heads, then its v heads (vLLM's QKVParallelLinear)."""
    d, n = t.head_dim, t.num_attention_heads
    kv = _kv_head_range(t, tp, rank)
    q = Segment("q", rank * n // tp * d, (rank + 1) * n // tp * d)
    return merge([q, Segment("k", kv[0] * d, (kv[-1] + 1) * d), Segment("v", kv[0] * d, (kv[-1] + 1) * d)])


def per_rank_components(rows: dict[str, int], tp: int, rank: int) -> tuple[Segment, ...]:
    """A fused tensor stored per rank as [component_1 shard; component_2 shard; ...] (gate/up, vocab)."""
    return merge([Segment(c, rank * n // tp, (rank + 1) * n // tp) for c, n in rows.items()])


def _layouts(f: ParamFamily, t: TextConfig):
    """(training layout, rollout layout) as functions (tp, rank) -> segments, for column-parallel families."""
    if f.name.startswith("qkv"):
        return (lambda tp, r: qkv_megatron(t, tp, r)), (lambda tp, r: qkv_vllm(t, tp, r))
    gate_up = {"gate": t.intermediate_size, "up": t.intermediate_size}
    rows = gate_up if f.name == "gate_up" else {"rows": f.shape[0]}
    layout = lambda tp, r: per_rank_components(rows, tp, r)  # noqa: E731
    return layout, layout


_VIEW_OK = {"gate_up"}  # rollout reads these through a per-sub-shard view of the GEMM output


def classify(f: ParamFamily, t: TextConfig, train_tp: int, rollout_tp: int) -> Classified:
    q = train_tp // rollout_tp
    if f.sharding is Sharding.REPLICATED:
        return Classified(f, Case.SHARED, "replicated in both engines")
    if f.sharding is Sharding.ROW:
        if q == 1:
            return Classified(f, Case.SHARED, "identical row-parallel shards")
        return Classified(f, Case.TRANSPOSED, f"row-parallel, stored [I, O]: {q} training slabs per rollout slab")
    train, rollout = _layouts(f, t)
    for k in range(rollout_tp):
        bound = merge([s for j in range(q) for s in train(train_tp, k * q + j)])
        if bound != rollout(rollout_tp, k):
            if f.name in _VIEW_OK:
                return Classified(f, Case.SHARED, f"nested: {q} per-rank [gate; up] blocks read through a view")
            return Classified(f, Case.COPIED, "head order differs (interleaved per group vs grouped)")
    return Classified(f, Case.SHARED, "identical or nested column shards")


@dataclass(frozen=True, slots=True)
class SharingReport:
    train_tp: int
    rollout_tp: int
    entries: tuple[Classified, ...]
    case_params: dict[int, int]  # case -> LLM parameters
    shared_bytes_per_gpu: int  # rollout-sized region (Case 1/2) + training shards of Case-3 tensors
    case3_buffer_bytes_per_gpu: int  # rollout-layout copies of Case-3 tensors
    train_shard_bytes_per_gpu: int  # the actor's BF16 LLM shard at training TP
    in_place: bool = False  # Case-3 tensors read where training writes them (no buffer)
    exchange_bytes_per_gpu: int = 0  # what a GPU receives from its q - 1 peers when an update is published

    @property
    def total_params(self) -> int:
        return sum(self.case_params.values())

    def percent(self, case: int) -> float:
        return 100.0 * self.case_params[case] / self.total_params


def sharing_report(t: TextConfig, train_tp: int, rollout_tp: int, *, in_place: bool = False) -> SharingReport:
    """The classification and its bytes per GPU. `in_place` (`parallel.qkv_sharing: in_place`): rollout reads the
    Case-3 tensors where training writes them, so they join the shared storage and no copy exists; otherwise
    (the paper's path) their training shards stay apart and rollout holds a grouped copy."""
    entries = tuple(classify(f, t, train_tp, rollout_tp) for f in llm_families(t))
    params = {c: sum(e.family.params for e in entries if e.case == c) for c in (1, 2, 3)}
    shared = case3 = train = exchange = 0
    q = train_tp // rollout_tp
    for e in entries:
        at_train = family_params_per_rank(e.family, t, train_tp) * BF16
        at_rollout = family_params_per_rank(e.family, t, rollout_tp) * BF16
        train += at_train
        if e.family.sharding is not Sharding.REPLICATED:
            exchange += at_rollout * (q - 1) // q  # the other training ranks' regions of the rollout shard
        if e.case is Case.COPIED and not in_place:
            shared, case3 = shared + at_train, case3 + at_rollout
        else:
            shared += at_rollout
    return SharingReport(train_tp, rollout_tp, entries, params, shared, case3, train, in_place, exchange)
