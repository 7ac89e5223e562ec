"""The actor prefix with its saved tensors offloaded to the host pool: the boundary stays attached and
every gradient equals the one without offload."""

from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import torch

import rollplex.memory.offload as offload_module
from rollplex.data.presets import get_preset
from rollplex.data.synthetic import SyntheticVideoQA
from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.residency import make_prefix_memory, make_prefix_rerun
from rollplex.executors.scoring import LeafBoundary
from rollplex.graph.load import load_spec, parse_spec
from rollplex.graph.memobject import Residency
from rollplex.graph.plan import compile_plan
from rollplex.memory.host_pool import HostPool
from rollplex.memory.offload import SavedTensorOffload, recompute
from rollplex.models.chunks import drain
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL

ROOT = Path(__file__).resolve().parents[2]


def tiny_prompts() -> list:
    t = load_model_config("tiny").tokens
    tokenizer = CharTokenizer.for_model(t.eos, t.vision_start, t.vision_end, t.image, t.video)
    data = SyntheticVideoQA(get_preset("clevrer").tiny(), tokenizer, seed=1)
    return [data[i].prompt for i in range(2)]


def gradients(offload: bool) -> tuple[dict[str, torch.Tensor], int]:
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    prompts = tiny_prompts()
    responses = torch.randint(8, 100, (2, 3, 5), generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([[5, 3, 1], [2, 5, 4]])
    with HostPool(64 << 20) as pool:
        context = SavedTensorOffload(pool, keep=model.parameters()) if offload else nullcontext()
        with context:
            boundary = model.prefix(prompts, attached=True)
        assert boundary.keys[0].requires_grad
        leaf = LeafBoundary.of(boundary)
        out = model.suffix(leaf.leaf, responses, lens)
        (out.logprobs * torch.linspace(-1, 1, 5)).sum().backward()
        leaf.backward_through_prefix()
        num_bytes = context.stats().num_bytes if offload else 0
    return {n: p.grad.clone() for n, p in model.named_parameters()}, num_bytes


def test_offloaded_prefix_saved_tensors_give_bitwise_the_same_gradients_vision_included():
    plain, _ = gradients(offload=False)
    offloaded, num_bytes = gradients(offload=True)
    assert num_bytes > 0
    assert plain.keys() == offloaded.keys()
    assert any(g.abs().sum() > 0 for n, g in plain.items() if n.startswith("model.visual."))
    for name in plain:
        assert torch.equal(plain[name], offloaded[name]), name


def test_recompute_offloads_the_kept_layer_inputs_when_the_plan_puts_them_on_the_host(monkeypatch):
    packed: list[torch.Tensor] = []

    class Counting(offload_module.SavedTensorOffload):
        def _pack(self, tensor):
            packed.append(tensor)
            return super()._pack(tensor)

    monkeypatch.setattr(offload_module, "SavedTensorOffload", Counting)
    base = load_spec(ROOT / "specs/tiny_cpu.yaml")
    saved_bytes = {}
    for mode in ("offload", "recompute"):
        memory = base.spec.memory.model_copy(update={"prefix_activations": mode, "prefix_saved": "host"})
        loaded = replace(base, spec=base.spec.model_copy(update={"memory": memory}))
        decisions = compile_plan(loaded).decisions
        assert decisions.prefix_saved is Residency.HOST and decisions.host_pool_bytes > 0  # the plan: host
        torch.manual_seed(0)
        model = Qwen2_5_VL(load_model_config("tiny"))
        packed.clear()
        rerun = make_prefix_rerun(decisions, torch.device("cpu"))
        assert (rerun is not None) == (mode == "recompute")
        with make_prefix_memory(decisions, model)():
            boundary = drain(model.prefix_chunks(tiny_prompts(), attached=True, rerun=rerun))
        assert boundary.keys[0].requires_grad
        saved_bytes[mode] = sum(t.numel() * t.element_size() for t in packed)
    # under recompute the checkpointed modules' inputs (and what runs outside them) still reach the host pool
    assert 0 < saved_bytes["recompute"] < saved_bytes["offload"] / 2


def test_recompute_keeps_the_layer_inputs_in_hbm_when_the_plan_does(monkeypatch):
    made = []
    monkeypatch.setattr(offload_module, "SavedTensorOffload", lambda *a, **k: made.append(a))
    text = (ROOT / "specs/qwen2_5_vl_7b_h200.yaml").read_text()
    decisions = compile_plan(parse_spec(text.replace("memory:\n", "memory:\n  prefix_saved: hbm\n"))).decisions
    assert decisions.prefix_saved is Residency.HBM and decisions.host_pool_bytes == 0
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    with make_prefix_memory(decisions, model)():
        pass
    assert not made
    assert make_prefix_rerun(decisions, torch.device("cpu")) is not None  # the units still keep only their inputs


def test_a_prefix_under_torch_checkpoint_keeps_one_kv_per_layer_and_its_gradients():
    # backward reruns each checkpointed layer: the rerun's K and V must not join the boundary's
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config("tiny"))
    plain = model.prefix(tiny_prompts(), attached=True)
    (plain.keys[-1].float().sum() + plain.first_logprobs.sum()).backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    with recompute([*model.model.visual.blocks, *model.model.language_model.layers]):
        boundary = model.prefix(tiny_prompts(), attached=True)
        (boundary.keys[-1].float().sum() + boundary.first_logprobs.sum()).backward()  # reruns every layer
    assert len(boundary.keys) == len(boundary.values) == len(model.model.language_model.layers)
    for name, g in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, g, rtol=1e-5, atol=1e-7, msg=name)


def test_each_process_pins_its_gpus_share_of_the_nodes_host_pool():
    base = load_spec(ROOT / "specs/tiny_cpu.yaml")
    pools = {}
    for gpus in (1, 2):
        memory = base.spec.memory.model_copy(update={"prefix_saved": "host", "host_pool_gib": 2.0})
        cluster = base.spec.cluster.model_copy(update={"gpus_per_node": gpus})
        loaded = replace(base, spec=base.spec.model_copy(update={"memory": memory, "cluster": cluster}))
        decisions = compile_plan(loaded).decisions
        assert decisions.prefix_saved is Residency.HOST
        pools[gpus] = decisions.host_pool_bytes
    assert pools == {1: 2 << 30, 2: 1 << 30}  # the spec's pool is per node: one process a GPU pins its share
