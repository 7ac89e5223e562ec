"""Writes a `ModelConfig` back as the dict of an HF Qwen2.5-VL `config.json` (the layout of the released files).

The inverse of `config.config_from_hf`: `config_from_hf(hf_config_dict(c, dtype), c.name) == c`. Not here:
reading configs (`config.py`), weights (`checkpoint.py`).
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from rollplex.models.config import ModelConfig, VisionConfig


def hf_config_dict(config: ModelConfig, dtype: torch.dtype) -> dict:
    text, tokens = config.text, config.tokens
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "hidden_act": "silu",
        "vocab_size": text.vocab_size,
        "hidden_size": text.hidden_size,
        "intermediate_size": text.intermediate_size,
        "num_hidden_layers": text.num_hidden_layers,
        "num_attention_heads": text.num_attention_heads,
        "num_key_value_heads": text.num_key_value_heads,
        "rms_norm_eps": text.rms_norm_eps,
        "rope_theta": text.rope_theta,
        "rope_scaling": {"type": "mrope", "mrope_section": list(text.mrope_section)},
        "tie_word_embeddings": text.tie_word_embeddings,
        "max_position_embeddings": text.max_position_embeddings,
        "eos_token_id": list(tokens.stop_ids) if tokens.stops else tokens.eos,
        "vision_start_token_id": tokens.vision_start,
        "vision_end_token_id": tokens.vision_end,
        "image_token_id": tokens.image,
        "video_token_id": tokens.video,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "vision_config": _vision_dict(config.vision),
    }


def _vision_dict(vision: VisionConfig) -> dict:
    fields = asdict(vision)
    fields["in_chans"] = fields.pop("in_channels")
    fields["fullatt_block_indexes"] = list(vision.fullatt_block_indexes)
    if vision.tokens_per_second.is_integer():
        fields["tokens_per_second"] = int(vision.tokens_per_second)  # transformers insists on an int
    return {"hidden_act": "silu", **fields}
