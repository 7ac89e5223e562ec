"""The decoder layer's halves around its attention compiled as regions (`compile_halves`) against the eager layers:
the same gradients, one compile for every layer and length, copies bound to their own layers."""

from __future__ import annotations

import copy

import pytest
import torch

from rollplex.models import decoder
from rollplex.models.layers import layout_compiled
from rollplex.models.model import Qwen2_5_VL


def _lengths(inputs, length: int):
    """Two prompts (a video's and a text's) and their responses of lengths up to `length`, [P, N, R]."""
    prompts = [inputs.prompt(2, inputs.video((2, 8, 8), second_per_grid_t=1.5), length), inputs.prompt(length + 4)]
    tokens = torch.randint(8, 100, (2, 2, length), generator=torch.Generator().manual_seed(length))
    return prompts, tokens, torch.tensor([[length, 1], [2, length]])


def _gradients(model: Qwen2_5_VL, prompts, tokens, lens) -> dict[str, torch.Tensor]:
    """The attached prefix and the suffix over it, forward and backward: every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    out = model.suffix(model.prefix(prompts, attached=True), tokens, lens)
    (out.logprobs.sum() + 0.1 * out.entropy.sum()).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _seeded(config) -> Qwen2_5_VL:
    torch.manual_seed(0)
    return Qwen2_5_VL(config)


def test_compiled_halves_give_the_eager_gradients_with_one_compile_for_every_layer_and_length(
    config, inputs, monkeypatch
):
    """Forced on the CPU (torch.compile through AOTAutograd, as Inductor sees the graphs): the first call compiles
    each half for its shapes, the first new length once more for every length; no layer compiles its own."""
    from torch._dynamo.backends.registry import lookup_backend

    compiles, aot = [], lookup_backend("aot_eager")

    def counted(gm, example_inputs):
        compiles.append(gm)
        return aot(gm, example_inputs)

    for name, fn in (("_before_region", decoder._before), ("_after_region", decoder._after)):
        monkeypatch.setattr(decoder, name, layout_compiled(fn, counted, lambda x: True, unbacked=True))
    eager, compiled = _seeded(config), _seeded(config)
    decoder.compile_halves(compiled.model.language_model.layers)
    counts = []
    for length in (3, 5, 9):
        batch = _lengths(inputs, length)
        expected, ours = _gradients(eager, *batch), _gradients(compiled, *batch)
        assert expected.keys() == ours.keys()
        for name, g in expected.items():
            torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-6, msg=name)
        counts.append(len(compiles))
    assert counts[1] == counts[2] > 0  # the third length (and every layer) reuses the dynamic compile


def test_without_a_gpu_the_halves_run_eagerly_and_a_copy_binds_them_to_its_own_layers(config, inputs):
    eager, compiled = _seeded(config), _seeded(config)
    decoder.compile_halves(compiled.model.language_model.layers)
    batch = _lengths(inputs, 4)
    expected = _gradients(eager, *batch)
    for model in (compiled, copy.deepcopy(compiled)):
        for layer in model.model.language_model.layers:
            assert layer.before_attention.__self__ is layer and layer.after_attention.__self__ is layer
        ours = _gradients(model, *batch)
        assert all(torch.equal(ours[n], g) for n, g in expected.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_halves_compile_once_for_every_length_with_their_chains_inside(config, inputs):
    """Inductor on the GPU: the halves' elementwise chains (`gpu_compiled`) trace into the region rather than
    compile apart, nothing breaks the graph, and after the first new length no call compiles again."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _seeded(config).cuda(), _seeded(config).cuda()
    decoder.compile_halves(compiled.model.language_model.layers)
    graphs = []
    for length in (3, 5, 9, 17):
        prompts, tokens, lens = _lengths(inputs, length)
        batch = (prompts, tokens.cuda(), lens.cuda())
        expected, ours = _gradients(eager, *batch), _gradients(compiled, *batch)
        for name, g in expected.items():
            torch.testing.assert_close(ours[name], g, rtol=1e-4, atol=1e-5, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] == graphs[-1] and not counters["graph_break"], dict(counters["graph_break"])
