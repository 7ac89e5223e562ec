"""`PromptRows`: the prefix's decoder layers over the real tokens only, the same boundary and gradients as over
the padded batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rollplex.models import model as model_module
from rollplex.models import prompt_rows
from rollplex.models.attention import attention_length
from rollplex.models.cascade import MathDense
from rollplex.models.prompt_rows import CUDNN_CAUSAL, PackedPromptKV, PromptCausal, PromptRows
from rollplex.models.rerun import Rerun


def test_rows_name_each_prompts_real_tokens_and_its_last():
    rows = PromptRows.of(torch.tensor([3, 1, 2]), torch.device("cpu"))
    assert rows.real.tolist() == [0, 1, 2, 3, 6, 7] and rows.last.tolist() == [2, 3, 5]
    assert (rows.num_prompts, rows.length, rows.lens) == (3, 3, (3, 1, 2))
    assert PromptRows.of(torch.tensor([4, 4]), torch.device("cpu")) is None  # nothing padded: nothing to pack


def test_pack_and_unpack_move_rows_both_ways_with_zero_padding_and_gathered_gradients():
    rows = PromptRows.of(torch.tensor([3, 1, 2]), torch.device("cpu"))
    x = torch.randn(3, 3, 4, requires_grad=True)
    packed = rows.pack(x)
    assert packed.shape == (1, 6, 4)
    assert torch.equal(packed[0], torch.cat([x[0, :3], x[1, :1], x[2, :2]]))
    weights = torch.randn(1, 6, 4)
    (packed * weights).sum().backward()
    expected = torch.zeros(3, 3, 4)
    expected[0, :3], expected[1, :1], expected[2, :2] = weights[0, :3], weights[0, 3:4], weights[0, 4:]
    assert torch.equal(x.grad, expected)  # padding rows get zero

    source = torch.randn(6, 2, requires_grad=True)
    padded = rows.unpack(source)
    assert torch.equal(padded[1, 1:], torch.zeros(2, 2)) and torch.equal(padded[2, :2], source[4:].detach())
    padded.sum().backward()
    assert torch.equal(source.grad, torch.ones(6, 2))


@pytest.mark.parametrize("dense", [None, MathDense(causal=True)], ids=["padded", "per_prompt"])
def test_packed_attention_is_each_prompts_causal_attention_and_keeps_the_padded_kv(dense):
    torch.manual_seed(0)
    lens = torch.tensor([5, 2, 4])
    rows = PromptRows.of(lens, torch.device("cpu"))
    q, k, v = torch.randn(1, 4, 11, 8), torch.randn(1, 2, 11, 8), torch.randn(1, 2, 11, 8)
    attention = PackedPromptKV(rows.real, rows.num_prompts, rows.length, rows.lens, dense)
    out = attention(0, q, k, v)
    assert out.shape == q.shape and attention.key.shape == (3, 2, 5, 8)
    start = 0
    for p, n in enumerate(lens.tolist()):
        span = slice(start, start + n)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q[:, :, span], k[:, :, span], v[:, :, span], is_causal=True, enable_gqa=True
        )
        torch.testing.assert_close(out[:, :, span], expected)
        assert torch.equal(attention.key[p, :, :n], k[0, :, span]) and not attention.value[p, :, n:].any()
        start += n


def per_prompt_sdpa(q, k, v, lens):
    """The oracle: each prompt's causal SDPA over its own rows, [T, heads, D] in and out."""
    outs, start = [], 0
    for n in lens:
        rows = [x[start : start + n].transpose(0, 1) for x in (q, k, v)]
        outs.append(F.scaled_dot_product_attention(*rows, is_causal=True, enable_gqa=True).transpose(0, 1))
        start += n
    return torch.cat(outs)


class RecordedDense(MathDense):
    """`MathDense(causal=True)` that records the rows of each window it is called with, forward and backward."""

    def __init__(self) -> None:
        super().__init__(causal=True)
        self.rows: list[int] = []

    def forward(self, q, k, v, scale):
        self.rows.append(q.shape[0])
        return super().forward(q, k, v, scale)

    def backward(self, dout, q, k, v, out, lse, scale, saved):
        self.rows.append(q.shape[0])
        return super().backward(dout, q, k, v, out, lse, scale, saved)


