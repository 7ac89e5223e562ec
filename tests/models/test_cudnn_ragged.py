"""cuDNN's ragged attention (`cudnn_ragged`) against the cascade's reference kernels and against FlexAttention's
packed suffix, gradients included; graphs built for capacities serve other lengths; the host never waits."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from rollplex.models.attention import PackedPrefixAttention
from rollplex.models.boundary import Boundary
from rollplex.models.cascade import REFERENCE, PackedCascadeAttention, Segments, cascade_attention
from rollplex.models.cudnn_ragged import (
    Capacity,
    CudnnRaggedKernels,
    _build,
    _capacity,
    _graph,
    _Lengths,
    build_graphs,
    ragged_attention_available,
    suffix_kernels,
)
from rollplex.models.packed import ResponsePack

CPU = torch.device("cpu")


def test_capacities_are_powers_of_two_at_or_above_the_count():
    assert [_capacity(n) for n in (1, 2, 3, 4, 5, 63, 64, 65, 2048, 2049)] == [1, 2, 4, 4, 8, 64, 64, 128, 2048, 4096]


def test_a_capacity_keeps_its_floor_and_grows_to_powers_of_two_only_where_a_call_needs_more():
    floor = Capacity(8, 16384, 6000, 16384, 48000)
    fits = Segments.of([300, 2000], [5000, 5999], causal=False, device=CPU)
    assert floor.holding(fits) == floor
    grown = floor.holding(Segments.of([20000] + [1] * 8, [6001] * 9, causal=False, device=CPU))
    assert grown == Capacity(16, 32768, 8192, 32768, 65536)
    assert Capacity().holding(fits) == Capacity(2, 2048, 8192, 4096, 16384)
    assert floor.holding(Segments.of([2000] * 8, [6000] * 8, causal=False, device=CPU)) == floor
    totals_only = Segments.of([2500] * 8, [6000] * 8, causal=False, device=CPU)  # 20,000 queries, 48,000 keys
    assert floor.holding(totals_only) == Capacity(8, 16384, 6000, 32768, 48000)


def test_lengths_pad_to_the_capacity_with_empty_segments_and_offsets_count_elements():
    """Three segments in a capacity of four: the fourth has no queries and no keys and starts where the last ends;
    offsets count elements (tokens x heads x head size; the statistics tokens x heads)."""
    s = Segments.of([5, 7, 3], [6, 4, 9], causal=False, device=CPU)
    lens = _Lengths.of(s, 4, heads=4, kv_heads=2, head_dim=8, device=CPU)
    assert lens.q_lens.flatten().tolist() == [5, 7, 3, 0] and lens.k_lens.flatten().tolist() == [6, 4, 9, 0]
    assert lens.q_lens.dtype == torch.int32 and lens.q_offsets.dtype == torch.int64
    assert lens.q_offsets.flatten().tolist() == [0, 5 * 32, 12 * 32, 15 * 32, 15 * 32]
    assert lens.k_offsets.flatten().tolist() == [0, 6 * 16, 10 * 16, 19 * 16, 19 * 16]
    assert lens.stats_offsets.flatten().tolist() == [0, 5 * 4, 12 * 4, 15 * 4, 15 * 4]
    assert lens.q_lens.shape == (4, 1, 1, 1) and lens.q_offsets.shape == (5, 1, 1, 1)
    named = lens.by_name  # what a graph's offset tensors read: queries, outputs and their gradients alike
    assert named["q_off"] is named["o_off"] is named["do_off"] is lens.q_offsets
    assert named["k_off"] is named["v_off"] is lens.k_offsets and named["stats_off"] is lens.stats_offsets


def test_off_a_gpu_ragged_attention_is_not_available():
    assert not ragged_attention_available(CPU)
    assert not CudnnRaggedKernels.takes(CPU, torch.bfloat16, 64)


def test_graphs_built_ahead_are_the_ones_the_calls_look_up(monkeypatch):
    """`build_graphs` and the calls key the graph cache alike: a call within the floor builds nothing (a cache
    standing in for cuDNN's builds, on the CPU)."""
    import functools

    from rollplex.models import cudnn_ragged

    class Built:
        def __init__(self, workspace: int) -> None:
            self.workspace = workspace

        def run(self, values: dict, device: torch.device) -> None:
            pass

    built = []

    @functools.cache
    def graph(shape, backward, /):
        built.append((shape, backward))
        return Built(3000 if backward else 1000)

    monkeypatch.setattr(cudnn_ragged, "_graph", graph)
    kernels = CudnnRaggedKernels(causal=False, floor=Capacity(4, 256, 512, 512, 2048))
    largest = build_graphs(
        (kernels,), torch.device("cuda", 0), torch.bfloat16, 4, 2, 64
    )  # device 0, as the CPU keys it
    assert [b for _, b in built] == [False, True] and largest == 3000
    s = Segments.of([100, 200, 50], [300, 500, 400], causal=False, device=CPU)
    q, k = torch.randn(350, 4, 64, dtype=torch.bfloat16), torch.randn(1200, 2, 64, dtype=torch.bfloat16)
    out, lse, saved = kernels.forward(q, k, k, s, 64**-0.5)
    kernels.backward(torch.ones_like(out), q, k, k, out, lse, s, 64**-0.5, saved)
    assert len(built) == 2 and graph.cache_info().hits == 2


@pytest.mark.parametrize(
    "workspaces, kept",
    [({True: 100, False: 50}, False), ({True: 50, False: 100}, True), ({True: None, False: 100}, False),
     ({True: 100, False: None}, True)],
)  # fmt: skip
def test_a_backward_keeps_the_smaller_workspace_of_its_two_builds(monkeypatch, workspaces, kept):
    """Told the key total or not, whichever build needs less workspace serves; one cuDNN refuses (None) leaves the
    other (builds standing in for cuDNN's, on the CPU)."""
    from rollplex.models import cudnn_ragged

    def build(shape, backward, key_total):
        if workspaces[key_total] is None:
            raise RuntimeError("cuDNN: not supported")
        return cudnn_ragged._Graph(None, {"told key total": key_total}, workspaces[key_total])

    monkeypatch.setattr(cudnn_ragged, "_build", build)
    shape = CudnnRaggedKernels(causal=True).shape(torch.device("cuda", 0), torch.bfloat16, 4, 2, 64, 0.125)
    graph = _graph.__wrapped__(shape, True)
    assert graph.tensors == {"told key total": kept}


def test_a_backward_both_of_whose_builds_cudnn_refuses_raises_its_error(monkeypatch):
    from rollplex.models import cudnn_ragged

    def build(shape, backward, key_total):
        raise RuntimeError(f"cuDNN: not supported (key total {key_total})")

    monkeypatch.setattr(cudnn_ragged, "_build", build)
    shape = CudnnRaggedKernels(causal=False).shape(torch.device("cuda", 0), torch.bfloat16, 4, 2, 64, 0.125)
    with pytest.raises(RuntimeError, match="key total False"):
        _graph.__wrapped__(shape, True)


@pytest.mark.parametrize("refused", ["not supported", "runtime"])
def test_a_backward_build_cudnn_refuses_by_either_of_its_errors_leaves_the_other(monkeypatch, refused):
    from rollplex.models import cudnn_ragged

    class NotSupported(Exception):  # cudnn-frontend's pybind error derives from Exception, not RuntimeError
        pass

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(cudnnGraphNotSupportedError=NotSupported))

    def build(shape, backward, key_total):
        if key_total:
            raise NotSupported("no plan") if refused == "not supported" else RuntimeError("validate failed")
        return cudnn_ragged._Graph(None, {}, 10)

    monkeypatch.setattr(cudnn_ragged, "_build", build)
    shape = CudnnRaggedKernels(causal=True).shape(torch.device("cuda", 0), torch.bfloat16, 4, 2, 64, 0.125)
    assert _graph.__wrapped__(shape, True).workspace == 10


