"""Packed projections: separate named parameters over one storage, read as one matrix by rollout and by the
training forward (`packed_linear`: one GEMM each way, each parameter its own gradient, against torch's linears)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from rollplex.models.packing import pack, packed_linear, packed_view


def test_qkv_and_gate_up_are_views_of_one_tensor_in_every_layer(model):
    for layer in model.model.language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = packed_view(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        assert qkv is not None and torch.equal(
            qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        assert packed_view(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias) is not None
        assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    for block in model.model.visual.blocks:
        mlp = block.mlp
        assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
        assert packed_view(mlp.gate_proj.bias, mlp.up_proj.bias) is not None
    assert packed_view(attn.q_proj.weight, attn.v_proj.weight) is None  # not back to back
    assert packed_view(attn.q_proj.weight, torch.zeros_like(attn.k_proj.weight)) is None


def test_an_in_place_update_of_one_parameter_shows_in_the_packed_matrix_and_nowhere_else(model):
    attn = model.model.language_model.layers[0].self_attn
    qkv = packed_view(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
    before = qkv.clone()
    optimizer = torch.optim.SGD([attn.k_proj.weight], lr=1.0)
    attn.k_proj.weight.grad = torch.ones_like(attn.k_proj.weight)
    optimizer.step()
    q_rows, k_rows = attn.q_proj.weight.shape[0], attn.k_proj.weight.shape[0]
    assert torch.equal(qkv[q_rows : q_rows + k_rows], before[q_rows : q_rows + k_rows] - 1)
    assert torch.equal(qkv[:q_rows], before[:q_rows]) and torch.equal(qkv[q_rows + k_rows :], before[q_rows + k_rows :])


def test_packing_keeps_names_and_packs_again_after_a_deepcopy(model):
    names = [n for n, _ in model.named_parameters()]
    assert "model.language_model.layers.0.self_attn.k_proj.bias" in names
    assert all(p.is_leaf for p in model.parameters())
    clone = copy.deepcopy(model)  # nn.Parameter's deepcopy clones each parameter on its own
    mlp = clone.model.language_model.layers[1].mlp
    assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is None
    clone.pack_projections()
    mlp = clone.model.language_model.layers[1].mlp
    assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), clone.parameters(), strict=True))


def linears(bias: bool, packed: bool, seed: int = 0) -> list[nn.Linear]:
    """Three linears of different widths (a [q; k; v] like pack), their weights and biases different."""
    torch.manual_seed(seed)
    out = [nn.Linear(12, width, bias=bias) for width in (8, 4, 4)]
    if packed:
        pack(out, "weight")
        if bias:
            pack(out, "bias")
    return out


@pytest.mark.parametrize("bias", [True, False])
def test_one_gemm_over_a_pack_gives_each_parameter_the_gradient_of_its_own_linear(bias):
    x = torch.randn(2, 5, 12)
    dy = torch.randn(2, 5, 16)
    results = []
    for packed in (True, False):
        layers, leaf = linears(bias, packed), x.clone().requires_grad_()
        y = packed_linear(leaf, layers) if packed else torch.cat([linear(leaf) for linear in layers], -1)
        y.backward(dy)
        results.append([y.detach(), leaf.grad, *(p.grad for linear in layers for p in linear.parameters())])
    assert len(results[0]) == 2 + 3 * (2 if bias else 1)
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert results[0][2].abs().min() > 0  # the first weight's gradient reached it whole


def test_a_pack_that_does_not_lie_back_to_back_or_frozen_parameters_still_give_the_linears_values():
    x = torch.randn(3, 12)
    apart = linears(True, packed=False)
    want = torch.cat([linear(x) for linear in apart], -1)
    torch.testing.assert_close(packed_linear(x, apart), want)  # the linears one by one
    frozen = linears(True, packed=True)
    for p in (p for linear in frozen for p in linear.parameters()):
        p.requires_grad_(False)
    leaf = x.clone().requires_grad_()
    y = packed_linear(leaf, frozen)
    torch.testing.assert_close(y, want)
    y.sum().backward()
    torch.testing.assert_close(leaf.grad, torch.cat([linear.weight for linear in frozen]).sum(0).expand(3, 12))
    assert all(p.grad is None for linear in frozen for p in linear.parameters())
    with torch.no_grad():
        assert not packed_linear(x, linears(False, packed=True)).requires_grad
