import time

import pytest
import torch

from rollplex.memory.optimizer import NUM_SLOTS, ChunkedAdamW, copy_into
from rollplex.memory.state_layout import STATE_BYTES_PER_ELEMENT

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = [(7, 5), (13,), (3, 4, 5), (1,), (64, 33), (2, 3)]


def make_params(shapes=SHAPES, seed=0, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(device, dtype)) for s in shapes]


def set_grads(params, seed, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = (scale * torch.randn(p.shape, generator=gen)).to(p.device, p.dtype)


def twin_grads(ours, theirs):
    for a, b in zip(ours, theirs, strict=True):
        b.grad = a.grad.detach().float().clone()


def torch_step(params, optimizer, max_grad_norm):
    norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm if max_grad_norm else float("inf"))
    optimizer.step()
    return norm


@pytest.mark.parametrize(
    ("chunk_bytes", "max_grad_norm", "weight_decay"),
    [(c, m, w) for c in (12 * 9, 12 * 40, 12 * 2112, 1 << 30) for m in (None, 0.5, 1e6) for w in (0.0, 0.1)]
    # one element a chunk (~1.5 s a case): the norm summed over the most chunks, clipping and decaying
    + [(12, 0.5, 0.1)],
)
def test_steps_equal_clip_grad_norm_then_torch_adamw(chunk_bytes, max_grad_norm, weight_decay):
    ours, theirs = make_params(), make_params()
    hyper = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=weight_decay)
    opt = ChunkedAdamW(ours, **hyper, max_grad_norm=max_grad_norm, chunk_bytes=chunk_bytes)
    ref = torch.optim.AdamW(theirs, **hyper)
    for step in range(6):
        set_grads(ours, seed=step, scale=1.0 + step)
        twin_grads(ours, theirs)
        norm = opt.step()
        ref_norm = torch_step(theirs, ref, max_grad_norm)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_with_whole_parameters_per_chunk_the_update_is_bitwise_torchs_fused_adamw():
    ours, theirs = make_params(), make_params()
    opt = ChunkedAdamW(ours, max_grad_norm=0.3, chunk_bytes=1 << 30)
    ref = torch.optim.AdamW(theirs, fused=True)
    for step in range(4):
        set_grads(ours, seed=step)
        twin_grads(ours, theirs)
        opt.step()
        torch_step(theirs, ref, 0.3)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_gradients_are_read_and_never_modified():
    params = make_params()
    set_grads(params, seed=1, scale=10.0)
    before = [p.grad.clone() for p in params]
    ChunkedAdamW(params, max_grad_norm=0.1, chunk_bytes=12 * 50).step()
    assert all(torch.equal(p.grad, g) for p, g in zip(params, before, strict=True))


@pytest.mark.parametrize("resume_chunk_bytes", [12 * 50, 12 * 17])
def test_a_resumed_optimizer_continues_bit_identically(resume_chunk_bytes):
    params = make_params()
    opt = ChunkedAdamW(params, max_grad_norm=1.0, chunk_bytes=12 * 50)
    for step in range(3):
        set_grads(params, seed=step)
        opt.step()
    saved_params = [p.detach().clone() for p in params]
    saved = opt.state_dict()
    resumed = [torch.nn.Parameter(p.clone()) for p in saved_params]
    opt2 = ChunkedAdamW(resumed, lr=0.5, max_grad_norm=9.0, chunk_bytes=resume_chunk_bytes)
    opt2.load_state_dict(saved)
    assert opt2.config == opt.config and opt2.num_steps == 3
    for step in range(3, 6):
        set_grads(params, seed=step)
        set_grads(resumed, seed=step)
        opt.step()
        opt2.step()
    for a, b in zip(params, resumed, strict=True):
        if resume_chunk_bytes == 12 * 50:
            assert torch.equal(a, b)
        else:  # another chunking splits parameters elsewhere: same numbers up to the norm's rounding
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_state_parts_hold_whole_parameters_about_max_bytes_each_and_load_back_in_any_order():
    params = make_params()
    opt = ChunkedAdamW(params, max_grad_norm=1.0, chunk_bytes=12 * 50)
    for step in range(2):
        set_grads(params, seed=step)
        opt.step()
    parts = list(opt.state_parts(max_bytes=12 * 60))
    sizes = [[p.numel() for p in (e["master"] for e in part["state"].values())] for part in parts]
    assert len(parts) > 2 and sorted(i for part in parts for i in part["state"]) == list(range(len(params)))
    assert all(12 * sum(s[:-1]) < 12 * 60 for s in sizes)  # a part closes at the parameter that reaches the bound
    fresh = ChunkedAdamW([torch.nn.Parameter(torch.zeros_like(p)) for p in params], chunk_bytes=12 * 17)
    for part in reversed(parts):
        fresh.load_state_dict(part)
    whole, again = opt.state_dict(), fresh.state_dict()
    assert fresh.num_steps == 2 and whole["param_groups"] == again["param_groups"]
    for i, entry in whole["state"].items():
        assert all(torch.equal(entry[k], again["state"][i][k]) for k in ("master", "exp_avg", "exp_avg_sq"))


