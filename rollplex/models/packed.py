"""Responses packed end to end for scoring: the real tokens of a batch of responses of any prompts, no padding.

The responses of a long-tailed rollout differ in length by 10x and more. Padded to the longest of its batch, most
of a scoring batch's decoder work (every linear layer, norm and the LM head) would run on padding; packed, it
runs on real tokens only, as one [1, tokens, hidden] sequence. The attention keeps the responses apart
(`rollplex.models.attention.PackedPrefixAttention`): each token sees its prompt's real keys and the tokens
before it in its own response.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.models.inputs import to_device


@dataclass(frozen=True)
class ResponsePack:
    """The first counts[b] of the `width` token slots of each row b of a [B, width] batch, packed in row order
    (row 0's tokens, then row 1's, ...); row b answers prompt rows[b] of a boundary.

    index: [M] int64, each packed token's flat slot b * width + t in the batch.
    owner: [M] int64, the row b of each packed token. offset: [M] int64, its t.
    prompt: [M] int64, the prompt rows[b] it answers.
    """

    rows: tuple[int, ...]
    counts: tuple[int, ...]
    width: int
    index: Tensor
    owner: Tensor
    offset: Tensor
    prompt: Tensor

    @staticmethod
    def of(rows: Sequence[int], counts: Sequence[int], width: int, device: torch.device) -> ResponsePack:
        """From host integers (one copy to the device, which the host does not wait for): counts[b] tokens of row b,
        each within [0, width]."""
        if len(rows) != len(counts) or any(not 0 <= c <= width for c in counts):
            raise ValueError(f"a pack needs one count in [0, {width}] per row, got rows {rows}, counts {counts}")
        sizes = torch.tensor(counts, dtype=torch.long)
        owner = torch.repeat_interleave(torch.arange(len(counts)), sizes)
        starts = torch.cumsum(sizes, 0) - sizes
        offset = torch.arange(owner.numel()) - starts[owner]
        prompt = torch.tensor(rows, dtype=torch.long)[owner] if rows else owner
        index, owner, offset, prompt = to_device(torch.stack([owner * width + offset, owner, offset, prompt]), device)
        return ResponsePack(tuple(rows), tuple(counts), width, index, owner, offset, prompt)

    @property
    def num_tokens(self) -> int:
        return sum(self.counts)

    def gather(self, batch: Tensor) -> Tensor:
        """[B, width, ...] -> the packed tokens' [M, ...]."""
        return batch.flatten(0, 1).index_select(0, self.index)

    def scatter(self, packed: Tensor) -> Tensor:
        """[M, ...] -> [B, width, ...], zeros in the slots past each row's count."""
        shape = (len(self.counts) * self.width, *packed.shape[1:])
        whole = packed.new_zeros(shape).index_copy(0, self.index, packed)
        return whole.unflatten(0, (len(self.counts), self.width))
