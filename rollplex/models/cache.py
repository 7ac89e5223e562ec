"""KV cache of the response tokens decoded so far (the prompt's KV is the shared boundary, not cached here).

Lifecycle of a `ResponseCache`, one decode step at a time:

    empty (length 0) --write(layer, k, v) in every layer, advance(T)--> length T --> ... --> max_tokens
"""

from __future__ import annotations

import torch
from torch import Tensor

from rollplex.models.config import TextConfig


class ResponseCache:
    """Per layer, K and V [batch, kv_heads, max_tokens, head_dim], filled left to right."""

    def __init__(
        self, text: TextConfig, batch: int, max_tokens: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        shape = (batch, text.num_key_value_heads, max_tokens, text.head_dim)
        self.keys = [torch.empty(shape, dtype=dtype, device=device) for _ in range(text.num_hidden_layers)]
        self.values = [torch.empty(shape, dtype=dtype, device=device) for _ in range(text.num_hidden_layers)]
        self.length = 0

    def write(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Stores the new tokens' k, v [batch, kv_heads, T, D] after the cached ones; returns all of them."""
        end = self.length + k.shape[2]
        self.keys[layer][:, :, self.length : end] = k
        self.values[layer][:, :, self.length : end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def advance(self, num_tokens: int) -> None:
        """Marks the tokens written by the last step (in every layer) as cached."""
        self.length += num_tokens
