"""Decode attention over a shared prompt (cascade attention): one query token per sequence, N sequences per
prompt, each attending to its prompt's KV (shared by the group, read once for all N) and to its own response KV.

Two launches, split over keys so that a handful of prompts still fill the GPU (flash-decoding):

- `partial_kernel`, one program per chunk of keys, of two kinds: (prompt p, kv-head group g, prompt chunk):
  the queries of every live sequence of p in group g (N x heads-per-group rows, one tensor-core tile) against
  the chunk of the prompt's keys; (row, g, own chunk): one sequence's heads of group g against a chunk of its
  own response cache.
- `combine_kernel`, grid (rows, heads): merges every chunk's partial output through its log-sum-exp.

Batch rows are sorted by cache slot, so the rows of prompt p are `row_start[p] .. row_start[p] + row_count[p]`
(slot s belongs to prompt s // N). Prompt programs run only for the prompts the batch holds (`batch_prompts`, the
first `num_batch_prompts` of them), and their chunk follows that count: a rollout's tail holds a few prompts, whose
keys a few long chunks would read one after another on a few SMs. Every lse a kernel owns is written each call,
an empty chunk's as -inf with no output (the combine reads a chunk's output only where its lse is finite), so no
stale value is ever merged. Grids and chunks are fixed per batch size and prompt chunk (one captured graph each,
`launch_count`); lengths and the prompts' indices come from device tensors (graph-safe).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from rollplex.kernels.cascade import combine_kernel, partial_kernel
from rollplex.kernels.pdl import pdl_options
from rollplex.kernels.tiles import NUM_SMS_H200


def _pow2(n: int, at_least: int = 1) -> int:
    return max(at_least, triton.next_power_of_2(n))


def _chunk(num_sequences: int, num_keys: int, min_programs: int, longest: int) -> int:
    """Keys per program: the longest chunk (fewest partials to write and merge) up to `longest` that still gives
    min_programs programs."""
    for chunk in (1024, 512, 256, 128):
        if chunk <= longest and num_sequences * triton.cdiv(num_keys, chunk) >= min_programs:
            return chunk
    return 64


def _prompt_chunk(num_sequences: int, num_keys: int) -> int:
    """Prompt chunks of up to 1,024 keys while they give half a wave of programs: the own chunks share the launch
    and fill it. Longer chunks write and merge fewer partials, which pays on long prompts (at 5,888 keys: 1,024 at
    a batch of 8 prompts, 512 at 4, 128 at one, each the fastest of the three,
    bench/results/decode_attention_3b_h200.json); on short prompts the chunk length barely matters."""
    return _chunk(num_sequences, num_keys, NUM_SMS_H200 // 2, 1024)


def _own_chunk(max_tokens: int) -> int:
    """Own chunks of 256 keys (fewer on a shorter cache) whatever the batch: an own chunk the response has not
    reached costs a program that writes only its lse, and early in a long rollout most chunks are such, so
    the longest chunk wins even at a batch of one prompt, where it leaves part of the GPU idle
    (bench/results/decode_attention_3b_h200.json)."""
    return min(256, _pow2(max_tokens, 64))


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
    prompt_chunk: int = 0  # keys per prompt program; 0: picked per call for the prompts the batch holds (`chunk_for`)
    own_chunk: int = 0  # keys per own program; 0: picked (`_own_chunk`)
    block: int = 64
    num_warps: int = 4  # of the partial kernel (triton's defaults)
    num_stages: int = 3

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, f"{self.num_heads} heads over {self.num_kv_heads} kv heads"
        if not self.own_chunk:
            object.__setattr__(self, "own_chunk", _own_chunk(self.max_tokens))
        for chunk in (*{self.chunk_for(n) for n in range(1, self.num_prompts + 1)}, self.own_chunk):
            assert chunk % self.block == 0 and self.block >= 16, f"chunk {chunk}, block {self.block}"
        assert self.head_dim & (self.head_dim - 1) == 0, f"head_dim {self.head_dim} must be a power of two"

    @property
    def max_rows(self) -> int:
        return self.num_prompts * self.num_samples

    def chunk_for(self, num_batch_prompts: int) -> int:
        """Keys per prompt program when the batch holds rows of `num_batch_prompts` prompts."""
        assert 1 <= num_batch_prompts <= self.num_prompts, f"{num_batch_prompts} of {self.num_prompts} prompts"
        return self.prompt_chunk or _prompt_chunk(num_batch_prompts * self.num_kv_heads, self.max_prompt_len)

    def launch_count(self, num_batch_prompts: int) -> int:
        """The prompt count a batch spanning `num_batch_prompts` prompts launches programs for: the most prompts
        that share its chunk. The programs of the prompts past the batch's (entries of `batch_prompts` with no rows)
        read and write nothing, and batches of counts that share a chunk share one grid, so one captured graph."""
        chunk = self.chunk_for(num_batch_prompts)
        return max(n for n in range(num_batch_prompts, self.num_prompts + 1) if self.chunk_for(n) == chunk)

    def prompt_splits(self, num_batch_prompts: int) -> int:
        """Chunks a prompt program's grid cuts each prompt into: over the capacity rounded up to a power of two,
        so that the rollouts' prompt capacities within one power of two share the kernels (the splits are
        constants of both; a runtime count took the register-bound partial kernel 5-50 % longer). The chunks
        past a prompt's end write only their lse, reading no key."""
        return triton.cdiv(_pow2(self.max_prompt_len), self.chunk_for(num_batch_prompts))

    @property
    def max_prompt_splits(self) -> int:
        """The most chunks a prompt is cut into: at one prompt a batch, the shortest chunk."""
        return self.prompt_splits(1)

    @property
    def own_splits(self) -> int:
        return triton.cdiv(self.max_tokens, self.own_chunk)