def test_the_state_dict_loads_into_torch_adamw_and_both_continue_alike():
    ours, theirs = make_params(), make_params()
    opt = ChunkedAdamW(ours, weight_decay=0.05)
    for step in range(2):
        set_grads(ours, seed=step)
        opt.step()
    for a, b in zip(ours, theirs, strict=True):
        b.data.copy_(a.data)
    ref = torch.optim.AdamW(theirs, weight_decay=0.05)  # fused, as the state dict says
    ref.load_state_dict(opt.state_dict())
    for step in range(2, 4):
        set_grads(ours, seed=step)
        twin_grads(ours, theirs)
        opt.step()
        ref.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_new_values_are_written_into_the_destination_the_caller_gives():
    params = make_params()
    snapshot = [torch.zeros(p.shape, dtype=torch.bfloat16) for p in params]
    opt = ChunkedAdamW(params, chunk_bytes=12 * 30, write=copy_into(snapshot))
    before = [p.detach().clone() for p in params]
    set_grads(params, seed=0)
    opt.step()
    masters = [entry["master"] for entry in opt.state_dict()["state"].values()]
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True)), "params untouched"
    assert all(torch.equal(s, m.bfloat16()) for s, m in zip(snapshot, masters, strict=True))


def test_zero_grad_and_a_missing_gradient():
    params = make_params()
    opt = ChunkedAdamW(params)
    set_grads(params, seed=0)
    opt.zero_grad(set_to_none=False)
    assert all(torch.count_nonzero(p.grad) == 0 for p in params)
    opt.zero_grad()
    with pytest.raises(ValueError, match=r"parameters \[0, 1, 2"):
        opt.step()


def test_the_workspace_is_the_pipeline_depth_times_a_chunk():
    params = make_params([(1000,), (999, 3), (17,)])
    chunk_bytes = 12 * 500
    opt = ChunkedAdamW(params, chunk_bytes=chunk_bytes)
    assert opt.capacity <= 500
    assert opt.workspace_bytes == 4 * (opt.capacity * (3 * NUM_SLOTS + 1) + opt.num_segments)
    assert opt.workspace_bytes <= NUM_SLOTS * chunk_bytes + chunk_bytes // 3 + 4 * opt.num_segments
    assert opt.num_bytes_moved == 2 * 12 * (1000 + 2997 + 17)


def test_the_host_pool_holds_all_fp32_state():
    params = make_params()
    opt = ChunkedAdamW(params, chunk_bytes=12 * 50)
    held = sum(block.num_bytes for block in opt.pool.live_blocks)
    assert held == STATE_BYTES_PER_ELEMENT * sum(p.numel() for p in params)


@pytest.mark.parametrize("kept", [1, 3])
def test_the_first_chunks_kept_apart_step_as_torch_adamw_and_only_the_others_count_as_streamed(kept):
    ours, theirs = make_params(), make_params()
    chunk_bytes = 12 * 40
    whole = ChunkedAdamW(make_params(), chunk_bytes=chunk_bytes)
    resident = sum(12 * c.numel for c in whole.chunks[:kept])
    opt = ChunkedAdamW(ours, lr=3e-3, max_grad_norm=0.5, chunk_bytes=chunk_bytes, resident_bytes=resident + 11)
    ref = torch.optim.AdamW(theirs, lr=3e-3)
    assert opt.num_streamed == len(opt.chunks) - kept == len(whole.chunks) - kept
    assert [pool is opt.device_pool for pool in opt.pools] == [True] * kept + [False] * opt.num_streamed
    held = sum(block.num_bytes for block in opt.device_pool.live_blocks)
    assert held == resident
    assert opt.num_bytes_moved == whole.num_bytes_moved - 2 * resident
    for step in range(4):
        set_grads(ours, seed=step)
        twin_grads(ours, theirs)
        torch.testing.assert_close(opt.step(), torch_step(theirs, ref, 0.5), rtol=1e-6, atol=0)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    state = opt.state_dict()
    again = ChunkedAdamW(make_params(), chunk_bytes=chunk_bytes, resident_bytes=resident)
    again.load_state_dict(state)
    for i in range(len(SHAPES)):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state_dict()["state"][i][key], state["state"][i][key])


