"""The fused elementwise chains (`gpu_compiled`): compiled on a GPU they equal their eager form, gradients
included, for inputs of any length; elsewhere they are their eager form. The decoder layers' and vision blocks'
halves around their attention compiled as regions (`compile_halves`) against the eager model: the same
gradients, one compile for every unit and length, copies bound to their own units."""

from __future__ import annotations

import copy
import types
import uuid
from dataclasses import replace

import pytest
import torch

from rollplex.models import layers
from rollplex.models.layers import compile_halves, layout_compiled, packed_silu_mul, torch_rms_norm
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rotary import apply_rotary, rotated_packed_qkv, split_rotated
from rollplex.parallel.layers import QKVOrder, gated, rotated_qk


def cases(device: str, length: int) -> list[tuple]:
    g = torch.Generator().manual_seed(length)
    leaf = lambda *shape: torch.randn(*shape, generator=g).to(device, torch.bfloat16).requires_grad_()  # noqa: E731
    angles = torch.rand(length, 1, 64, generator=g).to(device) * 6
    text = angles.transpose(0, 1)[None].expand(2, 1, length, 64)
    return [
        (packed_silu_mul, (leaf(length, 2 * 80),)),  # a [gate; up] output
        (apply_rotary, (leaf(length, 4, 64), angles.cos(), angles.sin())),  # the vision tower's [S, heads, D]
        (apply_rotary, (leaf(2, 4, length, 64), text.cos(), text.sin())),  # the decoder's [B, heads, T, D]
        (rotated_packed_qkv, (leaf(length, 3, 4, 64), angles.cos(), angles.sin())),  # the vision GEMM's q, k, v
        (split_rotated, (leaf(2, length, 8 * 64), text.cos(), text.sin(), 4)),  # the decoder's [q; k; v]
        (rotated_qk, (leaf(2, length, 6 * 64), text.cos(), text.sin(), QKVOrder.INTERLEAVED, 4, 1, 64)),  # TP QKV
        (rotated_qk, (leaf(2, length, 8 * 64), text.cos(), text.sin(), QKVOrder.GROUPED, 4, 2, 64)),
        (gated, (leaf(2, length, 2, 2, 48),)),  # the TP MLP's [gate; up] pairs of two blocks
    ]


def outputs(fn, args) -> tuple[torch.Tensor, ...]:
    out = fn(*args)
    return out if isinstance(out, tuple) else (out,)


def shape_recorder():
    """(graphs, backend): a torch.compile backend that records each graph's input shapes as traced (constants, or
    symbols' names) in `graphs` and runs the graph as it is."""
    graphs = []

    def record(gm, example_inputs):
        traced = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        graphs.append([tuple(str(d) for d in x.shape) for x in traced if isinstance(x, torch.Tensor)])
        return gm.forward

    return graphs, record


def test_off_a_gpu_each_chain_is_its_eager_form():
    for fn, args in cases("cpu", 7):
        for ours, eager in zip(outputs(fn, args), outputs(fn.eager, args), strict=True):
            assert torch.equal(ours, eager)


def test_each_input_layout_turns_only_its_changing_dimensions_symbolic():
    """The vision tower's [S, 1280] norm beside the decoder's [B, T, 2048]: a function compiled once for both
    would turn every dimension symbolic, widths included, at the first call of the other rank."""
    graphs, record = shape_recorder()
    norm = layout_compiled(torch_rms_norm, record, lambda x: True)
    for shape in [(100, 48), (90, 48), (2, 50, 32), (2, 40, 32), (3, 40, 32), (80, 48)]:
        x, weight = torch.randn(shape), torch.randn(shape[-1])
        torch.testing.assert_close(norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6))
    widths = {graph[0][-1] for graph in graphs}
    assert widths == {"48", "32"}, graphs  # the widths stay constants in every graph
    assert len(graphs) == 3, graphs  # 2-D: rows symbolic from the first call; 3-D: batch rows, then tokens too
    assert graphs[0][0][0] != "100" and graphs[1][0][1] == "50" and graphs[2][0][1] != "40", graphs


