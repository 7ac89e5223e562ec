from contextlib import nullcontext

import pytest
import torch
from torch import nn

from rollplex.memory.host_pool import HostPool
from rollplex.memory.offload import SavedTensorOffload, recompute

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def mlp(seed=0, width=64, depth=4):
    torch.manual_seed(seed)
    return nn.Sequential(
        *(nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.LayerNorm(width)) for _ in range(depth))
    )


def block(seed=0):
    torch.manual_seed(seed)
    return nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=True)


def grads_of(model, inputs, context=None):
    model.zero_grad(set_to_none=True)
    x = inputs.clone().requires_grad_(True)
    if context is None:
        loss = model(x).square().mean()
    else:
        with context:
            loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def saved_bytes(model, inputs, keep=()):
    """The oracle: bytes of every distinct saved tensor not in `keep` (counted by a plain hook)."""
    kept = {t.untyped_storage().data_ptr() for t in keep}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in kept:
            saved[id(t)] = (t, t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs.clone().requires_grad_(True)).square().mean()
    return sum(num_bytes for _, num_bytes in saved.values())


def assert_bitwise(a, b):
    assert len(a) == len(b)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("make", [mlp, block])
def test_gradients_with_saved_tensors_offloaded_equal_those_without(make):
    model = make()
    inputs = torch.randn(4, 8, 32) if make is block else torch.randn(16, 64)
    with HostPool(8 << 20) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters(), min_bytes=0)
        assert_bitwise(grads_of(model, inputs, offload), grads_of(model, inputs))
        assert offload.stats().num_bytes == saved_bytes(model, inputs, keep=model.parameters())
        assert offload.stats().num_tensors > 0


class SaveThrice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, c):
        ctx.save_for_backward(a, b, c)
        return a * b * c

    @staticmethod
    def backward(ctx, grad):
        a, b, c = ctx.saved_tensors
        return grad * b * c, grad * a * c, grad * a * b


def test_a_tensor_saved_three_times_is_offloaded_once():
    x = torch.randn(64, 64, requires_grad=True)
    with HostPool(1 << 20) as pool:
        with SavedTensorOffload(pool) as offload:
            y = x.exp()
            loss = SaveThrice.apply(y, y, y).sum()
        assert offload.stats().num_tensors == 1  # exp saves its result y, SaveThrice saves y thrice
        assert offload.stats().num_bytes == 64 * 64 * 4
        assert len(pool.live_blocks) == 1
        loss.backward()
    assert torch.allclose(x.grad, 3 * x.exp() ** 3)


def test_a_tensor_saved_in_several_entries_of_the_context_is_offloaded_once():
    """As a prompt group's rotary tables, saved by each checkpointed layer, one context entry per layer."""
    x, table = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
    with HostPool(1 << 20) as pool:
        offload, y = SavedTensorOffload(pool, min_bytes=1), x
        for _ in range(3):
            with offload:
                y = y * table  # saves the table (y's gradient needs it), not y
        assert offload.stats().num_tensors == 1  # not 3
        y.sum().backward()
        assert pool.live_blocks == ()
    assert torch.allclose(x.grad, table**3)


def test_a_tensor_given_new_data_between_entries_is_saved_again():
    x, table = torch.randn(64, 64, requires_grad=True), torch.randn(64, 64)
    with HostPool(1 << 20) as pool:
        offload = SavedTensorOffload(pool, min_bytes=1)
        with offload:
            y = x * table
        table.data = torch.full((64, 64), 3.0)  # the same object, another value: `_version` does not change
        with offload:
            z = y * table
        z.sum().backward()
        assert offload.stats().num_tensors == 2
    assert torch.allclose(x.grad, y.detach() / x.detach() * 3.0)


def test_the_pool_is_empty_again_once_backward_has_consumed_the_saved_tensors():
    model, inputs = mlp(), torch.randn(16, 64)
    with HostPool(8 << 20) as pool:
        grads_of(model, inputs, SavedTensorOffload(pool, keep=model.parameters()))
        assert pool.num_free_bytes == pool.capacity
        assert pool.live_blocks == ()


def test_a_graph_dropped_without_backward_also_frees_its_blocks():
    model = mlp()
    with HostPool(8 << 20) as pool:
        with SavedTensorOffload(pool):
            loss = model(torch.randn(16, 64)).sum()
        assert pool.live_blocks
        del loss
        assert pool.live_blocks == ()