def test_a_resident_share_that_holds_the_whole_state_keeps_it_as_state_on_the_device():
    opt = ChunkedAdamW(make_params(), chunk_bytes=12 * 40, resident_bytes=1 << 30)
    assert opt.device_pool is None and opt.num_streamed == len(opt.chunks)  # one pool, as `state_on_device` has it
    assert opt.num_moved == opt.num_slots == opt.num_bytes_moved == 0


@pytest.mark.parametrize("where", [{"state_on_device": True}, {"resident_bytes": 12 * 80}])
def test_state_kept_on_the_device_is_updated_in_its_block_bitwise_as_streamed_and_copies_nothing(where, monkeypatch):
    """All of the state on the device, or its first two chunks: those chunks are neither staged nor written back
    (no copy of their state), and the step gives the streamed optimizer's bits, clipped, over several steps."""
    import rollplex.memory.optimizer as optimizer

    streamed_params, kept_params = make_params(), make_params()
    streamed = ChunkedAdamW(streamed_params, lr=1e-2, max_grad_norm=0.5, chunk_bytes=12 * 40)
    kept = ChunkedAdamW(kept_params, lr=1e-2, max_grad_norm=0.5, chunk_bytes=12 * 40, **where)
    moved = 0 if "state_on_device" in where else len(kept.chunks) - 2
    assert kept.num_moved == moved and kept.num_slots == min(3, moved)
    copied, inner = [], optimizer.copy_on

    def counted(stream, dst, src, after=()):
        copied.append(dst.numel())
        return inner(stream, dst, src, after)

    monkeypatch.setattr(optimizer, "copy_on", counted)
    for step in range(3):
        set_grads(streamed_params, seed=step)
        set_grads(kept_params, seed=step)
        copied.clear()
        norm = kept.step()
        assert len(copied) == 2 * moved  # each moved chunk loaded and offloaded once, the kept ones never
        assert torch.equal(norm, streamed.step())
    for a, b in zip(streamed_params, kept_params, strict=True):
        assert torch.equal(a, b)
    assert kept.state_dict()["state"][3]["exp_avg_sq"].equal(streamed.state_dict()["state"][3]["exp_avg_sq"])


GPU_SHAPES = [(32_000, 1024), *[(1024, 4096)] * 8, *[(4096,)] * 8, (1000,), (7, 13), (3, 1024, 5)]


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_a_bf16_model_steps_like_torch_adamw_on_an_fp32_copy_within_the_bound():
    ours = make_params(GPU_SHAPES, device="cuda", dtype=torch.bfloat16)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    opt = ChunkedAdamW(ours, lr=1e-3, weight_decay=0.1, max_grad_norm=1.0, chunk_bytes=64 << 20)
    ref = torch.optim.AdamW(theirs, lr=1e-3, weight_decay=0.1)
    for step in range(3):
        set_grads(ours, seed=step, scale=0.01)
        twin_grads(ours, theirs)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        norm = opt.step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        ref_norm = torch_step(theirs, ref, 1.0)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
        assert peak <= opt.peak_device_bytes, f"step used {peak} extra bytes, bound {opt.peak_device_bytes}"
    masters = [entry["master"] for entry in opt.state_dict()["state"].values()]
    for a, m, b in zip(ours, masters, theirs, strict=True):
        torch.testing.assert_close(m, b.detach().cpu(), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.float(), b.detach().bfloat16().float(), rtol=2**-7, atol=1e-6)
    print(f"\nchunked AdamW: {len(opt.chunks)} chunks, peak extra HBM {peak / 2**20:.0f} MiB")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kept", ["all", "two chunks"])
def test_on_the_gpu_state_kept_in_hbm_steps_bitwise_as_state_streamed_from_the_host(kept):
    host, device = make_params(GPU_SHAPES[1:6], device="cuda"), make_params(GPU_SHAPES[1:6], device="cuda")
    chunk = 12 * 300_001
    a = ChunkedAdamW(host, lr=1e-2, max_grad_norm=0.5, chunk_bytes=chunk)
    where = {"state_on_device": True} if kept == "all" else {"resident_bytes": 2 * chunk}
    b = ChunkedAdamW(device, lr=1e-2, max_grad_norm=0.5, chunk_bytes=chunk, **where)
    assert a.pool.buffer.device.type == "cpu" and a.pool.pinned
    if kept == "all":  # one pool, on the device: nothing crosses the host link
        assert b.pool.buffer.device.type == "cuda" and not b.pool.pinned and b.device_pool is None
    else:  # the first chunks in a device pool, the others streamed from the pinned one
        assert b.device_pool.buffer.device.type == "cuda" and b.pool.pinned and 0 < b.num_streamed < len(b.chunks)
    for step in range(3):
        set_grads(host, seed=step)
        set_grads(device, seed=step)
        a.step(), b.step()
    for x, y in zip(host, device, strict=True):
        assert torch.equal(x, y)
    for i in (0, 4):
        assert a.state_dict()["state"][i]["exp_avg_sq"].equal(b.state_dict()["state"][i]["exp_avg_sq"])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("max_grad_norm", [None, 0.5])
