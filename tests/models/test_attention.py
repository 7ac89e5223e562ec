"""Attention over a shared prompt merged with per-response attention equals attention over prompt ++ response."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rollplex.models import attention
from rollplex.models.attention import (
    FLEX_BLOCK,
    PackedPrefixAttention,
    attend,
    attention_length,
    causal_sdpa,
    merge_attention,
)
from rollplex.models.boundary import Boundary
from rollplex.models.cascade import REFERENCE, PackedCascadeAttention
from rollplex.models.packed import ResponsePack

HEADS, KV_HEADS, DIM = 4, 2, 8


def test_merging_attention_over_two_key_sets_equals_attention_over_their_union():
    q, k, v = torch.randn(2, 3, 5, DIM), torch.randn(2, 3, 9, DIM), torch.randn(2, 3, 9, DIM)
    everything = torch.ones(5, 9, dtype=torch.bool)
    out, lse = attend(q, k, v, everything)
    out_a, lse_a = attend(q, k[..., :4, :], v[..., :4, :], everything[:, :4])
    out_b, lse_b = attend(q, k[..., 4:, :], v[..., 4:, :], everything[:, 4:])
    assert torch.allclose(merge_attention(out_a, lse_a, out_b, lse_b), out, atol=1e-6)
    assert torch.allclose(torch.logaddexp(lse_a, lse_b), lse, atol=1e-6)


def test_attention_lengths_are_few_per_octave_and_waste_at_most_a_sixteenth():
    lengths = range(1, 20000)
    padded = [attention_length(n) for n in lengths]
    assert all(n <= p <= n * (1 + 1 / 16) for n, p in zip(lengths, padded, strict=True))
    assert padded == sorted(padded) and all(attention_length(p) == p for p in padded)  # monotone, idempotent
    assert len({attention_length(n) for n in range(4097, 8193)}) == 16  # 4352, 4608, ..., 8192
    assert attention_length(4910) == 5120 and attention_length(16) == 16


def test_causal_attention_at_a_bucketed_length_equals_it_at_the_exact_length_gradients_included():
    q = torch.randn(2, HEADS, 37, DIM, requires_grad=True)  # 37 tokens run as 38
    k = torch.randn(2, KV_HEADS, 37, DIM, requires_grad=True)
    v = torch.randn(2, KV_HEADS, 37, DIM, requires_grad=True)
    outs = [causal_sdpa(q, k, v, bucketed=bucketed) for bucketed in (False, True)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    weights = torch.randn_like(outs[0])
    exact, padded = (torch.autograd.grad((out * weights).sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(padded, exact, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)


def packed_case(prompt_lens, rows, counts, width, generator, device="cpu", dim=DIM):
    """A boundary of len(prompt_lens) prompts (one layer, padded to the longest), a pack of `rows`' first `counts`
    tokens, and q, k, v of the packed tokens, all leaves that need gradients."""
    span = max(prompt_lens)
    leaf = lambda *shape: torch.randn(*shape, generator=generator).to(device).requires_grad_()  # noqa: E731
    keys, values = leaf(len(prompt_lens), KV_HEADS, span, dim), leaf(len(prompt_lens), KV_HEADS, span, dim)
    lens = torch.tensor(prompt_lens, device=device)
    boundary = Boundary((keys,), (values,), torch.zeros(len(prompt_lens), 1, device=device), lens, lens)
    pack = ResponsePack.of(rows, counts, width, torch.device(device))
    m = pack.num_tokens
    return boundary, pack, leaf(1, HEADS, m, dim), leaf(1, KV_HEADS, m, dim), leaf(1, KV_HEADS, m, dim)


def per_row_oracle(boundary, pack, q, k, v):
    """Each packed response alone: SDPA over its prompt's real keys then its own, causally, heads repeated."""
    outs, start = [], 0
    for prompt, count in zip(pack.rows, pack.counts, strict=True):
        length = int(boundary.prompt_lens[prompt])
        own = slice(start, start + count)
        full_k = torch.cat([boundary.keys[0][prompt, :, :length], k[0, :, own]], dim=1)
        full_v = torch.cat([boundary.values[0][prompt, :, :length], v[0, :, own]], dim=1)
        mask = torch.ones(count, length + count, dtype=torch.bool, device=q.device).tril(length)
        repeat = HEADS // KV_HEADS
        outs.append(
            torch.nn.functional.scaled_dot_product_attention(
                q[0, :, own], full_k.repeat_interleave(repeat, 0), full_v.repeat_interleave(repeat, 0), attn_mask=mask
            )
        )
        start += count
    return torch.cat(outs, dim=1)[None]


ATTENTIONS = {"one masked call": PackedPrefixAttention,
              "cascade": lambda boundary, pack: PackedCascadeAttention(boundary, pack, REFERENCE)}  # fmt: skip


