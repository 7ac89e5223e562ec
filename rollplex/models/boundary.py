"""The boundary: the state of P prompts at their first response position, all a suffix needs from the prefix.

Made by `Qwen2_5_VL.prefix`, read by `Qwen2_5_VL.suffix` and by rollout decode. Attached (actor) boundaries
keep the autograd graph back to the vision encoder; detached (reference, rollout) ones hold plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class Boundary:
    """Per prompt p of P, right-padded to S = the longest prompt:

    keys, values: one [P, kv_heads, S, head_dim] tensor per decoder layer; keys are post-rotary.
    first_logprobs: [P, vocab] float32, log_softmax of the logits at the prompt's last position: the
        distribution of response token 0 (a value model's boundary: [P, 1], the value of token 0).
    next_positions: [P] int64, the rotary position of response token 0 on all three mrope axes (token j: +j).
    prompt_lens: [P] int64; positions >= prompt_lens[p] of keys/values are padding.
    host_prompt_lens: the same on the host where the boundary's maker knew them (else empty): read without a sync.
    """

    keys: tuple[Tensor, ...]
    values: tuple[Tensor, ...]
    first_logprobs: Tensor
    next_positions: Tensor
    prompt_lens: Tensor
    host_prompt_lens: tuple[int, ...] = ()

    @property
    def num_prompts(self) -> int:
        return self.first_logprobs.shape[0]

    @property
    def max_prompt_len(self) -> int:
        return self.keys[0].shape[2]

    @property
    def num_bytes(self) -> int:
        tensors = (*self.keys, *self.values, self.first_logprobs, self.next_positions, self.prompt_lens)
        return sum(t.numel() * t.element_size() for t in tensors)

    def detached(self) -> Boundary:
        """The same tensors outside autograd (what rollout decode reads of an attached boundary)."""
        return Boundary(
            tuple(k.detach() for k in self.keys), tuple(v.detach() for v in self.values),
            self.first_logprobs.detach(), self.next_positions, self.prompt_lens, self.host_prompt_lens,
        )  # fmt: skip

    def key_mask(self) -> Tensor:
        """[P, S] bool: True where a key is a real prompt token."""
        return torch.arange(self.max_prompt_len, device=self.prompt_lens.device) < self.prompt_lens[:, None]


def concat_boundaries(parts: list[Boundary]) -> Boundary:
    """One boundary of the prompts of every part, in order; KV right-padded (with zeros) to the longest prompt.

    Autograd flows through (attached parts stay attached). A single part is returned as it is."""
    if len(parts) == 1:
        return parts[0]
    longest = max(p.max_prompt_len for p in parts)

    def cat(tensors: list[Tensor]) -> Tensor:
        return torch.cat([F.pad(t, (0, 0, 0, longest - t.shape[2])) for t in tensors])

    num_layers = len(parts[0].keys)
    return Boundary(
        keys=tuple(cat([p.keys[i] for p in parts]) for i in range(num_layers)),
        values=tuple(cat([p.values[i] for p in parts]) for i in range(num_layers)),
        first_logprobs=torch.cat([p.first_logprobs for p in parts]),
        next_positions=torch.cat([p.next_positions for p in parts]),
        prompt_lens=torch.cat([p.prompt_lens for p in parts]),
        host_prompt_lens=sum((p.host_prompt_lens for p in parts), ()) if all(p.host_prompt_lens for p in parts) else (),
    )
