"""Reads and writes Qwen2.5-VL weights as HF safetensors in a local directory: one `model.safetensors`, or
shards listed by `model.safetensors.index.json`.

Names are transformers 5.x names (`model.visual.*`, `model.language_model.*`, `lm_head.weight`), which are the
model's own; the 4.x names of the released checkpoints (`visual.*`, `model.*`) are accepted on load. With tied
embeddings `lm_head.weight` is not written and ignored when read. Not here: parsing `config.json` (`config.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from rollplex.graph.spec_files import INDEX_FILE, SINGLE_FILE, checkpoint_files
from rollplex.models.config import ModelConfig, load_model_config
from rollplex.models.hf_config import hf_config_dict
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.vision import hf_shaped

TIED_HEAD = "lm_head.weight"


def current_name(name: str) -> str:
    """Maps a transformers 4.x parameter name to its 5.x name; 5.x names pass unchanged."""
    if name.startswith("visual."):
        return f"model.{name}"
    if name.startswith("model.") and not name.startswith(("model.visual.", "model.language_model.")):
        return f"model.language_model.{name.removeprefix('model.')}"
    return name


@torch.no_grad()
def load_checkpoint(model: Qwen2_5_VL, directory: str | Path) -> None:
    """Copies every parameter from the checkpoint (converted to the model's dtype, on the model's device)."""
    # a tied head appears once, as the embedding; the vision MLPs' as views of transformers' shapes (`VisionMLP`)
    params = hf_shaped(dict(model.named_parameters()), model.config.vision)
    loaded: set[str] = set()
    for path in checkpoint_files(Path(directory)):
        with safe_open(str(path), framework="pt") as file:
            for key in file.keys():  # noqa: SIM118 (a safetensors file is not a dict)
                name = current_name(key)
                if name == TIED_HEAD and model.config.text.tie_word_embeddings:
                    continue
                if name not in params:
                    raise ValueError(f"{path.name} holds '{key}', which is no Qwen2.5-VL parameter of this config")
                _copy(params[name], file.get_tensor(key), key)
                loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} parameters, e.g. {missing[:3]}")
    model.zero_padding()  # the model may have been built on uninitialised memory (`load_pretrained`)


def _copy(param: Tensor, tensor: Tensor, key: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"'{key}' has shape {tuple(tensor.shape)} but the model expects {tuple(param.shape)}")
    param.copy_(tensor)


def save_checkpoint(model: Qwen2_5_VL, directory: str | Path, *, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `config.json` and the weights under HF names; shards (with an index) above max_shard_bytes."""
    save_state(dict(model.named_parameters()), model.config, directory, max_shard_bytes=max_shard_bytes)


def save_state(
    params: dict[str, Tensor], config: ModelConfig, directory: str | Path, *, max_shard_bytes: int = 5 * 2**30
) -> None:
    """`save_checkpoint` of HF-named tensors (e.g. gathered from tensor-parallel shards)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    params = hf_shaped(params, config.vision)
    dtype = next(iter(params.values())).dtype
    (directory / "config.json").write_text(json.dumps(hf_config_dict(config, dtype), indent=2))
    shards = _shards(params, max_shard_bytes)
    if len(shards) == 1:
        _save(shards[0], directory / SINGLE_FILE)
        return
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        file_name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, directory / file_name)
        weight_map |= dict.fromkeys(shard, file_name)
    total = sum(p.numel() * p.element_size() for p in params.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def _shards(params: dict[str, Tensor], max_shard_bytes: int) -> list[dict[str, Tensor]]:
    """Greedy split in parameter order; a parameter larger than the limit gets a shard of its own."""
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, param in params.items():
        num_bytes = param.numel() * param.element_size()
        if shards[-1] and size + num_bytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = param
        size += num_bytes
    return shards


def _save(params: dict[str, Tensor], path: Path) -> None:
    tensors = {name: param.detach().to("cpu").contiguous() for name, param in params.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


def load_pretrained(
    directory: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu"
) -> Qwen2_5_VL:
    """A model built from the directory's `config.json` and weights, without a random initialisation first."""
    model = Qwen2_5_VL(load_model_config(str(directory)), dtype=dtype, device="meta")
    model.to_empty(device=device)
    model.pack_projections()
    model.tie_weights()
    load_checkpoint(model, directory)
    return model