@pytest.mark.parametrize("kind", list(ATTENTIONS))
@pytest.mark.parametrize("rows", [(1, 0, 1, 2), (2, 2), (0, 0, 2, 1)])  # a prompt in two runs; one prompt of three
def test_packed_attention_equals_each_response_over_its_prompt_then_itself_gradients_included(rows, kind):
    g = torch.Generator().manual_seed(0)
    counts = (4, 1, 3, 2)[: len(rows)]
    boundary, pack, q, k, v = packed_case((5, 3, 4), rows, counts, 4, g)
    out = ATTENTIONS[kind](boundary, pack)(0, q, k, v)
    expected = per_row_oracle(boundary, pack, q, k, v)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    inputs = (q, k, v, boundary.keys[0], boundary.values[0])
    weights = torch.randn(out.shape, generator=g)
    ours, oracle = (torch.autograd.grad((o * weights).sum(), inputs, allow_unused=True) for o in (out, expected))
    for a, b in zip(ours, oracle, strict=True):
        torch.testing.assert_close(a, b if b is not None else torch.zeros_like(a), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the eager reference, wanted
def test_the_block_mask_keeps_exactly_the_blocks_the_dense_mask_touches_and_flex_agrees_with_sdpa():
    """FlexAttention's block mask, built on the CPU: a block is kept full only if every pair in it is visible,
    partial if some are, skipped if none; eager FlexAttention (forward only on a CPU) then equals the dense SDPA."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(1)
    rows, counts = (0, 2, 1, 0, 2), (200, 37, 129, 1, 90)  # several blocks of queries and of each prompt's keys
    boundary, pack, q, k, v = packed_case((300, 130, 257), rows, counts, 200, g)
    attention = PackedPrefixAttention(boundary, pack)
    blocks = attention._block_mask()
    dense = attention._dense_mask()
    padded = torch.zeros(attention.padded_lengths, dtype=torch.bool)
    padded[: dense.shape[0], : dense.shape[1]] = dense
    per_block = padded.view(blocks.kv_num_blocks.shape[-1], FLEX_BLOCK, -1, FLEX_BLOCK)
    touched, whole = per_block.any(3).any(1), per_block.all(3).all(1)
    assert torch.equal(blocks.to_dense()[0, 0].bool(), touched)
    full = torch.zeros_like(whole)
    for qb in range(whole.shape[0]):
        full[qb, blocks.full_kv_indices[0, 0, qb, : blocks.full_kv_num_blocks[0, 0, qb]].long()] = True
    assert torch.equal(full, whole) and whole.any() and (touched & ~whole).any()
    assert not touched.all()  # the prompts' KV that a query block cannot see is skipped
    with torch.no_grad():
        keys = torch.cat([attention._prompt_kv(boundary.keys[0]), k], dim=2)
        values = torch.cat([attention._prompt_kv(boundary.values[0]), v], dim=2)
        flexed = flex_attention(q.detach(), keys, values, block_mask=blocks, enable_gqa=True)
        torch.testing.assert_close(flexed, attention(0, q, k, v), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(flexed, per_row_oracle(boundary, pack, q, k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_packed_flex_attention_equals_the_per_row_oracle_gradients_included():
    g = torch.Generator().manual_seed(2)
    rows, counts = (0, 2, 1, 0, 2), (200, 37, 129, 1, 90)
    boundary, pack, q, k, v = packed_case((300, 130, 257), rows, counts, 200, g, device="cuda", dim=64)
    attention = PackedPrefixAttention(boundary, pack)
    assert attention.flex
    out = attention(0, q, k, v)
    expected = per_row_oracle(boundary, pack, q, k, v)
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)  # fp32 (flex may multiply in TF32)
    inputs = (q, k, v, boundary.keys[0], boundary.values[0])
    weights = torch.randn(out.shape, generator=g).cuda()
    ours, oracle = (torch.autograd.grad((o * weights).sum(), inputs) for o in (out, expected))
    for a, b in zip(ours, oracle, strict=True):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_cascade_of_a_pack_on_flash_attention_equals_the_per_row_oracle_in_bf16():
    g = torch.Generator().manual_seed(4)
    rows, counts = (0, 2, 1, 0, 2), (200, 37, 129, 1, 90)
    boundary, pack, *_ = packed_case((300, 130, 257), rows, counts, 200, g, device="cuda", dim=128)
    bf16 = lambda t: t.detach().to(torch.bfloat16).requires_grad_()  # noqa: E731
    boundary = dataclasses.replace(boundary, keys=(bf16(boundary.keys[0]),), values=(bf16(boundary.values[0]),))
    q, k, v = (torch.randn(1, n, pack.num_tokens, 128, generator=g).cuda().bfloat16().requires_grad_()
               for n in (HEADS, KV_HEADS, KV_HEADS))  # fmt: skip
    out = PackedCascadeAttention(boundary, pack)(0, q, k, v)
    expected = per_row_oracle(boundary, pack, q, k, v)
    torch.testing.assert_close(out.float(), expected.float(), rtol=2e-2, atol=2e-2)
    inputs = (q, k, v, boundary.keys[0], boundary.values[0])
    weights = torch.randn(out.shape, generator=g).cuda().bfloat16()
    ours, oracle = (torch.autograd.grad((o * weights).sum(), inputs) for o in (out, expected))
    for a, b in zip(ours, oracle, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.usefixtures("cudnn_attention")
def test_on_a_gpu_causal_cudnn_attention_at_a_bucketed_length_equals_the_exact_length():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    shapes = [(1, n, 600, 128) for n in (16, 2, 2)]  # 600 tokens run as 608
    q, k, v = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True) for s in shapes)
    assert attention.plans_per_shape(q.device)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):  # the kernel that plans per shape takes the padded call
        outs = [causal_sdpa(q, k, v, bucketed=bucketed) for bucketed in (False, True)]
    torch.testing.assert_close(outs[1], outs[0])
    exact, padded = (torch.autograd.grad(out.float().square().sum(), (q, k, v)) for out in outs)
    for ours, theirs in zip(padded, exact, strict=True):
        assert torch.isfinite(ours).all()
        torch.testing.assert_close(ours, theirs, rtol=2e-2, atol=2e-2)
