"""`Rerun`: checkpointed units whose backward reruns them (on a chosen stream): the same boundary and the same
gradients as the plain attached prefix, only the units' inputs kept."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from rollplex.memory.host_pool import HostPool
from rollplex.memory.offload import SavedTensorOffload
from rollplex.models.chunks import drain
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.rerun import Rerun


def prefix_gradients(model, prompts, rerun: Rerun | None, prompts_per_chunk: int | None = None):
    """Boundary and parameter gradients of a loss on every boundary output (K, V of each layer, first log-probs)."""
    model.zero_grad(set_to_none=True)
    chunks = model.prefix_chunks(prompts, attached=True, prompts_per_chunk=prompts_per_chunk, rerun=rerun)
    with torch.no_grad():  # rollout decode drains the chunks under no_grad
        boundary = drain(chunks)
    weights = [torch.linspace(-1, 1, k.numel()).view_as(k) for k in boundary.keys]
    pairs = zip(boundary.keys, boundary.values, weights, strict=True)
    loss = sum((k.float() * w).sum() + (v.float() * w).sum() for k, v, w in pairs)
    (loss + boundary.first_logprobs.sum()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return boundary, grads


@pytest.mark.parametrize("prompts_per_chunk", [None, 1])
def test_a_rerun_prefix_gives_the_plain_boundary_and_bitwise_the_same_gradients(model, prompts, prompts_per_chunk):
    plain, plain_grads = prefix_gradients(model, prompts, None, prompts_per_chunk)
    rerun, rerun_grads = prefix_gradients(model, prompts, Rerun(), prompts_per_chunk)
    for a, b in zip(plain.keys + plain.values, rerun.keys + rerun.values, strict=True):
        assert torch.equal(a, b) and b.requires_grad
    assert torch.equal(plain.first_logprobs, rerun.first_logprobs)
    assert plain_grads.keys() == rerun_grads.keys()
    assert any(n.startswith("model.visual.blocks.") for n in rerun_grads)  # through the vision blocks too
    for name, g in plain_grads.items():
        assert torch.equal(g, rerun_grads[name]), name


def test_a_rerun_prefix_keeps_only_each_units_input(model, prompts):
    def saved_by(rerun):
        saved: list[torch.Tensor] = []
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t)
        with hooks:
            drain(model.prefix_chunks(prompts, attached=True, rerun=rerun))
        return saved

    plain, rerun = saved_by(None), saved_by(Rerun())
    units = model.config.vision.depth + model.config.text.num_hidden_layers
    inputs = [t for t in rerun if t.ndim >= 2 and t.shape[-1] in (model.config.vision.hidden_size,
                                                                   model.config.text.hidden_size)]  # fmt: skip
    assert len(inputs) >= units  # each unit's input (and what runs outside the units: embedding, merger, head)
    assert len(rerun) < len(plain) / 4
    # the rotary tables and the vision attention's index groups are saved too (host offload sees them), not
    # held by the unit's closure
    text_rotary = [t for t in rerun if t.ndim == 4 and t.shape[1] == 1 and t.shape[-1] == model.config.text.head_dim]
    index_groups = [t for t in rerun if t.dtype == torch.int64 and t.ndim == 2]
    assert len(text_rotary) >= 2 * model.config.text.num_hidden_layers and index_groups


def test_a_unit_whose_input_needs_no_gradient_still_trains_its_parameters():
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)  # no requires_grad: the parameters alone make the output differentiable
    (y,) = Rerun()(lambda t: (linear(t),), x, linear.parameters())
    y.square().sum().backward()
    expected = torch.autograd.grad(linear(x).square().sum(), list(linear.parameters()))
    assert torch.equal(linear.weight.grad, expected[0]) and torch.equal(linear.bias.grad, expected[1])


def test_under_no_grad_a_unit_just_runs():
    calls = []
    x = torch.ones(3, requires_grad=True)
    with torch.no_grad():
        (y,) = Rerun()(lambda t: calls.append(t) or (t * 2,), x, [])
    assert not y.requires_grad and len(calls) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_unit_run_on_a_green_partition_is_backpropagated_on_the_reruns_stream():
    from rollplex.executors.policies import make_prefix_streams
    from rollplex.graph.decisions import Sharing

    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 256, device="cuda")
    x = torch.randn(512, 256, device="cuda", requires_grad=True)
    trainer = torch.cuda.current_stream()
    partition = make_prefix_streams(Sharing.of("green", 66), torch.device("cuda"))
    streams = []

    def unit(t):
        if torch.is_grad_enabled():
            streams.append(torch.cuda.current_stream())  # the rerun, inside backward
        return (torch.tanh(linear(t)),)

    with torch.cuda.stream(partition.stream):
        (y,) = Rerun(trainer)(unit, x, linear.parameters())
    trainer.wait_stream(partition.stream)
    y.square().sum().backward()
    assert streams == [trainer]
    grads = (x.grad.clone(), linear.weight.grad.clone())
    x.grad = linear.weight.grad = linear.bias.grad = None
    torch.tanh(linear(x)).square().sum().backward()
    torch.testing.assert_close(grads[0], x.grad)
    torch.testing.assert_close(grads[1], linear.weight.grad)
    # tensors that recorded the partition's stream must go before its green context does
    del x, y, grads
    partition.free_allocator_events()


def prefix_gradients_beside(config, prompts, device: str, beside: bool) -> dict[str, torch.Tensor]:
    """As the runtime runs the actor prefix beside decode: one prompt per group, chunk by chunk on a side stream
    (a green partition on a GPU), saved tensors offloaded to a host pool, units rerun on the trainer's stream;
    then a loss on the boundary and its backward on the trainer's stream. Without `beside`: plainly."""
    torch.manual_seed(0)
    model = Qwen2_5_VL(config, device=device)
    cuda = device == "cuda"
    trainer = torch.cuda.current_stream() if cuda else None
    side = None
    if beside and cuda:
        from rollplex.executors.policies import make_prefix_streams
        from rollplex.graph.decisions import Sharing

        side = make_prefix_streams(Sharing.of("green", 66), torch.device("cuda"))
    with HostPool(64 << 20, pin=cuda) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters()) if beside else nullcontext()
        rerun = Rerun(trainer) if beside else None
        chunks = model.prefix_chunks(prompts, attached=True, prompts_per_chunk=1, rerun=rerun)
        while True:
            with torch.cuda.stream(side.stream) if side is not None else nullcontext(), offload:
                try:
                    next(chunks)
                except StopIteration as done:
                    boundary = done.value
                    break
        if side is not None:
            trainer.wait_stream(side.stream)
        weights = [torch.linspace(-1, 1, k.numel(), device=device).view_as(k) for k in boundary.keys]
        pairs = zip(boundary.keys, boundary.values, weights, strict=True)
        loss = sum((k.float() * w).sum() + (v.float() * w).sum() for k, v, w in pairs)
        (loss + boundary.first_logprobs.sum()).backward()
        grads = {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None}
        del boundary, loss, weights, chunks
    if side is not None:
        side.free_allocator_events()  # after every tensor that recorded its stream
    return grads


def test_a_prefix_beside_with_offload_and_reruns_gives_the_plain_gradients(config, prompts):
    plain = prefix_gradients_beside(config, prompts, "cpu", beside=False)
    beside = prefix_gradients_beside(config, prompts, "cpu", beside=True)
    assert plain.keys() == beside.keys()
    for name, g in plain.items():
        assert torch.equal(g, beside[name]), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_prefix_on_a_green_partition_with_offload_and_reruns_gives_the_plain_gradients(config, prompts):
    plain = prefix_gradients_beside(config, prompts, "cuda", beside=False)
    beside = prefix_gradients_beside(config, prompts, "cuda", beside=True)
    assert plain.keys() == beside.keys()
    for name, g in plain.items():  # one prompt per group meets other shapes than all at once, and the compiled
        # chains and attention run other kernels for them (atomics in some): equal within FP32 rounding of the
        # gradient's scale, not bitwise
        torch.testing.assert_close(beside[name], g, rtol=1e-4, atol=1e-6 * max(1.0, float(g.abs().max())), msg=name)
