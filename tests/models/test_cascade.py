"""Attention over two key sets merged by log-sum-exps equals one masked softmax over both, gradients included."""

import pytest
import torch
import torch.nn.functional as F

from rollplex.models.cascade import (
    CUDNN_PADDED,
    FLASH,
    REFERENCE,
    MathDense,
    PaddedDenseKernels,
    Segments,
    _bucket,
    cascade_attention,
)

HEADS, GROUPS, DIM = 4, 2, 8


def dense_mask(first: Segments, second: Segments, num_queries: int) -> torch.Tensor:
    """[T, K1 + K2] bool: each part's segments as blocks (the second causal, aligned at the ends)."""
    blocks = []
    for s in (first, second):
        q, k = s.cu_q.tolist(), s.cu_k.tolist()
        mask = torch.zeros(num_queries, k[-1], dtype=torch.bool)
        for i in range(len(q) - 1):
            n, m = q[i + 1] - q[i], k[i + 1] - k[i]
            block = torch.ones(n, m, dtype=torch.bool)
            if s.causal:
                block = torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
            mask[q[i] : q[i + 1], k[i] : k[i + 1]] = block
        blocks.append(mask)
    return torch.cat(blocks, dim=1)


@pytest.mark.parametrize("seed", range(3))
def test_two_parts_merged_equal_one_masked_softmax_over_both_with_every_gradient(seed):
    gen = torch.Generator().manual_seed(seed)
    # three prompts' response tokens (5, 7, 3) over their prompts' keys (6, 4, 9); five responses over themselves
    prompts = Segments.of([5, 7, 3], [6, 4, 9], causal=False, device=torch.device("cpu"))
    own = Segments.of([2, 3, 4, 3, 3], [2, 3, 4, 3, 3], causal=True, device=torch.device("cpu"))
    shapes = [(15, HEADS, DIM), (19, GROUPS, DIM), (19, GROUPS, DIM), (15, GROUPS, DIM), (15, GROUPS, DIM)]
    tensors = [torch.randn(*shape, generator=gen, requires_grad=True) for shape in shapes]
    q, k1, v1, k2, v2 = tensors
    grad = torch.randn(15, HEADS, DIM, generator=gen)
    out = cascade_attention(q, [(k1, v1, prompts), (k2, v2, own)], REFERENCE)
    mine = torch.autograd.grad(out, tensors, grad)
    keys, values = (torch.cat(pair).repeat_interleave(HEADS // GROUPS, dim=1).transpose(0, 1)
                    for pair in ((k1, k2), (v1, v2)))  # fmt: skip
    oracle = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=dense_mask(prompts, own, 15))
    oracle = oracle.transpose(0, 1)
    torch.testing.assert_close(out, oracle, rtol=1e-5, atol=1e-5)
    for a, b in zip(mine, torch.autograd.grad(oracle, tensors, grad), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("buckets", [(1, 1), (4, 8), (16, 32)])
def test_the_prompt_part_padded_to_buckets_equals_the_unpadded_part_with_every_gradient(buckets):
    """Zero query rows and zero key rows up to whole buckets (none, some, more than the segment): the merged
    output, the log-sum-exps' correction for the padded keys and every gradient equal the unpadded reference (to
    the float32 of the log-sum-exps; uncorrected, the log-sum-exps here are off by up to 2.3)."""
    gen = torch.Generator().manual_seed(7)
    prompts = Segments.of([5, 7, 3], [6, 4, 9], causal=False, device=torch.device("cpu"))
    own = Segments.of([2, 3, 4, 3, 3], [2, 3, 4, 3, 3], causal=True, device=torch.device("cpu"))
    shapes = [(15, HEADS, DIM), (19, GROUPS, DIM), (19, GROUPS, DIM), (15, GROUPS, DIM), (15, GROUPS, DIM)]
    tensors = [torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True) for shape in shapes]
    grad = torch.randn(15, HEADS, DIM, generator=gen, dtype=torch.float64)
    padded = PaddedDenseKernels(MathDense(), *buckets)
    results = []
    for kernels in ((padded, REFERENCE), REFERENCE):
        q, k1, v1, k2, v2 = tensors
        out = cascade_attention(q, [(k1, v1, prompts), (k2, v2, own)], kernels)
        results.append((out, *torch.autograd.grad(out, tensors, grad)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    lse = padded.forward(q, k1, v1, prompts, DIM**-0.5)[1]
    torch.testing.assert_close(lse, REFERENCE.forward(q, k1, v1, prompts, DIM**-0.5)[1], rtol=1e-6, atol=1e-6)


def test_query_buckets_add_at_most_a_quarter_and_stay_few():
    sizes = [_bucket(n, 256) for n in range(1, 16385)]
    assert all(n <= size <= max(256, 1.25 * n) for n, size in enumerate(sizes, 1))
    assert len(set(sizes)) == 25  # 256, then four a doubling up to 16,384


def test_a_segment_without_queries_or_keys_is_refused():
    with pytest.raises(ValueError, match=">= 1 query and key"):
        Segments.of([2, 0], [3, 3], causal=False, device=torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", [None, (CUDNN_PADDED, FLASH)], ids=["flash", "cudnn_padded_prompts"])
def test_on_a_gpu_flash_attentions_kernels_match_the_reference_in_bf16(kernels):
    gen = torch.Generator("cuda").manual_seed(0)
    device = torch.device("cuda")
    prompts = Segments.of([300, 700, 130], [600, 400, 900], causal=False, device=device)
    own = Segments.of([200, 100, 400, 300, 130], [200, 100, 400, 300, 130], causal=True, device=device)
    shapes = [(1130, 16, 128), (1900, 2, 128), (1900, 2, 128), (1130, 2, 128), (1130, 2, 128)]
    tensors = [torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    grad = torch.randn(1130, 16, 128, generator=gen, device=device, dtype=torch.bfloat16)
    results = []
    for each in (kernels, REFERENCE):  # None: FlashAttention on a GPU
        q, k1, v1, k2, v2 = tensors
        out = cascade_attention(q, [(k1, v1, prompts), (k2, v2, own)], each)
        results.append((out, *torch.autograd.grad(out, tensors, grad)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
