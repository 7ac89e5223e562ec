"""Parameter counts equal transformers' models; per-token bytes follow the shapes."""

import json

import pytest

from rollplex.layout.shapes import (
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    layer_input_bytes_per_token,
    llm_params,
    vision_params,
)
from rollplex.models.config import CONFIG_DIR, load_model_config, shipped_model_names

PUBLIC_LLM_PARAMS = {
    "qwen2_5_vl_3b": 3_085_938_688,
    "qwen2_5_vl_7b": 7_615_616_512,
    "qwen2_5_vl_32b": 32_763_876_352,
    "qwen2_5_vl_72b": 72_706_203_648,
}


@pytest.mark.parametrize("name", sorted(PUBLIC_LLM_PARAMS))
def test_llm_parameter_counts_match_the_public_models(name):
    assert llm_params(load_model_config(name).text) == PUBLIC_LLM_PARAMS[name]


@pytest.mark.parametrize("name", ["tiny", "qwen2_5_vl_7b"])
def test_parameter_counts_equal_transformers_built_on_meta(name):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen2_5_VLConfig(**json.loads((CONFIG_DIR / f"{name}.json").read_text()))
    with torch.device("meta"):
        model = transformers.Qwen2_5_VLForConditionalGeneration(config)
    vision = sum(p.numel() for n, p in model.named_parameters() if ".visual." in f".{n}")
    total = sum(p.numel() for p in model.parameters())
    c = load_model_config(name)
    assert (vision, total - vision) == (vision_params(c.vision), llm_params(c.text))


def test_every_shipped_config_loads():
    assert {"qwen2_5_vl_3b", "qwen2_5_vl_7b", "qwen2_5_vl_32b", "qwen2_5_vl_72b", "tiny"} <= set(shipped_model_names())


def test_kv_and_activation_bytes_per_token_divide_by_tp_where_the_layers_split_them():
    t = load_model_config("qwen2_5_vl_32b").text
    assert kv_bytes_per_token(t, 1) == 256 * 1024  # 64 layers x 8 heads x 128 x K,V x BF16
    assert kv_bytes_per_token(t, 8) == 32 * 1024
    whole = layer_activation_bytes_per_token(t, 1)
    assert layer_activation_bytes_per_token(t, 8, sp=True) * 8 == pytest.approx(whole, rel=1e-9)  # Megatron SP
    hidden = 4 * t.hidden_size * 2  # two norm inputs and the QKV and MLP inputs, BF16: whole on every rank
    assert layer_activation_bytes_per_token(t, 8) == hidden + (whole - hidden) // 8
    assert layer_input_bytes_per_token(t, 8) == t.hidden_size * 2 == 8 * layer_input_bytes_per_token(t, 8, sp=True)


@pytest.mark.parametrize("name", ["tiny", "qwen2_5_vl_3b"])
def test_stored_vision_parameter_counts_equal_what_the_runtime_model_holds(name):
    pytest.importorskip("torch")
    from rollplex.models.model import Qwen2_5_VL

    c = load_model_config(name)  # 3B's vision MLP width 3420 is stored 3456 wide
    model = Qwen2_5_VL(c, device="meta")
    held = sum(p.numel() for p in model.model.visual.parameters())
    assert held == vision_params(c.vision, stored=True)
    assert (held > vision_params(c.vision)) == (c.vision.intermediate_size % 64 != 0)


@pytest.mark.parametrize("name", ["tiny", "qwen2_5_vl_3b", "qwen2_5_vl_7b"])  # 3B ties its head, 7B does not
def test_a_value_models_parameter_count_equals_the_critic_the_runtime_builds(name):
    pytest.importorskip("torch")
    from rollplex.layout.shapes import value_model_params_per_rank
    from rollplex.models.model import Qwen2_5_VL
    from rollplex.models.values import make_value_model

    c = load_model_config(name)
    critic = make_value_model(Qwen2_5_VL(c, device="meta"), seed=0)
    held = sum(p.numel() for n, p in critic.named_parameters() if not n.startswith("model.visual."))
    assert held == value_model_params_per_rank(c.text, 1)