def test_on_the_gpu_the_three_stream_pipeline_over_many_chunks_equals_torch_adamw(max_grad_norm):
    ours = make_params(GPU_SHAPES[1:6], device="cuda")
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = ChunkedAdamW(ours, lr=1e-2, max_grad_norm=max_grad_norm, chunk_bytes=12 * 300_001)
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    assert len(opt.chunks) > 50
    for step in range(4):
        set_grads(ours, seed=step)
        twin_grads(ours, theirs)
        opt.step()
        torch_step(theirs, ref, max_grad_norm)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.gpu
@needs_cuda
def test_on_the_gpu_the_streamed_step_reports_bytes_moved_per_second():
    params = make_params(GPU_SHAPES * 4, device="cuda", dtype=torch.bfloat16)
    opt = ChunkedAdamW(params, chunk_bytes=256 << 20)
    set_grads(params, seed=0, scale=0.01)
    opt.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        opt.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / 3
    print(f"\nchunked AdamW: {opt.num_bytes_moved / 2**30:.2f} GiB moved per step in {seconds * 1e3:.0f} ms")
    print(f"  = {opt.num_bytes_moved / seconds / 1e9:.1f} GB/s host<->device (load + offload)")
    assert seconds > 0


def test_fp32_grads_sum_bf16_microbatch_gradients_in_fp32_and_free_the_bf16_ones():
    params = make_params(dtype=torch.bfloat16)
    opt = ChunkedAdamW(params, chunk_bytes=256, fp32_grads=True)
    x = [torch.randn(p.shape, generator=torch.Generator().manual_seed(i)) for i, p in enumerate(params)]
    oracle = [torch.zeros(p.shape) for p in params]
    for k in range(4):  # four microbatches, each grad exactly representable in bf16
        loss = sum(((0.5 + k) * p.float() * xi.bfloat16().float()).sum() for p, xi in zip(params, x, strict=True))
        loss.backward()
        assert all(p.grad is None for p in params)  # folded into the FP32 buffers as each one arrived
        for o, xi in zip(oracle, x, strict=True):
            o += ((0.5 + k) * xi.bfloat16().float()).bfloat16().float()
    for i, o in enumerate(oracle):
        assert opt.grad_of(i).dtype == torch.float32
        torch.testing.assert_close(opt.grad_of(i), o, rtol=0, atol=0)
    opt.step()
    opt.zero_grad()
    assert all(opt.grad_of(i) is None for i in range(len(params)))
    set_grads(params, seed=3)  # a gradient set by hand (no backward) is read too
    assert opt.grad_of(0).dtype == torch.float32 and params[0].grad is None


def test_an_optimizer_with_fp32_grads_dies_with_its_last_reference_while_its_parameters_live_on():
    """Its hooks hold it weakly: a bound-method hook kept a 3B bench's 45 GiB pinned pool alive after its run."""
    import gc
    import weakref

    params = [torch.nn.Parameter(torch.randn(64, 8, dtype=torch.bfloat16))]
    opt = ChunkedAdamW(params, chunk_bytes=256, fp32_grads=True)
    gone, pool_gone = weakref.ref(opt), weakref.ref(opt.pool)
    del opt
    gc.collect()
    assert gone() is None and pool_gone() is None
    (params[0].float() ** 2).sum().backward()  # the hook outlives the optimizer harmlessly
    assert params[0].grad is not None


@pytest.mark.parametrize("where", ["_carve_workspace", "_grad_norm_pass"])
def test_a_step_that_finds_no_memory_for_its_workspace_leaves_the_step_count_as_it_was(monkeypatch, where):
    ours, theirs = make_params(), make_params()
    mine, reference = ChunkedAdamW(ours, chunk_bytes=4096), torch.optim.AdamW(theirs)
    real, calls = getattr(ChunkedAdamW, where), []

    def first_fails(self, *args):
        calls.append(1)
        if len(calls) == 1:
            raise torch.OutOfMemoryError("no room")  # the workspace, or what the gradient norm allocates
        return real(self, *args)

    monkeypatch.setattr(ChunkedAdamW, where, first_fails)
    set_grads(ours, 1)
    twin_grads(ours, theirs)
    with pytest.raises(torch.OutOfMemoryError):
        mine.step()
    mine.step()  # the same gradients, once there is room
    reference.step()
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
