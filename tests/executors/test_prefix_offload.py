"""The actor prefix with its saved tensors offloaded to the host pool: the boundary stays attached and
every gradient equals the one without offload."""

from contextlib import nullcontext

import torch

from rollplex.data.presets import get_preset
from rollplex.data.synthetic import SyntheticVideoQA
from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.scoring import LeafBoundary
from rollplex.memory.host_pool import HostPool
from rollplex.memory.offload import SavedTensorOffload
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL


def gradients(offload: bool) -> tuple[dict[str, torch.Tensor], int]:
    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    t = config.tokens
    tokenizer = CharTokenizer.for_model(t.eos, t.vision_start, t.vision_end, t.image, t.video)
    data = SyntheticVideoQA(get_preset("clevrer").tiny(), tokenizer, seed=1)
    prompts = [data[i].prompt for i in range(2)]
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