@pytest.mark.parametrize("unbacked", [False, True])
def test_packed_rows_first_are_symbolic_from_the_first_call_so_the_next_count_compiles_nothing(unbacked):
    """The vision tower's chains meet one count of patches a step: static at first, they compiled again in the
    second step. The token-major layout's rows are declared from the first call (unbacked where asked)."""
    graphs, record = shape_recorder()
    name = f"fresh_rotary_{uuid.uuid4().hex}"  # torch keeps which dimensions changed per file, line and name
    fresh = types.FunctionType(
        rotated_packed_qkv.eager.__code__.replace(co_name=name), rotated_packed_qkv.eager.__globals__
    )
    rotary = layout_compiled(fresh, record, lambda x: True, unbacked=unbacked)
    for rows in (30, 20, 45):
        qkv, angles = torch.randn(rows, 3, 4, 16, requires_grad=True), torch.rand(rows, 1, 16)
        cos, sin = angles.cos(), angles.sin()
        for ours, eager in zip(rotary(qkv, cos, sin), fresh(qkv, cos, sin), strict=True):
            torch.testing.assert_close(ours, eager)
        marks = [name for t in (qkv, cos, sin) for name in vars(t) if "dynamic" in name or "unbacked" in name]
        assert not marks, marks  # declared on aliases: the caller's tensors keep none
    assert len(graphs) == 1, graphs
    (qkv_dims, *_) = graphs[0]
    assert qkv_dims[1:] == ("3", "4", "16") and qkv_dims[0].startswith("u" if unbacked else "s"), graphs


def test_a_chain_called_inside_a_compiled_region_is_traced_into_it_not_compiled_apart():
    """`run.compiled_layers` compiles a layer's halves whole: the chains they call become part of that graph."""
    inner, outer = [], []

    def counted(found):
        def backend(gm, example_inputs):
            found.append(gm)
            return gm.forward

        return backend

    norm = layout_compiled(torch_rms_norm, counted(inner), lambda x: True)
    region = torch.compile(lambda x, w: norm(x * 2, w, 1e-6) + 1, backend=counted(outer))
    x, weight = torch.randn(5, 48), torch.randn(48)
    torch.testing.assert_close(region(x, weight), torch_rms_norm(x * 2, weight, 1e-6) + 1)
    assert len(outer) == 1 and not inner
    targets = {str(node.target) for node in outer[0].graph.nodes if node.op == "call_function"}
    assert any("rms_norm" in t for t in targets), targets  # the norm's ops are in the region's graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("length", [37, 1000, 4099])  # a second length compiles the one that serves every length
def test_on_a_gpu_the_compiled_chains_equal_their_eager_form_gradients_included(length):
    for fn, args in cases("cuda", length):
        outs = [outputs(fn, args), outputs(fn.eager, args)]
        for a, b in zip(*outs, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)
        weights = [torch.randn_like(o) for o in outs[0]]
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        losses = (sum((o.float() * w).sum() for o, w in zip(out, weights, strict=True)) for out in outs)
        ours, eager = (torch.autograd.grad(loss, leaves) for loss in losses)
        for a, b in zip(ours, eager, strict=True):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")],
        ),
    ],
)
@pytest.mark.parametrize("layout", ["decoder", "vision"])
def test_a_norm_compiles_once_for_every_length_its_weight_gradient_sums_over(device, layout):
    """Inductor picks how to sum the weight's gradient over tokens by the tokens' range and guards on it: with
    backed lengths, a length past 4,096 (on the CPU) or in another range (on a GPU: under 2,560, up to 4,095,
    beyond) compiled the norm again. The decoder's [1, T, width] compiles static, then with T unbacked; the vision
    tower's packed [S, width] with S unbacked from its first call."""
    compiles = []

    def counted(gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        compiles.append(len(compiles))
        return compile_fx(gm, example_inputs)

    name = f"fresh_norm_{uuid.uuid4().hex}"  # torch keeps which dimensions changed per file, line and name
    fresh = types.FunctionType(torch_rms_norm.__code__.replace(co_name=name), torch_rms_norm.__globals__)
    norm = layout_compiled(fresh, counted, lambda x: True, unbacked=True)
    torch.manual_seed(0)
    dtype, width = (torch.float32, 8) if device == "cpu" else (torch.bfloat16, 2048)
    tolerance = {} if device == "cpu" else {"rtol": 2e-2, "atol": 2e-2}
    weight = torch.randn(width, device=device, dtype=dtype, requires_grad=True)
    for length in [300, 200, 5000, 2, 3226, 9000, 965]:
        rows = (1, length) if layout == "decoder" else (length,)
        x = torch.randn(*rows, width, device=device, dtype=dtype, requires_grad=True)
        ours, eager = norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6)
        torch.testing.assert_close(ours, eager, **tolerance)
        grads = [torch.autograd.grad(out.float().square().sum(), (x, weight)) for out in (ours, eager)]
        for a, b in zip(*grads, strict=True):  # the weight's sums over tokens in another order
            largest = max(1.0, float(b.abs().max()))  # sums over thousands of tokens: relative to the largest
            if device == "cpu":
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * largest)
            else:  # bf16
                torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * largest)
    assert len(compiles) == (2 if layout == "decoder" else 1)  # static, then the length unbacked; or unbacked at once


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