def test_parameters_small_tensors_and_overflow_stay_put_and_are_counted_as_kept():
    model, inputs = mlp(), torch.randn(16, 64)
    with HostPool(3 * 4096) as pool:  # room for three 16 x 64 fp32 activations
        offload = SavedTensorOffload(pool, keep=model.parameters(), min_bytes=4096)
        assert_bitwise(grads_of(model, inputs, offload), grads_of(model, inputs))
    stats = offload.stats()
    assert stats.num_tensors == 3
    assert stats.num_bytes == 3 * 4096
    assert stats.num_bytes + stats.num_bytes_kept == saved_bytes(model, inputs)


def test_recomputed_modules_give_the_same_gradients_and_save_less():
    model, inputs = mlp(depth=6), torch.randn(16, 64)
    layers = list(model)
    with recompute(layers) as num_wrapped:
        assert num_wrapped == 6
        saved_with = saved_bytes(model, inputs, keep=model.parameters())
    assert saved_with < saved_bytes(model, inputs, keep=model.parameters())
    assert_bitwise(grads_of(model, inputs, recompute(layers)), grads_of(model, inputs))


def test_recompute_keeps_dropout_masks_so_gradients_still_match():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Dropout(0.3), nn.Linear(32, 32))
    inputs = torch.randn(8, 32)
    torch.manual_seed(1)
    expected = grads_of(model, inputs)
    torch.manual_seed(1)
    assert_bitwise(grads_of(model, inputs, recompute([model])), expected)


def test_every_module_gets_its_own_forward_back_after_recompute():
    model = block()
    forward = model.forward
    with pytest.raises(RuntimeError, match="boom"), recompute([model]):
        assert model.forward != forward
        raise RuntimeError("boom")
    assert model.forward == forward and "forward" not in model.__dict__


def test_recompute_inside_offload_still_gives_the_same_gradients():
    model, inputs = block(), torch.randn(2, 8, 32)

    class Both:
        def __enter__(self):
            self.offload = SavedTensorOffload(pool, keep=model.parameters(), min_bytes=0).__enter__()
            self.recompute = recompute([model.linear1, model.linear2, model.norm1])
            self.recompute.__enter__()

        def __exit__(self, *exc):
            self.recompute.__exit__(*exc)
            self.offload.__exit__(*exc)

    with HostPool(8 << 20) as pool:
        assert_bitwise(grads_of(model, inputs, Both()), grads_of(model, inputs))


def checkpointed_layers(model, inputs, pool, offload):
    """The prefix's way: each layer checkpointed (its input saved, its activations rerun), under offload."""
    model.zero_grad(set_to_none=True)
    x = inputs.clone().requires_grad_(True)
    with offload, recompute(model):
        loss = model(x).square().mean()
    loss.backward()
    return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]


def test_backward_finds_each_layer_input_on_its_way_back_before_it_asks():
    """Backward asks for the layers' inputs last first; each one asked for starts the one saved before it back,
    so all but the first are already coming when asked for, and the gradients stay bitwise those without."""
    model, inputs = mlp(depth=6), torch.randn(16, 64)
    with HostPool(8 << 20) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters())
        grads = checkpointed_layers(model, inputs, pool, offload)
        assert_bitwise(grads, grads_of(model, inputs))
        stats = offload.stats()
        assert stats.num_tensors == 7  # each layer's input and the loss's (16 x 64 fp32 each)
        assert stats.num_ahead == 6  # all but the loss's, which backward asks for first
        assert pool.live_blocks == ()
        again = checkpointed_layers(model, inputs, pool, offload)  # the next step starts its order over
        assert_bitwise(again, grads)
        assert offload.stats().num_ahead == 12 and pool.live_blocks == ()


def test_a_tensor_sent_back_that_backward_never_asks_for_is_freed_with_its_graph():
    """Two inputs through the checkpointed layers, one after the other; backward of the second only: its first
    layer's input starts back the last tensor the first input saved, which no backward asks for. Dropping the
    first graph frees it and its block; the second input's gradients are those without offload."""
    model, inputs = mlp(depth=3), torch.randn(16, 64)

    def second_grads(offload=None):
        model.zero_grad(set_to_none=True)
        x, y = inputs.clone().requires_grad_(True), (inputs + 1).requires_grad_(True)
        with offload or nullcontext(), recompute(model):
            first, second = model(x).square().mean(), model(y).square().mean()
        second.backward()
        return [p.grad.clone() for p in model.parameters()] + [y.grad.clone()], first

    with HostPool(8 << 20) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters())
        grads, first = second_grads(offload)
        assert offload.stats().num_tensors == 8 and offload.stats().num_ahead == 3  # 4 an input, the loss's last
        assert len(pool.live_blocks) == 4  # the first input's: its loss's input already brought back
        del first
        assert pool.live_blocks == ()
        assert_bitwise(grads, second_grads()[0])


