"""Packs token sequences (prompts, or prompt ++ response for the unsplit path) into one right-padded batch.

Right padding with causal attention needs no key mask: a real token never sees the padding after it. Values at
padded positions (ids 0, positions 0) are placeholders whose outputs are to be ignored. Tensors are built on
the CPU; the model moves them. Not here: embedding and running the batch (`model.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rollplex.models.config import ModelConfig, TokenIds
from rollplex.models.inputs import Prompt, Visual
from rollplex.models.positions import sequence_positions


@dataclass(frozen=True)
class PackedSequences:
    input_ids: Tensor  # [B, L] int64, 0 at padding
    lens: Tensor  # [B] int64
    positions: Tensor  # [3, B, L] int64 mrope position ids, 0 at padding
    next_positions: Tensor  # [B] int64, the position that would follow each sequence
    visuals: tuple[Visual, ...]  # all visuals, by sequence then by appearance
    text_from: Tensor  # [B] int64: where each sequence's response (all text) starts; its length if none

    def visual_slots(self, tokens: TokenIds) -> Tensor:
        """[B, L] bool: the prompts' image/video tokens, whose embeddings the vision encoder provides."""
        ids = self.input_ids
        in_prompt = torch.arange(ids.shape[1]) < self.text_from[:, None]
        return in_prompt & ((ids == tokens.image) | (ids == tokens.video))


def pack_sequences(sequences: Sequence[Prompt], config: ModelConfig) -> PackedSequences:
    if not sequences:
        raise ValueError("no sequences given: pass at least one prompt")
    lens = torch.tensor([sequence.num_tokens for sequence in sequences])
    if int(lens.min()) == 0:
        raise ValueError("a sequence has no tokens: every prompt needs at least one token")
    input_ids = torch.zeros(len(sequences), int(lens.max()), dtype=torch.long)
    positions = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    next_positions = []
    for row, sequence in enumerate(sequences):
        ids = sequence.input_ids.cpu()
        input_ids[row, : ids.numel()] = ids
        sequence_pos, next_position = sequence_positions(ids, sequence.visuals, config, sequence.response_start)
        positions[:, row, : ids.numel()] = sequence_pos
        next_positions.append(next_position)
    visuals = tuple(visual for sequence in sequences for visual in sequence.visuals)
    text_from = torch.tensor([s.num_tokens if s.response_start is None else s.response_start for s in sequences])
    return PackedSequences(input_ids, lens, positions, torch.tensor(next_positions), visuals, text_from)