def test_a_backward_build_that_fails_by_a_bug_raises_though_the_other_would_serve(monkeypatch):
    """Only cuDNN's refusals fall back: a TypeError in one build is raised, not hidden behind the other."""
    from rollplex.models import cudnn_ragged

    monkeypatch.setitem(sys.modules, "cudnn", types.SimpleNamespace(cudnnGraphNotSupportedError=LookupError))

    def build(shape, backward, key_total):
        if key_total:
            raise TypeError("sdpa_backward() got an unexpected keyword argument")
        return cudnn_ragged._Graph(None, {}, 10)

    monkeypatch.setattr(cudnn_ragged, "_build", build)
    shape = CudnnRaggedKernels(causal=True).shape(torch.device("cuda", 0), torch.bfloat16, 4, 2, 64, 0.125)
    with pytest.raises(TypeError, match="unexpected keyword"):
        _graph.__wrapped__(shape, True)


@pytest.mark.parametrize("deterministic", [False, True])
def test_only_deterministic_kernels_ask_cudnn_for_its_deterministic_backward(monkeypatch, deterministic):
    """The backward's build passes `use_deterministic_algorithm` for deterministic kernels and leaves the option out
    otherwise (a cudnn-frontend without it still builds); both of `suffix_kernels`' parts carry the setting; the
    forward never asks (a mock stands in for cudnn-frontend, on the CPU)."""
    from unittest import mock

    from rollplex.models import cudnn_ragged

    fake = mock.MagicMock()
    graph = fake.pygraph.return_value
    graph.sdpa.return_value = (mock.MagicMock(), mock.MagicMock())
    graph.sdpa_backward.return_value = (mock.MagicMock(), mock.MagicMock(), mock.MagicMock())
    monkeypatch.setitem(sys.modules, "cudnn", fake)
    monkeypatch.setattr(cudnn_ragged, "_handle", lambda device: None)
    parts = suffix_kernels(prompts=2, samples=4, response_tokens=64, prompt_tokens=256, deterministic=deterministic)
    for part in parts:
        shape = part.shape(torch.device("cuda", 0), torch.bfloat16, 16, 2, 128, 128**-0.5)
        for key_total in (True, False):
            _build(shape, True, key_total=key_total)
            asked = graph.sdpa_backward.call_args.kwargs.get("use_deterministic_algorithm")
            assert asked is (True if deterministic else None)
        _build(shape, False, key_total=False)
        assert "use_deterministic_algorithm" not in graph.sdpa.call_args.kwargs