def test_a_table_every_layer_saves_sends_nothing_ahead_so_the_layers_own_tensors_all_go():
    """As the rotary tables of a prefix: saved once, asked for by every layer. Its place in the saving order is
    its first save's, so it sends nothing back ahead; every layer's own tensors but the first asked still come
    back ahead of backward."""
    torch.manual_seed(0)
    ups, downs = [nn.Linear(64, 256) for _ in range(6)], [nn.Linear(256, 64) for _ in range(6)]
    params, table = [p for m in ups + downs for p in m.parameters()], torch.randn(64, 64)

    def grads(offload=None):
        for p in params:
            p.grad = None
        x = y = torch.randn(64, 64, generator=torch.Generator().manual_seed(1)).requires_grad_(True)
        with offload or nullcontext():
            for up, down in zip(ups, downs, strict=True):
                y = y + down(nn.functional.gelu(up(torch.tanh(y) * table)))
            loss = y.square().sum()
        loss.backward()
        return [p.grad.clone() for p in params] + [x.grad.clone()]

    with HostPool(64 << 20) as pool:
        offload = SavedTensorOffload(pool, keep=params)
        assert_bitwise(grads(offload), grads())
        stats = offload.stats()
        assert stats.num_ahead == stats.num_tensors - 2  # not the loss's input (asked first), not the table


def test_a_tensor_sent_ahead_and_dropped_unasked_leaves_room_for_the_next_backward():
    """With an older graph still alive (so the order does not start over), a graph dropped with a tensor on its
    way back must not keep that tensor's bytes counted as ahead: the next backward sends its own ahead."""
    model, inputs = mlp(depth=3), torch.randn(16, 64)

    def forward(offload):
        with offload, recompute(model):
            return model(inputs.clone().requires_grad_(True)).square().mean()

    with HostPool(8 << 20) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters())
        older, first, second = forward(offload), forward(offload), forward(offload)
        second.backward()  # its first layer's input sends back the first graph's last tensor, never asked for
        del first
        third = forward(offload)
        before = offload.stats().num_ahead
        third.backward()
        assert offload.stats().num_ahead - before == 3  # every layer input of the third graph
        del older
        assert pool.live_blocks == ()


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_offload_lowers_the_forward_peak_and_keeps_gradients_bitwise():
    model = mlp(width=2048, depth=8).cuda()
    inputs = torch.randn(4096, 2048, device="cuda")

    def forward_peak(context):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = grads_of(model, inputs, context)
        torch.cuda.synchronize()
        return grads, torch.cuda.max_memory_allocated() - base

    with HostPool(2 << 30, pin=True) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters())
        plain, plain_peak = forward_peak(None)
        offloaded, offload_peak = forward_peak(offload)
        assert_bitwise(offloaded, plain)
        assert pool.live_blocks == ()
    stats = offload.stats()
    print(f"\noffload: {stats.num_bytes / 2**20:.0f} MiB in {stats.num_tensors} tensors;", end=" ")
    print(f"peak {plain_peak / 2**20:.0f} MiB without, {offload_peak / 2**20:.0f} MiB with")
    assert stats.num_bytes > 8 * 4096 * 2048 * 4, "every block's activations went to the pool"
    assert offload_peak < plain_peak
    assert stats.num_ahead > 0  # brought back on the side stream, ahead of backward, and still bitwise


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_layers_run_on_two_streams_find_their_tensors_sent_ahead_only_once_copied(monkeypatch):
    """As prefix chunks beside decode: the first half of the layers forward on one stream, the rest on another,
    so backward asks from both. Every copy back ahead is held up on the side stream (a spin kernel before it):
    a stream that read a tensor before its copy ended would change the gradients."""
    model = mlp(width=1024, depth=8).cuda()
    inputs = torch.randn(2048, 1024, device="cuda")
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bring_back = SavedTensorOffload._bring_back

    def slowed(saved, stream):
        if stream is not None and stream != torch.cuda.current_stream():
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                torch.cuda._sleep(2_000_000)
        bring_back(saved, stream)

    def grads(context=None):
        model.zero_grad(set_to_none=True)
        x = y = inputs.clone().requires_grad_(True)
        with context or nullcontext():
            for half, stream in zip((model[:4], model[4:]), streams, strict=True):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    y = half(y)
                torch.cuda.current_stream().wait_stream(stream)
            loss = y.square().mean()
        loss.backward()
        torch.cuda.synchronize()
        return [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]

    monkeypatch.setattr(SavedTensorOffload, "_bring_back", staticmethod(slowed))
    with HostPool(1 << 30, pin=True) as pool:
        offload = SavedTensorOffload(pool, keep=model.parameters())
        assert_bitwise(grads(offload), grads())
        assert offload.stats().num_ahead > 0
        assert pool.live_blocks == ()