def _seeded(config, compiled: bool = False) -> Qwen2_5_VL:
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    if compiled:
        compile_halves(_units(model))
    return model


def _units(model: Qwen2_5_VL) -> list[torch.nn.Module]:
    return [*model.model.visual.blocks, *model.model.language_model.layers]


def test_compiled_halves_give_the_eager_gradients_with_one_compile_for_every_layer_and_length(
    config, inputs, monkeypatch
):
    """Forced on the CPU (torch.compile through AOTAutograd, as Inductor sees the graphs): the first call compiles
    each half for its shapes, the first new length once more for every length; no unit compiles its own (a vision
    block's halves, of another layout, compile apart from a decoder layer's)."""
    from torch._dynamo.backends.registry import lookup_backend

    compiles, aot = [], lookup_backend("aot_eager")

    def counted(gm, example_inputs):
        compiles.append(gm)
        return aot(gm, example_inputs)

    for name, fn in (("_before_region", layers._before), ("_after_region", layers._after)):
        monkeypatch.setattr(layers, name, layout_compiled(fn, counted, lambda x: True, unbacked=True))
    eager, compiled = _seeded(config), _seeded(config, compiled=True)
    counts = []
    for length in (3, 5, 9):
        batch = _lengths(inputs, length)
        expected, ours = _gradients(eager, *batch), _gradients(compiled, *batch)
        assert expected.keys() == ours.keys()
        for name, g in expected.items():
            torch.testing.assert_close(ours[name], g, rtol=1e-5, atol=1e-6, msg=name)
        counts.append(len(compiles))
    assert counts[1] == counts[2] > 0  # the third length (and every layer) reuses the dynamic compile
    deeper = replace(config, text=replace(config.text, num_hidden_layers=3 * config.text.num_hidden_layers))
    _gradients(_seeded(deeper, compiled=True), *_lengths(inputs, 9))
    assert len(compiles) == counts[2]  # a model of three times the layers: no compile of its own for any of them


def test_without_a_gpu_the_halves_run_eagerly_and_a_copy_binds_them_to_its_own_units(config, inputs):
    eager, compiled = _seeded(config), _seeded(config, compiled=True)
    batch = _lengths(inputs, 4)
    expected = _gradients(eager, *batch)
    for model in (compiled, copy.deepcopy(compiled)):
        for unit in _units(model):
            assert unit.before_attention.__self__ is unit and unit.after_attention.__self__ is unit
            assert "after_attention" in unit.__dict__
        ours = _gradients(model, *batch)
        assert all(torch.equal(ours[n], g) for n, g in expected.items())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_compiled_halves_give_the_eager_gradients_with_nothing_breaking_the_graph(config, inputs):
    """Inductor on the GPU: the halves' elementwise chains (`gpu_compiled`) trace into the region rather than
    compile apart, nothing breaks the graph, and every length's gradients match eager's. New lengths may still
    compile now and then (an H100 counted 20, 22, 22, 23, 23 and 24 graphs over these lengths)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _seeded(config).cuda(), _seeded(config, compiled=True).cuda()
    for length in (3, 5, 9, 17, 33, 65):
        prompts, tokens, lens = _lengths(inputs, length)
        batch = (prompts, tokens.cuda(), lens.cuda())
        expected, ours = _gradients(eager, *batch), _gradients(compiled, *batch)
        for name, g in expected.items():
            torch.testing.assert_close(ours[name], g, rtol=1e-4, atol=1e-5, msg=name)
    assert not counters["graph_break"], dict(counters["graph_break"])
