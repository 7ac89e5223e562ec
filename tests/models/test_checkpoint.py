"""Checkpoints round-trip, shard, accept transformers 4.x names, and load in transformers (and back)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from rollplex.models.checkpoint import INDEX_FILE, SINGLE_FILE, load_checkpoint, load_pretrained, save_checkpoint
from rollplex.models.config import config_from_hf, load_model_config
from rollplex.models.hf_config import hf_config_dict
from rollplex.models.model import Qwen2_5_VL


def fresh(config, seed: int = 1) -> Qwen2_5_VL:
    torch.manual_seed(seed)
    return Qwen2_5_VL(config)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert set(state_a) == set(state_b)
    assert all(torch.equal(state_a[name], state_b[name]) for name in state_a)


def test_saved_weights_load_back_exactly(model, config, tmp_path):
    save_checkpoint(model, tmp_path)
    assert (tmp_path / SINGLE_FILE).is_file() and not (tmp_path / INDEX_FILE).exists()
    other = fresh(config)
    load_checkpoint(other, tmp_path)
    assert_same_weights(model, other)


def test_sharded_checkpoints_write_an_index_and_load_back_exactly(model, config, tmp_path):
    save_checkpoint(model, tmp_path, max_shard_bytes=64 * 1024)
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(index["weight_map"]) == set(model.state_dict())
    other = fresh(config)
    load_checkpoint(other, tmp_path)
    assert_same_weights(model, other)


def test_transformers_4_names_of_released_checkpoints_load(model, config, tmp_path):
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / SINGLE_FILE)
    old = {
        name.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
        for name, t in tensors.items()
    }
    save_file(old, tmp_path / SINGLE_FILE)
    other = fresh(config)
    load_checkpoint(other, tmp_path)
    assert_same_weights(model, other)


def test_a_missing_parameter_is_named(model, config, tmp_path):
    save_checkpoint(model, tmp_path)
    tensors = load_file(tmp_path / SINGLE_FILE)
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, tmp_path / SINGLE_FILE)
    with pytest.raises(ValueError, match=r"norm\.weight"):
        load_checkpoint(fresh(config), tmp_path)


def test_tied_checkpoints_omit_the_head_and_load_it_tied(config, tmp_path):
    tied = dataclasses.replace(config, text=dataclasses.replace(config.text, tie_word_embeddings=True))
    model = fresh(tied, seed=0)
    save_checkpoint(model, tmp_path)
    assert "lm_head.weight" not in load_file(tmp_path / SINGLE_FILE)
    other = load_pretrained(tmp_path, dtype=torch.float32)
    assert other.lm_head.weight is other.model.language_model.embed_tokens.weight
    assert_same_weights(model, other)


def test_the_written_config_reads_back_as_the_same_config(config):
    assert config_from_hf(hf_config_dict(config, torch.bfloat16), config.name) == config
    qwen = load_model_config("qwen2_5_vl_7b")  # two ends, as Qwen2.5-VL's generation config has
    assert qwen.tokens.stop_ids == (151645, 151643)
    assert config_from_hf(hf_config_dict(qwen, torch.bfloat16), qwen.name) == qwen


def test_a_checkpoints_generation_config_adds_the_ends_a_response_stops_at(config, tmp_path):
    written = {**hf_config_dict(config, torch.bfloat16), "eos_token_id": 7}
    (tmp_path / "config.json").write_text(json.dumps(written))
    assert load_model_config(str(tmp_path)).tokens.stop_ids == (7,)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "top_p": 0.001}))
    tokens = load_model_config(str(tmp_path)).tokens
    assert tokens.eos == 7 and tokens.stop_ids == (7, 9)
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config\.json: not a JSON config"):
        load_model_config(str(tmp_path))


def test_transformers_loads_our_checkpoint_and_we_load_its_checkpoint(model, config, tmp_path):
    from transformers import Qwen2_5_VLForConditionalGeneration

    save_checkpoint(model, tmp_path / "ours")
    hf_model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "ours", dtype=torch.float32)
    assert_same_weights(model, hf_model)
    hf_model.save_pretrained(tmp_path / "theirs")
    assert_same_weights(model, load_pretrained(tmp_path / "theirs", dtype=torch.float32))
