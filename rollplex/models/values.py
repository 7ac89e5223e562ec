"""A value model for PPO's critic: the policy's Qwen2.5-VL with its LM head replaced by a scalar head.

The critic starts from the policy's initial weights (vision tower and language model) and a fresh head
(`make_value_model`). Its value of response token j is the head at the position before j, as the log-prob of j
is: the prompt's last position for token 0 (the boundary's `first_logprobs` slot holds it, [P, 1]), the
response's own positions for the rest. Split (`suffix_values`) or over prompt ++ response (`whole_values`, the
oracle), like the policy's scores.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from rollplex.models.boundary import Boundary
from rollplex.models.inputs import Prompt
from rollplex.models.model import INIT_STD, Qwen2_5_VL


def make_value_model(model: Qwen2_5_VL, seed: int) -> Qwen2_5_VL:
    """`model` with a scalar head (weights N(0, INIT_STD) drawn from `seed`, zero bias) in place of its LM head."""
    hidden = model.config.text.hidden_size
    weight = model.lm_head.weight
    head = nn.Linear(hidden, 1, bias=True, device=weight.device, dtype=weight.dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head.weight.copy_(torch.randn(1, hidden, generator=generator) * INIT_STD)
        head.bias.zero_()
    model.lm_head = head  # unties it from the token embedding where the config ties them
    return model


def is_value_model(model: Qwen2_5_VL) -> bool:
    return model.lm_head.out_features == 1


def suffix_values(
    model: Qwen2_5_VL, boundary: Boundary, rows: Sequence[int], responses: Tensor, lens: Sequence[int]
) -> Tensor:
    """Values [B, R] float32 of responses [B, R] of lengths `lens` (row b answers prompt rows[b] of the boundary;
    host integers), 0 past each length; the tokens run packed (`Qwen2_5_VL.packed_hidden`)."""
    pack = model.response_pack(rows, responses, lens)
    hidden = model.packed_hidden(boundary, pack, pack.gather(responses[:, :-1]))  # [M, hidden]
    first = boundary.first_logprobs.index_select(0, torch.tensor(rows, device=model.device))  # [B, 1]
    values = torch.cat([first, pack.scatter(model.lm_head(hidden).float()[:, 0])], dim=1)
    return _masked(values, torch.tensor(lens, device=values.device))


def whole_values(model: Qwen2_5_VL, prompt: Prompt, responses: Tensor, lens: Tensor) -> Tensor:
    """The oracle: values [N, R] of N responses [N, R], each over prompt ++ response, the prompt recomputed."""
    hidden = model.whole_response_hidden(prompt, responses, lens)  # [N, R, hidden]
    return _masked(model.lm_head(hidden).float()[..., 0], lens)


def _masked(values: Tensor, lens: Tensor) -> Tensor:
    real = torch.arange(values.shape[1], device=values.device) < lens.to(values.device)[:, None]
    return values.where(real, 0.0)
