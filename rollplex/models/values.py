"""A value model for PPO's critic: the policy's Qwen2.5-VL with its LM head replaced by a scalar head.

The critic starts from the policy's initial weights (vision tower and language model) and a fresh head
(`make_value_model`). Its value of response token j is the head at the position before j, as the log-prob of j
is: the prompt's last position for token 0 (the boundary's `first_logprobs` slot holds it, [P, 1]), the
response's own positions for the rest. Split (`suffix_values`) or over prompt ++ response (`whole_values`, the
oracle), like the policy's scores.
"""

from __future__ import annotations

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


def suffix_values(model: Qwen2_5_VL, boundary: Boundary, rows: Tensor, responses: Tensor, lens: Tensor) -> Tensor:
    """Values [B, R] float32 of responses [B, R] (row b answers prompt rows[b] of the boundary), 0 past each
    length."""
    hidden = model.rows_hidden(boundary, rows, responses[:, :-1])  # [B, R-1, hidden]
    first = boundary.first_logprobs.index_select(0, rows)  # [B, 1]: the head at the prompt's last position
    values = torch.cat([first, model.lm_head(hidden).float()[..., 0]], dim=1)
    return _masked(values, lens)


def whole_values(model: Qwen2_5_VL, prompt: Prompt, responses: Tensor, lens: Tensor) -> Tensor:
    """The oracle: values [N, R] of N responses [N, R], each over prompt ++ response, the prompt recomputed."""
    hidden = model.whole_response_hidden(prompt, responses, lens)  # [N, R, hidden]
    return _masked(model.lm_head(hidden).float()[..., 0], lens)


def _masked(values: Tensor, lens: Tensor) -> Tensor:
    real = torch.arange(values.shape[1], device=values.device) < lens.to(values.device)[:, None]
    return values.where(real, 0.0)