@pytest.mark.parametrize("lens", [(41, 35, 67), (97, 2, 65), (97, 2)])
def test_per_prompt_calls_over_bucketed_windows_give_each_prompts_attention_and_gradients(lens):
    """Windows past a prompt's end read the next prompt's rows (and zeros past the last packed row, as the first
    window of (97, 2) does); none of it reaches an output or a gradient. A backward that gave the extra rows the
    next prompt's output gradient fails here."""
    windows = [attention_length(n) for n in lens]
    assert any(w > n for w, n in zip(windows, lens, strict=True))  # windows of 42, 36, 68; 100, 2, 68; 100, 2
    gen = torch.Generator().manual_seed(3)
    total = sum(lens)
    tensors = [torch.randn(total, heads, 8, generator=gen, dtype=torch.float64) for heads in (4, 2, 2)]
    grad = torch.randn(total, 4, 8, generator=gen, dtype=torch.float64)
    dense = RecordedDense()
    results = []
    for attend in (lambda q, k, v: PromptCausal.apply(q, k, v, lens, dense), lambda *x: per_prompt_sdpa(*x, lens)):
        inputs = [t.clone().requires_grad_() for t in tensors]
        out = attend(*inputs)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    assert dense.rows == windows + windows  # one call a prompt each way, over its bucketed window
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # MathDense computes in float32


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_cudnn_per_prompt_calls_match_the_float_oracle_as_the_padded_call_does():
    """bf16 on cuDNN, prompts long enough for bucketed windows: each output and gradient is as close to the
    float64 oracle as the padded single call's."""
    lens = (700, 1300, 1000)
    gen = torch.Generator("cuda").manual_seed(0)
    total = sum(lens)
    tensors = [torch.randn(total, heads, 128, generator=gen, device="cuda") for heads in (16, 2, 2)]
    grad = torch.randn(total, 16, 128, generator=gen, device="cuda")
    rows = PromptRows.of(torch.tensor(lens), torch.device("cuda"))

    def run(attend, dtype):
        inputs = [t.to(dtype).requires_grad_() for t in tensors]
        out = attend(*inputs)
        return [x.double() for x in (out, *torch.autograd.grad(out, inputs, grad.to(dtype)))]

    def packed(dense):
        def attend(q, k, v):
            attention = PackedPromptKV(rows.real, rows.num_prompts, rows.length, rows.lens, dense)
            return attention(0, *(x.transpose(0, 1)[None] for x in (q, k, v)))[0].transpose(0, 1)

        return attend

    assert CUDNN_CAUSAL.takes(*(t.to(torch.bfloat16) for t in tensors))  # else both calls below go padded
    oracle = run(lambda q, k, v: per_prompt_sdpa(q, k, v, lens), torch.float64)
    errors = {
        name: [(x - o).abs().max().item() for x, o in zip(run(packed(dense), torch.bfloat16), oracle, strict=True)]
        for name, dense in (("per_prompt", CUDNN_CAUSAL), ("padded", None))
    }
    for mine, padded in zip(errors["per_prompt"], errors["padded"], strict=True):
        assert mine <= 1.5 * padded + 1e-3, errors


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_float32_prompts_go_padded_since_cudnn_returns_nan_for_them():
    """cuDNN's kernels, called directly, return NaN for float32 without an error: such a call takes the padded path."""
    lens = (39, 21, 6)
    rows = PromptRows.of(torch.tensor(lens), torch.device("cuda"))
    q, k, v = (torch.randn(1, heads, sum(lens), 16, device="cuda") for heads in (4, 2, 2))
    assert not CUDNN_CAUSAL.takes(*(x[0].transpose(0, 1) for x in (q, k, v)))
    out = PackedPromptKV(rows.real, rows.num_prompts, rows.length, rows.lens, CUDNN_CAUSAL)(0, q, k, v)
    rows_of = [x[0].transpose(0, 1) for x in (q, k, v)]
    torch.testing.assert_close(out[0].transpose(0, 1), per_prompt_sdpa(*rows_of, lens), rtol=1e-4, atol=1e-4)


@pytest.fixture
def unpacked(monkeypatch):
    """The prefix as before packing: its layers over the padded batch."""

    def padded():
        monkeypatch.setattr(PromptRows, "of", staticmethod(lambda lens, device: None))

    return padded


@pytest.mark.parametrize(
    "layers_per_chunk, rerun, dense",
    [(1, None, None), (100, None, None), (1, Rerun(), None), (1, Rerun(), MathDense(causal=True))],
    ids=["chunked", "whole", "rerun", "rerun_per_prompt"],
)
def test_the_packed_prefix_gives_the_padded_boundary_and_gradients(
    model, prompts, unpacked, monkeypatch, layers_per_chunk, rerun, dense
):
    assert len({p.num_tokens for p in prompts}) > 1  # padding to drop
    monkeypatch.setattr(model_module, "prompt_dense", lambda device: dense)  # the packed run's attention
    seen = []
    hook = model.model.language_model.layers[0].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))

    def run():
        chunks = model.prefix_chunks(prompts, attached=True, layers_per_chunk=layers_per_chunk, rerun=rerun)
        boundary = model_module.drain(chunks)
        real = boundary.key_mask()[:, None, :, None]  # what reaches a loss (the padded KV's padding does not)
        loss = sum((t * real).float().square().mean() for t in boundary.keys + boundary.values)
        (loss + boundary.first_logprobs.sum()).backward()  # under a rerun the gradients accumulate in .grad
        grads = [None if p.grad is None else p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        return boundary, grads

    packed, packed_grads = run()
    unpacked()
    monkeypatch.setattr(model_module, "prompt_dense", prompt_rows.prompt_dense)
    padded, padded_grads = run()
    hook.remove()
    total, longest = sum(p.num_tokens for p in prompts), max(p.num_tokens for p in prompts)
    assert seen[0][:2] == (1, total) and seen[-1][:2] == (len(prompts), longest)
    torch.testing.assert_close(packed.first_logprobs, padded.first_logprobs, atol=1e-5, rtol=1e-5)
    real = padded.key_mask()[:, None, :, None]
    for a, b in zip(packed.keys + packed.values, padded.keys + padded.values, strict=True):
        torch.testing.assert_close(a, b * real, atol=1e-5, rtol=1e-5)  # zeros past each prompt's length
    assert sum(g is not None for g in packed_grads) > 0.9 * len(packed_grads)
    for a, b in zip(packed_grads, padded_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
