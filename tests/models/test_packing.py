"""Packed projections: separate named parameters over one storage, read as one matrix by rollout."""

from __future__ import annotations

import copy

import torch

from rollplex.models.packing import packed_view


def test_qkv_and_gate_up_are_views_of_one_tensor_in_every_layer(model):
    for layer in model.model.language_model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = packed_view(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight)
        assert qkv is not None and torch.equal(
            qkv, torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        )
        assert packed_view(attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias) is not None
        assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
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