class DecodeAttention:
    """Owns the partial-result workspaces of one decode shape and launches the two kernels (`pdl`, `ahead`: as
    programmatic dependents, `rollplex.kernels.pdl`)."""

    def __init__(self, shape: DecodeAttentionShape, device: torch.device) -> None:
        self.shape = shape
        h, d, rows = shape.num_heads, shape.head_dim, shape.max_rows
        f32 = dict(dtype=torch.float32, device=device)
        self.prompt_out = torch.zeros(shape.max_prompt_splits, rows, h, d, **f32)
        self.prompt_lse = torch.full((shape.max_prompt_splits, rows, h), float("-inf"), **f32)
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
        batch_prompts: torch.Tensor,  # [P] int64: the prompts that have rows in the batch first, in any order
        num_batch_prompts: int,  # how many of them to launch programs for: at least those with rows in the batch
        pdl: bool = False,
        ahead: bool = False,
    ) -> torch.Tensor:
        sh = self.shape
        rows, h, d = q.shape
        g, hpg = sh.num_kv_heads, sh.num_heads // sh.num_kv_heads
        assert (h, d) == (sh.num_heads, sh.head_dim) and rows <= sh.max_rows, f"q {tuple(q.shape)} vs {sh}"
        assert batch_prompts.shape == (sh.num_prompts,), f"batch_prompts {tuple(batch_prompts.shape)}"
        assert prompt_k.shape == (sh.num_prompts, g, sh.max_prompt_len, d), f"prompt keys {tuple(prompt_k.shape)}"
        assert prompt_k.stride(-1) == 1 and prompt_v.stride(-1) == 1, "prompt KV: the head dim must be contiguous"
        assert own_k.shape[1:] == (g, sh.max_tokens, d) and own_k.is_contiguous() and own_v.is_contiguous()
        assert q.is_contiguous() and out.is_contiguous() and out.shape == q.shape
        scale = d**-0.5
        chunk, splits = sh.chunk_for(num_batch_prompts), sh.prompt_splits(num_batch_prompts)
        prompt_programs = num_batch_prompts * g * splits
        partial_kernel[(prompt_programs + rows * g * sh.own_splits,)](
            q, prompt_k, prompt_v, prompt_lens, row_start, row_count, batch_prompts, own_k, own_v, slots, step,
            self.prompt_out, self.prompt_lse, self.own_out, self.own_lse,
            *prompt_k.stride()[:3], *prompt_v.stride()[:3], sh.max_rows, scale, prompt_programs,
            H=h, G=g, HPG=hpg, D=d, R=sh.max_tokens, ROWS=_rows(sh.num_samples, hpg),
            PROMPT_HEADS=_pow2(hpg), OWN_HEADS=_pow2(hpg, 16), PROMPT_CHUNK=chunk, PROMPT_SPLITS=splits,
            OWN_CHUNK=sh.own_chunk, OWN_SPLITS=sh.own_splits, BLOCK=sh.block,
            num_warps=sh.num_warps, num_stages=sh.num_stages, **pdl_options(pdl, q, ahead),
        )  # fmt: skip
        combine_kernel[(rows, h)](
            self.prompt_out, self.prompt_lse, self.own_out, self.own_lse, out, sh.max_rows,
            H=h, D=d, PROMPT_SPLITS=splits, OWN_SPLITS=sh.own_splits,
            PROMPT_LANES=_pow2(splits), OWN_LANES=_pow2(sh.own_splits), **pdl_options(pdl, q, ahead),
        )  # fmt: skip
        return out
