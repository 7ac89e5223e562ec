"""Decode attention over a shared prompt (cascade attention): one query token per sequence, N sequences per
prompt, each attending to its prompt's KV (shared by the group, read once for all N) and to its own response KV.

Two launches, split over keys so that a handful of prompts still fill the GPU (flash-decoding):

- `partial_kernel`, one program per chunk of keys, of two kinds: (prompt p, kv-head group g, prompt chunk):
  the queries of every live sequence of p in group g (N x heads-per-group rows, one tensor-core tile) against
  the chunk of the prompt's keys; (row, g, own chunk): one sequence's heads of group g against a chunk of its
  own response cache.
- `combine_kernel`, grid (rows, kv heads): merges every chunk's partial output through its log-sum-exp.

Batch rows are sorted by cache slot, so the rows of prompt p are `row_start[p] .. row_start[p] + row_count[p]`
(slot s belongs to prompt s // N). Every partial a kernel owns is written, empty chunks as (0, -inf), so no
stale value is ever merged. Shapes are fixed per batch size; lengths come from device tensors (graph-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from rollplex.kernels.tiles import NUM_SMS_H200


@triton.jit
def _attend_chunk(
    q,
    k_ptrs,
    v_ptrs,
    stride_k,
    stride_v,
    key_at,
    length,
    scale,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
    M: tl.constexpr,
    D: tl.constexpr,
):
    """Online softmax of queries q [M, D] over the keys key_at + [0, CHUNK) that lie below `length`.

    k_ptrs / v_ptrs [BLOCK, D] point at the chunk's first block; a key row is `stride_k` / `stride_v` apart.
    Returns (out [M, D] fp32, lse [M] fp32); an empty chunk gives (0, -inf).
    """
    m_i = tl.full((M,), float("-inf"), dtype=tl.float32)
    l_i = tl.full((M,), 0.0, dtype=tl.float32)
    acc = tl.full((M, D), 0.0, dtype=tl.float32)
    for i in range(0, CHUNK, BLOCK):
        keys = key_at + i + tl.arange(0, BLOCK)
        live = keys < length
        k = tl.load(k_ptrs, mask=live[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=live[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale  # [M, BLOCK]; ieee: no tf32 for fp32 tests
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
        k_ptrs += BLOCK * stride_k
        v_ptrs += BLOCK * stride_v
    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    lse = tl.where(has_keys, m_i + tl.log(tl.where(has_keys, l_i, 1.0)), float("-inf"))
    return out, lse


@triton.jit
def _prompt_partial(
    p,
    g,
    split,
    q_ptr,  # [rows, H, D] rotated queries, contiguous
    k_ptr,  # [P, G, S, D] prompt keys (post-rotary), last dim contiguous
    v_ptr,  # [P, G, S, D]
    prompt_lens_ptr,  # [P] int64
    row_start_ptr,  # [P] int64
    row_count_ptr,  # [P] int64
    out_ptr,  # [SPLITS, MAX_ROWS, H, D] fp32
    lse_ptr,  # [SPLITS, MAX_ROWS, H] fp32
    stride_kp,
    stride_kg,
    stride_ks,
    stride_vp,
    stride_vg,
    stride_vs,
    max_rows,
    scale,
    H: tl.constexpr,
    HPG: tl.constexpr,
    D: tl.constexpr,
    ROWS: tl.constexpr,  # power of two >= N
    HEADS: tl.constexpr,  # power of two >= HPG
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Prompt p's live rows, kv-head group g, keys [split * CHUNK, (split + 1) * CHUNK)."""
    count = tl.load(row_count_ptr + p)
    start = tl.load(row_start_ptr + p)
    length = tl.load(prompt_lens_ptr + p) * (count > 0)  # a prompt with no live rows reads no keys
    r = tl.arange(0, ROWS * HEADS)
    row = start + r // HEADS
    head = g * HPG + r % HEADS
    valid = (r // HEADS < count) & (r % HEADS < HPG)
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (row * H + head)[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
    key_at = split * CHUNK
    keys = key_at + tl.arange(0, BLOCK)
    k_ptrs = k_ptr + p.to(tl.int64) * stride_kp + g * stride_kg + keys[:, None].to(tl.int64) * stride_ks + d[None, :]
    v_ptrs = v_ptr + p.to(tl.int64) * stride_vp + g * stride_vg + keys[:, None].to(tl.int64) * stride_vs + d[None, :]
    out, lse = _attend_chunk(
        q, k_ptrs, v_ptrs, stride_ks, stride_vs, key_at, length, scale, CHUNK, BLOCK, ROWS * HEADS, D
    )
    at = (split * max_rows + row).to(tl.int64) * H + head
    tl.store(out_ptr + at[:, None] * D + d[None, :], out, mask=valid[:, None])
    tl.store(lse_ptr + at, lse, mask=valid)


@triton.jit
def _own_partial(
    row,
    g,
    split,
    q_ptr,  # [rows, H, D] rotated queries, contiguous
    k_ptr,  # [SLOTS, G, R, D] response key cache, contiguous
    v_ptr,  # [SLOTS, G, R, D]
    slots_ptr,  # [rows] int64: each row's cache slot
    step_ptr,  # [1] int64: tokens cached before this step; this step's token is at index step
    out_ptr,  # [SPLITS, MAX_ROWS, H, D] fp32
    lse_ptr,  # [SPLITS, MAX_ROWS, H] fp32
    max_rows,
    scale,
    H: tl.constexpr,
    G: tl.constexpr,
    HPG: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    HEADS: tl.constexpr,  # power of two >= max(HPG, 16): tl.dot needs 16 rows
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Batch row `row`'s heads of group g against its own keys [split * CHUNK, (split + 1) * CHUNK)."""
    slot = tl.load(slots_ptr + row)
    length = tl.load(step_ptr) + 1
    r = tl.arange(0, HEADS)
    head = g * HPG + r
    valid = r < HPG
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (row * H + head)[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
    key_at = split * CHUNK
    keys = key_at + tl.arange(0, BLOCK)
    base = (slot * G + g) * R
    k_ptrs = k_ptr + (base + keys)[:, None].to(tl.int64) * D + d[None, :]
    v_ptrs = v_ptr + (base + keys)[:, None].to(tl.int64) * D + d[None, :]
    out, lse = _attend_chunk(q, k_ptrs, v_ptrs, D, D, key_at, length, scale, CHUNK, BLOCK, HEADS, D)
    at = (split * max_rows + row).to(tl.int64) * H + head
    tl.store(out_ptr + at[:, None] * D + d[None, :], out, mask=valid[:, None])
    tl.store(lse_ptr + at, lse, mask=valid)


@triton.jit
def partial_kernel(
    q_ptr,  # [rows, H, D] rotated queries, contiguous
    prompt_k_ptr,  # [P, G, S, D], last dim contiguous
    prompt_v_ptr,
    prompt_lens_ptr,  # [P] int64
    row_start_ptr,  # [P] int64
    row_count_ptr,  # [P] int64
    own_k_ptr,  # [SLOTS, G, R, D] contiguous
    own_v_ptr,
    slots_ptr,  # [rows] int64
    step_ptr,  # [1] int64
    prompt_out_ptr,  # [PROMPT_SPLITS, MAX_ROWS, H, D] fp32
    prompt_lse_ptr,
    own_out_ptr,  # [OWN_SPLITS, MAX_ROWS, H, D] fp32
    own_lse_ptr,
    stride_kp,
    stride_kg,
    stride_ks,
    stride_vp,
    stride_vg,
    stride_vs,
    max_rows,
    scale,
    P: tl.constexpr,
    H: tl.constexpr,
    G: tl.constexpr,
    HPG: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    ROWS: tl.constexpr,
    PROMPT_HEADS: tl.constexpr,
    OWN_HEADS: tl.constexpr,
    PROMPT_CHUNK: tl.constexpr,
    PROMPT_SPLITS: tl.constexpr,
    OWN_CHUNK: tl.constexpr,
    OWN_SPLITS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Both kinds of partial in one launch: programs [0, P * G * PROMPT_SPLITS) take a prompt chunk, the rest
    (rows * G * OWN_SPLITS) a chunk of one row's own keys."""
    pid = tl.program_id(0)
    if pid < P * G * PROMPT_SPLITS:
        _prompt_partial(
            pid // (G * PROMPT_SPLITS), (pid // PROMPT_SPLITS) % G, pid % PROMPT_SPLITS,
            q_ptr, prompt_k_ptr, prompt_v_ptr, prompt_lens_ptr, row_start_ptr, row_count_ptr,
            prompt_out_ptr, prompt_lse_ptr, stride_kp, stride_kg, stride_ks, stride_vp, stride_vg, stride_vs,
            max_rows, scale, H, HPG, D, ROWS, PROMPT_HEADS, PROMPT_CHUNK, BLOCK,
        )  # fmt: skip
    else:
        own = pid - P * G * PROMPT_SPLITS
        _own_partial(
            own // (G * OWN_SPLITS), (own // OWN_SPLITS) % G, own % OWN_SPLITS,
            q_ptr, own_k_ptr, own_v_ptr, slots_ptr, step_ptr, own_out_ptr, own_lse_ptr, max_rows, scale,
            H, G, HPG, D, R, OWN_HEADS, OWN_CHUNK, BLOCK,
        )  # fmt: skip


@triton.jit
def combine_kernel(
    prompt_out_ptr,  # [PROMPT_SPLITS, MAX_ROWS, H, D] fp32
    prompt_lse_ptr,  # [PROMPT_SPLITS, MAX_ROWS, H] fp32
    own_out_ptr,  # [OWN_SPLITS, MAX_ROWS, H, D] fp32
    own_lse_ptr,  # [OWN_SPLITS, MAX_ROWS, H] fp32
    out_ptr,  # [rows, H, D] in the model's dtype
    max_rows,
    H: tl.constexpr,
    HPG: tl.constexpr,
    D: tl.constexpr,
    HEADS: tl.constexpr,  # power of two >= HPG
    PROMPT_SPLITS: tl.constexpr,
    OWN_SPLITS: tl.constexpr,
):
    row = tl.program_id(0)
    g = tl.program_id(1)
    r = tl.arange(0, HEADS)
    head = g * HPG + r
    valid = r < HPG
    d = tl.arange(0, D)
    m = tl.full((HEADS,), float("-inf"), dtype=tl.float32)
    for s in tl.static_range(PROMPT_SPLITS):  # unrolled: the loads of all splits are in flight at once
        at = (s * max_rows + row).to(tl.int64) * H + head
        m = tl.maximum(m, tl.load(prompt_lse_ptr + at, mask=valid, other=float("-inf")))
    for s in tl.static_range(OWN_SPLITS):
        at = (s * max_rows + row).to(tl.int64) * H + head
        m = tl.maximum(m, tl.load(own_lse_ptr + at, mask=valid, other=float("-inf")))
    m = tl.where(valid, m, 0.0)  # finite on valid heads: a row always sees its own token
    total = tl.full((HEADS,), 0.0, dtype=tl.float32)
    acc = tl.full((HEADS, D), 0.0, dtype=tl.float32)
    for s in tl.static_range(PROMPT_SPLITS):
        at = (s * max_rows + row).to(tl.int64) * H + head
        w = tl.exp(tl.load(prompt_lse_ptr + at, mask=valid, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(prompt_out_ptr + at[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        total += w
    for s in tl.static_range(OWN_SPLITS):
        at = (s * max_rows + row).to(tl.int64) * H + head
        w = tl.exp(tl.load(own_lse_ptr + at, mask=valid, other=float("-inf")) - m)
        acc += w[:, None] * tl.load(own_out_ptr + at[:, None] * D + d[None, :], mask=valid[:, None], other=0.0)
        total += w
    out = acc / tl.where(valid, total, 1.0)[:, None]
    dst = out_ptr + (row * H + head)[:, None].to(tl.int64) * D + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=valid[:, None])


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _chunk(num_sequences: int, num_keys: int, min_programs: int = 2 * NUM_SMS_H200) -> int:
    """Keys per program: the longest chunk (fewest partials to merge) that still gives min_programs programs."""
    for chunk in (256, 128):
        if num_sequences * triton.cdiv(num_keys, chunk) >= min_programs:
            return chunk
    return 64


def _rows(num_samples: int, heads_per_group: int) -> int:
    """Sequences per prompt tile: a power of two >= N, raised so that the tile has the 16 rows tl.dot needs."""
    return max(_pow2(num_samples), 16 // min(16, _pow2(heads_per_group)))


@dataclass(frozen=True, slots=True)
class DecodeAttentionShape:
    """Everything fixed while a rollout decodes: the launch grids and workspaces depend only on these."""

    num_prompts: int
    num_samples: int  # N: sequences per prompt; slot s belongs to prompt s // N
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_prompt_len: int  # S: the prompt KV's padded length
    max_tokens: int  # R: the response cache's length
    prompt_chunk: int = 0  # keys per program; 0: the largest of 256, 128, 64 that still fills the GPU
    own_chunk: int = 0
    block: int = 64

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, f"{self.num_heads} heads over {self.num_kv_heads} kv heads"
        if not self.prompt_chunk:
            object.__setattr__(self, "prompt_chunk", _chunk(self.num_prompts * self.num_kv_heads, self.max_prompt_len))
        if not self.own_chunk:
            object.__setattr__(self, "own_chunk", _chunk(self.max_rows * self.num_kv_heads, self.max_tokens))
        for chunk in (self.prompt_chunk, self.own_chunk):
            assert chunk % self.block == 0 and self.block >= 16, f"chunk {chunk}, block {self.block}"
        assert self.head_dim & (self.head_dim - 1) == 0, f"head_dim {self.head_dim} must be a power of two"

    @property
    def max_rows(self) -> int:
        return self.num_prompts * self.num_samples

    @property
    def prompt_splits(self) -> int:
        return triton.cdiv(self.max_prompt_len, self.prompt_chunk)

    @property
    def own_splits(self) -> int:
        return triton.cdiv(self.max_tokens, self.own_chunk)


class DecodeAttention:
    """Owns the partial-result workspaces of one decode shape and launches the three kernels."""

    def __init__(self, shape: DecodeAttentionShape, device: torch.device) -> None:
        self.shape = shape
        h, d, rows = shape.num_heads, shape.head_dim, shape.max_rows
        f32 = dict(dtype=torch.float32, device=device)
        self.prompt_out = torch.zeros(shape.prompt_splits, rows, h, d, **f32)
        self.prompt_lse = torch.full((shape.prompt_splits, rows, h), float("-inf"), **f32)
        self.own_out = torch.zeros(shape.own_splits, rows, h, d, **f32)
        self.own_lse = torch.full((shape.own_splits, rows, h), float("-inf"), **f32)

    def __call__(
        self,
        q: torch.Tensor,  # [rows, H, D] contiguous
        prompt_k: torch.Tensor,  # [P, G, S, D], last dim contiguous
        prompt_v: torch.Tensor,
        prompt_lens: torch.Tensor,  # [P] int64
        row_start: torch.Tensor,  # [P] int64
        row_count: torch.Tensor,  # [P] int64
        own_k: torch.Tensor,  # [SLOTS, G, R, D] contiguous
        own_v: torch.Tensor,
        slots: torch.Tensor,  # [rows] int64
        step: torch.Tensor,  # [1] int64
        out: torch.Tensor,  # [rows, H, D] contiguous, q's dtype
    ) -> torch.Tensor:
        sh = self.shape
        rows, h, d = q.shape
        g, hpg = sh.num_kv_heads, sh.num_heads // sh.num_kv_heads
        assert (h, d) == (sh.num_heads, sh.head_dim) and rows <= sh.max_rows, f"q {tuple(q.shape)} vs {sh}"
        assert prompt_k.shape == (sh.num_prompts, g, sh.max_prompt_len, d), f"prompt keys {tuple(prompt_k.shape)}"
        assert prompt_k.stride(-1) == 1 and prompt_v.stride(-1) == 1, "prompt KV: the head dim must be contiguous"
        assert own_k.shape[1:] == (g, sh.max_tokens, d) and own_k.is_contiguous() and own_v.is_contiguous()
        assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape
        scale = d**-0.5
        num_programs = sh.num_prompts * g * sh.prompt_splits + rows * g * sh.own_splits
        partial_kernel[(num_programs,)](
            q, prompt_k, prompt_v, prompt_lens, row_start, row_count, own_k, own_v, slots, step,
            self.prompt_out, self.prompt_lse, self.own_out, self.own_lse,
            *prompt_k.stride()[:3], *prompt_v.stride()[:3], sh.max_rows, scale,
            P=sh.num_prompts, H=h, G=g, HPG=hpg, D=d, R=sh.max_tokens, ROWS=_rows(sh.num_samples, hpg),
            PROMPT_HEADS=_pow2(hpg), OWN_HEADS=_pow2(hpg, 16), PROMPT_CHUNK=sh.prompt_chunk,
            PROMPT_SPLITS=sh.prompt_splits, OWN_CHUNK=sh.own_chunk, OWN_SPLITS=sh.own_splits, BLOCK=sh.block,
        )  # fmt: skip
        combine_kernel[(rows, g)](
            self.prompt_out, self.prompt_lse, self.own_out, self.own_lse, out, sh.max_rows,
            H=h, HPG=hpg, D=d, HEADS=_pow2(hpg), PROMPT_SPLITS=sh.prompt_splits, OWN_SPLITS=sh.own_splits,
        )  # fmt: skip
        return out
