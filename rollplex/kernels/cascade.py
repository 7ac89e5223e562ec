"""The Triton kernels of the cascade decode attention (`decode_attention.py` has the layout, the shapes and
the launcher): one online-softmax chunk, the prompt and own partials (one launch), and the combine."""

from __future__ import annotations

import triton
import triton.language as tl

from rollplex.kernels.pdl import enter, leave


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
    USE_GDC: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """Prompt p's live rows, kv-head group g, keys [split * CHUNK, (split + 1) * CHUNK). Before it waits
    (`pdl.enter`) it reads the batch's row map: no kernel of the chain writes it."""
    count = tl.load(row_count_ptr + p)
    start = tl.load(row_start_ptr + p)
    length = tl.load(prompt_lens_ptr + p) * (count > 0)  # a prompt with no live rows reads no keys
    r = tl.arange(0, ROWS * HEADS)
    row = start + r // HEADS
    head = g * HPG + r % HEADS
    valid = (r // HEADS < count) & (r % HEADS < HPG)
    d = tl.arange(0, D)
    enter(USE_GDC, AHEAD)  # the queries: from here on
    q = tl.load(q_ptr + (row * H + head)[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
    key_at = split * CHUNK
    keys = key_at + tl.arange(0, BLOCK)
    k_ptrs = k_ptr + p.to(tl.int64) * stride_kp + g * stride_kg + keys[:, None].to(tl.int64) * stride_ks + d[None, :]
    v_ptrs = v_ptr + p.to(tl.int64) * stride_vp + g * stride_vg + keys[:, None].to(tl.int64) * stride_vs + d[None, :]
    at = (split * max_rows + row).to(tl.int64) * H + head
    if key_at < length:
        out, lse = _attend_chunk(
            q, k_ptrs, v_ptrs, stride_ks, stride_vs, key_at, length, scale, CHUNK, BLOCK, ROWS * HEADS, D
        )
        tl.store(out_ptr + at[:, None] * D + d[None, :], out, mask=valid[:, None])
        tl.store(lse_ptr + at, lse, mask=valid)
    else:  # past the prompt's end: an empty chunk's lse, whose output the combine never reads
        tl.store(lse_ptr + at, tl.full((ROWS * HEADS,), float("-inf"), dtype=tl.float32), mask=valid)


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
    USE_GDC: tl.constexpr,
    AHEAD: tl.constexpr,
):
    """Batch row `row`'s heads of group g against its own keys [split * CHUNK, (split + 1) * CHUNK). Before it
    waits it reads its slot and the step."""
    slot = tl.load(slots_ptr + row)
    length = tl.load(step_ptr) + 1
    r = tl.arange(0, HEADS)
    head = g * HPG + r
    valid = r < HPG
    d = tl.arange(0, D)
    enter(USE_GDC, AHEAD)  # the queries and the step's own key: from here on
    q = tl.load(q_ptr + (row * H + head)[:, None].to(tl.int64) * D + d[None, :], mask=valid[:, None], other=0.0)
    key_at = split * CHUNK
    keys = key_at + tl.arange(0, BLOCK)
    base = (slot * G + g) * R
    k_ptrs = k_ptr + (base + keys)[:, None].to(tl.int64) * D + d[None, :]
    v_ptrs = v_ptr + (base + keys)[:, None].to(tl.int64) * D + d[None, :]
    at = (split * max_rows + row).to(tl.int64) * H + head
    if key_at < length:
        out, lse = _attend_chunk(q, k_ptrs, v_ptrs, D, D, key_at, length, scale, CHUNK, BLOCK, HEADS, D)
        tl.store(out_ptr + at[:, None] * D + d[None, :], out, mask=valid[:, None])
        tl.store(lse_ptr + at, lse, mask=valid)
    else:  # a chunk the response has not reached yet (most of them early in a long rollout): its lse only
        tl.store(lse_ptr + at, tl.full((HEADS,), float("-inf"), dtype=tl.float32), mask=valid)


@triton.jit(do_not_specialize=["prompt_programs"])
def partial_kernel(
    q_ptr,  # [rows, H, D] rotated queries, contiguous
    prompt_k_ptr,  # [P, G, S, D], last dim contiguous
    prompt_v_ptr,
    prompt_lens_ptr,  # [P] int64
    row_start_ptr,  # [P] int64
    row_count_ptr,  # [P] int64
    batch_prompts_ptr,  # [P] int64: the prompts with rows in the batch first
    own_k_ptr,  # [SLOTS, G, R, D] contiguous
    own_v_ptr,
    slots_ptr,  # [rows] int64
    step_ptr,  # [1] int64
    prompt_out_ptr,  # [PROMPT_SPLITS or more, MAX_ROWS, H, D] fp32
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
    prompt_programs,  # the batch's prompts x G x PROMPT_SPLITS
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
    USE_GDC: tl.constexpr = False,  # a programmatic dependent launch (`pdl.pdl_options`)
    AHEAD: tl.constexpr = False,  # `pdl.enter`
):
    """Both kinds of partial in one launch: programs [0, prompt_programs) take a chunk of one of the batch's
    prompts (the i-th of `batch_prompts`), the rest (rows * G * OWN_SPLITS) a chunk of one row's own keys. Each
    waits for the kernel before (`pdl.enter`) once it has read what that kernel does not write."""
    pid = tl.program_id(0)
    if pid < prompt_programs:
        _prompt_partial(
            tl.load(batch_prompts_ptr + pid // (G * PROMPT_SPLITS)), (pid // PROMPT_SPLITS) % G, pid % PROMPT_SPLITS,
            q_ptr, prompt_k_ptr, prompt_v_ptr, prompt_lens_ptr, row_start_ptr, row_count_ptr,
            prompt_out_ptr, prompt_lse_ptr, stride_kp, stride_kg, stride_ks, stride_vp, stride_vg, stride_vs,
            max_rows, scale, H, HPG, D, ROWS, PROMPT_HEADS, PROMPT_CHUNK, BLOCK, USE_GDC, AHEAD,
        )  # fmt: skip
    else:
        own = pid - prompt_programs
        _own_partial(
            own // (G * OWN_SPLITS), (own // OWN_SPLITS) % G, own % OWN_SPLITS,
            q_ptr, own_k_ptr, own_v_ptr, slots_ptr, step_ptr, own_out_ptr, own_lse_ptr, max_rows, scale,
            H, G, HPG, D, R, OWN_HEADS, OWN_CHUNK, BLOCK, USE_GDC, AHEAD,
        )  # fmt: skip
    leave(USE_GDC, AHEAD)


@triton.jit
def combine_kernel(
    prompt_out_ptr,  # [PROMPT_SPLITS or more, MAX_ROWS, H, D] fp32
    prompt_lse_ptr,  # [PROMPT_SPLITS or more, MAX_ROWS, H] fp32
    own_out_ptr,  # [OWN_SPLITS, MAX_ROWS, H, D] fp32
    own_lse_ptr,  # [OWN_SPLITS, MAX_ROWS, H] fp32
    out_ptr,  # [rows, H, D] in the model's dtype
    max_rows,
    H: tl.constexpr,
    D: tl.constexpr,
    PROMPT_SPLITS: tl.constexpr,
    OWN_SPLITS: tl.constexpr,
    PROMPT_LANES: tl.constexpr,  # powers of two >= the splits
    OWN_LANES: tl.constexpr,
    USE_GDC: tl.constexpr = False,
    AHEAD: tl.constexpr = False,
):
    """One program per (row, head): the head's partials of every chunk, loaded at once, merged through their
    log-sum-exp. A program per head rather than per kv-head group: at a batch of one prompt the merge still
    spreads over the GPU."""
    enter(USE_GDC, AHEAD)
    row = tl.program_id(0)
    head = tl.program_id(1)
    lse_p, out_p = _partials(prompt_out_ptr, prompt_lse_ptr, row, head, max_rows, H, D, PROMPT_SPLITS, PROMPT_LANES)
    lse_o, out_o = _partials(own_out_ptr, own_lse_ptr, row, head, max_rows, H, D, OWN_SPLITS, OWN_LANES)
    m = tl.maximum(tl.max(lse_p, 0), tl.max(lse_o, 0))  # finite: a row always sees its own token
    w_p, w_o = tl.exp(lse_p - m), tl.exp(lse_o - m)  # an empty chunk or a padding lane weighs 0
    acc = tl.sum(w_p[:, None] * out_p, 0) + tl.sum(w_o[:, None] * out_o, 0)
    total = tl.sum(w_p, 0) + tl.sum(w_o, 0)
    dst = out_ptr + (row * H + head).to(tl.int64) * D + tl.arange(0, D)
    tl.store(dst, (acc / total).to(out_ptr.dtype.element_ty))
    leave(USE_GDC, AHEAD)


@triton.jit
def _partials(out_ptr, lse_ptr, row, head, max_rows, H: tl.constexpr, D: tl.constexpr, SPLITS: tl.constexpr,
              LANES: tl.constexpr):  # fmt: skip
    """lse [LANES] and out [LANES, D] of one (row, head) over SPLITS chunks: lanes past SPLITS, and empty chunks,
    give (-inf, 0) and read no output."""
    s = tl.arange(0, LANES)
    at = (s * max_rows + row).to(tl.int64) * H + head
    lse = tl.load(lse_ptr + at, mask=s < SPLITS, other=float("-inf"))
    d = tl.arange(0, D)
    has = (lse > float("-inf"))[:, None] & (d < D)[None, :]
    return lse, tl.load(out_ptr + at[:, None] * D + d[None, :], mask=has, other=0.0)