def test_cudnn_takes_16_bit_attention_of_listed_head_sizes_only(monkeypatch):
    monkeypatch.setattr("rollplex.models.cudnn_ragged.find_spec", lambda name: object())  # cudnn-frontend "installed"
    gpu = torch.device("cuda")
    assert CudnnRaggedKernels.takes(gpu, torch.bfloat16, 128) and CudnnRaggedKernels.takes(gpu, torch.float16, 80)
    assert not CudnnRaggedKernels.takes(gpu, torch.float32, 128)
    assert not CudnnRaggedKernels.takes(gpu, torch.bfloat16, 16)  # the tiny model's: scoring stays on FlexAttention


on_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not ragged_attention_available(torch.device("cuda")),
    reason="needs a CUDA GPU and cudnn-frontend",
)


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("head_dim", [128, 64])
def test_on_a_gpu_both_parts_match_the_reference_kernels_in_bf16(head_dim):
    """Three prompt segments (one of a single query) and four causal own segments (one of a single token): the merged
    output and every gradient equal the reference's in float32, to bf16's rounding; the log-sum-exps to float32's."""
    gen = torch.Generator("cuda").manual_seed(0)
    device = torch.device("cuda")
    prompts = Segments.of([300, 1, 129], [600, 400, 900], causal=False, device=device)
    own = Segments.of([200, 100, 1, 129], [200, 100, 1, 129], causal=True, device=device)
    shapes = [(430, 16, head_dim), (1900, 2, head_dim), (1900, 2, head_dim), (430, 2, head_dim), (430, 2, head_dim)]
    tensors = [torch.randn(*s, generator=gen, device=device, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    grad = torch.randn(430, 16, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
    kernels = (CudnnRaggedKernels(causal=False), CudnnRaggedKernels(causal=True))
    results = []
    for each in (kernels, REFERENCE):
        q, k1, v1, k2, v2 = tensors
        out = cascade_attention(q, [(k1, v1, prompts), (k2, v2, own)], each)
        results.append((out, *torch.autograd.grad(out, tensors, grad)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
    q, k1, v1 = (t.detach() for t in tensors[:3])
    lse = kernels[0].forward(q, k1, v1, prompts, head_dim**-0.5)[1]
    torch.testing.assert_close(lse, REFERENCE.forward(q, k1, v1, prompts, head_dim**-0.5)[1], rtol=1e-3, atol=1e-3)


def _boundary(gen: torch.Generator, lens: list[int], layers: int, heads: tuple[int, int, int]) -> Boundary:
    _, kv_heads, head_dim = heads
    span, device = max(lens), torch.device("cuda")
    kv = [
        torch.randn(len(lens), kv_heads, span, head_dim, generator=gen, device=device, dtype=torch.bfloat16)
        for _ in range(2 * layers)
    ]
    prompt_lens = torch.tensor(lens, device=device)
    return Boundary(
        tuple(t.requires_grad_() for t in kv[:layers]), tuple(t.requires_grad_() for t in kv[layers:]),
        torch.zeros(len(lens), 8, device=device), prompt_lens, prompt_lens, tuple(lens),
    )  # fmt: skip


@pytest.mark.gpu
@on_gpu
def test_on_a_gpu_the_packed_suffix_on_cudnn_matches_flexattention_with_the_boundarys_gradients():
    """Responses of three prompts (one prompt's split in two runs, responses of 1 to 300 tokens) packed end to end:
    the cascade on cuDNN and FlexAttention's masked call give the same output and the same gradients into q, the
    own keys and values, and the boundary's keys and values (padding rows included: none)."""
    gen = torch.Generator("cuda").manual_seed(3)
    heads = (16, 2, 128)
    boundary = _boundary(gen, [700, 1200, 513], layers=1, heads=heads)
    rows, counts = [0, 0, 1, 2, 2, 0, 1], [300, 1, 57, 129, 8, 200, 64]
    pack = ResponsePack.of(rows, counts, 300, torch.device("cuda"))
    m = sum(counts)
    q = torch.randn(1, heads[0], m, heads[2], generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, heads[1], m, heads[2], generator=gen, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(2)
    )
    grad = torch.randn(1, heads[0], m, heads[2], generator=gen, device="cuda", dtype=torch.bfloat16)
    inputs = (q, k, v, boundary.keys[0], boundary.values[0])
    kernels = (CudnnRaggedKernels(causal=False), CudnnRaggedKernels(causal=True))  # capacities from the first call
    results = []
    for attention in (PackedCascadeAttention(boundary, pack, kernels), PackedPrefixAttention(boundary, pack)):
        out = attention(0, q, k, v)
        results.append((out, *torch.autograd.grad(out, inputs, grad)))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@on_gpu
def test_on_a_gpu_graphs_built_ahead_serve_other_lengths_within_the_capacities_and_never_make_the_host_wait():
    """Kernels whose floor holds both calls (three segments of 100-200 queries, then two of 256 and 3), their graphs
    built ahead (`build_graphs`, as the engines do): neither call builds one; the second sends its lengths without a
    stream sync."""
    gen = torch.Generator("cuda").manual_seed(5)
    device, kernels = torch.device("cuda"), CudnnRaggedKernels(causal=False, floor=Capacity(4, 256, 512, 512, 2048))

    def call(q_lens: list[int], k_lens: list[int]) -> None:
        s = Segments.of(q_lens, k_lens, causal=False, device=device)
        q = torch.randn(sum(q_lens), 16, 128, generator=gen, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(sum(k_lens), 2, 128, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        out, lse, saved = kernels.forward(q, k, v, s, 128**-0.5)
        kernels.backward(torch.ones_like(out), q, k, v, out, lse, s, 128**-0.5, saved)

    build_graphs((kernels,), device, torch.bfloat16, 16, 2, 128)
    built = _graph.cache_info().misses
    call([100, 200, 50], [300, 500, 400])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call([256, 3], [512, 20])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _graph.cache_info().misses == built


@pytest.mark.gpu
@on_gpu
def test_on_a_gpu_the_backwards_workspace_follows_the_total_tokens_not_segments_times_the_longest():
    """Eight segments of up to 4,096 queries and keys, 4,096 queries and 8,192 keys in all: the backward's float32
    workspace (dq's accumulator, dk and dv at the 16 query heads) is sized by the totals, under what dq's
    accumulator alone takes sized as eight segments of the longest."""
    kernels = CudnnRaggedKernels(causal=False, floor=Capacity(8, 4096, 4096, 4096, 8192))
    q = torch.empty(4096, 16, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.empty(8192, 2, 128, device="cuda", dtype=torch.bfloat16)
    shape = kernels._shape(q, k, 128**-0.5)
    workspace = _graph(shape, True).workspace
    as_segments = 8 * 4096 * 16 * 128 * 4
    by_totals = (4096 + 2 * 8192) * 16 * 128 * 4
    assert workspace < as_segments and workspace <= 2 * by_totals
    assert workspace == min(_build(shape, True, key_total=told).workspace for told in (True, False))


def test_a_model_given_cudnn_kernels_keeps_scoring_with_the_dense_mask_on_the_cpu(model, prompts):
    """`suffix_kernels` sizes the kernels from the workload (the prompt part's capacity a group of N x R queries over
    the prompt budget; the own part's N x P responses of R); off a GPU scoring stays SDPA with a dense mask."""
    tokens = torch.randint(8, 100, (3, 2, 4), generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([[4, 1], [2, 3], [3, 4]])
    boundary = model.prefix(prompts, attached=False)
    before = model.suffix(boundary, tokens, lens)
    model.suffix_kernels = suffix_kernels(prompts=3, samples=2, response_tokens=4, prompt_tokens=64)
    prompt_part, own_part = model.suffix_kernels
    assert prompt_part.capacity == Capacity(3, 8, 64, 8, 192) and not prompt_part.causal
    assert own_part.capacity == Capacity(6, 4, 4, 8, 8) and own_part.causal
    after = model.suffix(boundary, tokens, lens)
    assert torch.equal(after.logprobs, before.logprobs) and torch.equal(after.entropy, before.entropy)


@pytest.mark.gpu
@on_gpu
def test_on_a_gpu_deterministic_kernels_give_the_same_gradients_bit_for_bit_and_the_defaults_within_rounding():
    """Both parts' backward run twice on the same inputs (four prompts of 700-1,300 keys, 32 responses of 1-300
    tokens): on cuDNN's deterministic kernels the gradients are equal bit for bit, and they agree with the default
    kernels' within bf16 rounding."""
    gen = torch.Generator("cuda").manual_seed(7)
    device = torch.device("cuda")
    resp = torch.randint(1, 301, (32,), generator=gen, device=device).tolist()
    prompts = [700, 1300, 1024, 950]
    cases = {False: ([sum(resp[i::4]) for i in range(4)], prompts), True: (resp, resp)}
    for causal, (q_lens, k_lens) in cases.items():
        s = Segments.of(q_lens, k_lens, causal=causal, device=device)
        q = torch.randn(sum(q_lens), 16, 128, generator=gen, device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(sum(k_lens), 2, 128, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2))
        dout = torch.randn_like(q)
        grads = {}
        for deterministic in (False, True):
            part = CudnnRaggedKernels(causal=causal, deterministic=deterministic)
            out, lse, saved = part.forward(q, k, v, s, 128**-0.5)
            grads[deterministic] = [part.backward(dout, q, k, v, out, lse, s, 128**-0.5, saved) for _ in range(2)]
        for a, b in zip(*grads[True], strict=True):
            assert torch.equal(a, b)
        for a, b in zip(grads[True][0], grads[False][0], strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
