"""The levers of `rollplex run` over memory and kernels change no number: a reference paged to the host where the
plan puts it, the allocator's cache handed back at phases or only before mappings (and before a prefix that ran
beside decode is backpropagated), the actor prefix's activations offloaded or recomputed, the training microbatch
recomputed, compiled layers, deterministic kernels; and attention without cuDNN runs no cuDNN kernel."""

import pytest
import torch
from run_testkit import run, spec_text, train_fresh

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan


def test_the_reference_is_paged_where_the_plan_puts_it_on_the_host():
    from rollplex.graph.memobject import Residency

    def paged(text: str) -> bool:
        return compile_plan(parse_spec(text)).decisions.reference_weights is Residency.HOST

    assert not paged(spec_text(kl=0.1, device="cpu"))  # memory.page_reference is off by default
    text = spec_text(kl=0.1, device="cpu") + "memory: {page_reference: true}\n"
    assert paged(text)
    assert not paged(text.replace("page_reference: true", "page_reference: true, host_pool_gib: 0.000001"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_paged_reference_changes_no_number_of_serial_or_rollplex(tmp_path):
    text = spec_text(kl=0.1, device="cuda").replace("cuda,", "cuda, deterministic: true,")
    paged = parse_spec(text + "memory: {page_reference: true}\n")
    assert build_engines(compile_plan(paged)).reference_pager is not None
    a, b = (train_fresh(compile_plan(paged, Schedule(s)), RunOptions(2, tmp_path / s, progress=False,
                                                                      tensorboard=False))
            for s in ("serial", "rollplex"))  # fmt: skip
    c = run(tmp_path, "rollplex", 2, name="resident", device="cuda")
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b] == [r["param_digest"] for r in c]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_allocator_hands_back_its_cache_before_a_prefix_that_ran_beside_decode_is_backpropagated(
    monkeypatch,
):
    from rollplex.executors.scoring import LeafBoundary

    seen, releases = [], []  # per backward through the prefix: (other_stream, the releases inside it)
    backward, empty = LeafBoundary.backward_through_prefix, torch.cuda.empty_cache

    def recorded(self):
        before = len(releases)
        backward(self)
        seen.append((self.other_stream, len(releases) - before))

    monkeypatch.setattr(LeafBoundary, "backward_through_prefix", recorded)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (releases.append(1), empty()))
    text = spec_text(kl=0.1, device="cuda").replace("run: {", "run: {rollout_prefill: rollout, ")
    spec = parse_spec(text + "sharing: {policy: streams}\n")  # the engine prefills: the actor prefix runs beside
    for schedule in ("serial", "rollplex"):
        plan = compile_plan(spec, Schedule(schedule))
        engines = build_engines(plan)
        dataset = open_dataset(spec.spec.workload.dataset, engines.tokenizer, 0, spec.path.parent)
        run_iteration(plan.graph, engines, batch_at(dataset, 0, spec.spec.workload.prompts_per_step))
    # the actor's prefix ran on the streams policy's stream under rollplex only; only there it releases
    assert seen == [(False, 0), (True, 1)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_cache_emptied_only_before_mappings_changes_no_number_and_empties_less(tmp_path, monkeypatch):
    """`memory.empty_cache: mappings`: the runtime leaves the blocks a phase frees cached; the rollout still empties
    the cache before it maps its KV."""
    releases, empty = [], torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (releases.append(1), empty()))
    text = spec_text(kl=0.1, device="cuda").replace("cuda,", "cuda, deterministic: true,")
    counts, digests = [], []
    for mode in ("phases", "mappings"):
        spec = parse_spec(text + f"memory: {{empty_cache: {mode}}}\n")
        assert build_engines(compile_plan(spec)).empty_cache_at_phases is (mode == "phases")
        before = len(releases)
        records = train_fresh(compile_plan(spec), RunOptions(2, tmp_path / mode, progress=False, tensorboard=False))
        counts.append(len(releases) - before)
        digests.append([r["param_digest"] for r in records])
    assert digests[0] == digests[1]
    assert 0 < counts[1] < counts[0], counts


def step_alike(g, spec, first, second) -> None:
    """One step of each engine on the same batch of `spec`'s data: the same stats, bitwise the same weights."""
    dataset = open_dataset(spec.spec.workload.dataset, first.tokenizer, 3)
    a, b = (run_iteration(g, e, batch_at(dataset, 0, 2)) for e in (first, second))
    assert a.stats == b.stats
    for (name, p), q in zip(first.actor.named_parameters(), second.actor.parameters(), strict=True):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("mode", ["offload", "recompute"])
def test_giving_back_the_actor_prefix_activations_changes_no_number(mode):
    from contextlib import nullcontext

    memory = f"memory: {{prefix_activations: {mode}, prefix_saved: host}}\n"
    spec = parse_spec(spec_text(kl=0.1, device="cpu") + memory)
    g = compile_graph(spec.spec, schedule=Schedule.ROLLPLEX)
    kept, given_back = build_engines(compile_plan(spec)), build_engines(compile_plan(spec))
    kept.prefix_memory = nullcontext  # every saved tensor stays where autograd put it
    step_alike(g, spec, kept, given_back)
    if mode == "offload":
        assert given_back.prefix_memory().stats().num_bytes > 0  # the prefix's saved tensors went to the pool


@pytest.mark.parametrize("how", ["selective, layers_kept: 0", "full, layers_kept: 0", "full, layers_kept: 1"])
@pytest.mark.parametrize("schedule", [Schedule.ROLLPLEX, Schedule.UNSPLIT])
def test_recomputing_the_training_microbatch_changes_no_number(schedule, how):
    specs = [parse_spec(spec_text(kl=0.1, device="cpu") + f"memory: {{recompute: {r}}}\n") for r in ("none", how)]
    g = compile_graph(specs[0].spec, schedule=schedule)
    kept, recomputed = build_engines(compile_plan(specs[0])), build_engines(compile_plan(specs[1]))
    layers, blocks = len(recomputed.actor.model.language_model.layers), len(recomputed.actor.model.visual.blocks)
    rerun = layers - int(how[-1])  # a layer kept whole reruns nothing
    decoder = recomputed.actor.model.language_model.layers
    with recomputed.microbatch_memory() as wrapped:  # selective: each layer's two halves, each block whole
        assert wrapped == (2 if how.startswith("selective") else 1) * rerun + blocks
        patched = [bool({"forward", "after_attention"} & layer.__dict__.keys()) for layer in decoder]
        assert patched == [True] * rerun + [False] * (layers - rerun)  # the last layers are the ones kept whole
    step_alike(g, specs[0], kept, recomputed)


def test_compiled_layers_patch_the_scoring_models_halves_and_on_the_cpu_change_no_number():
    """`run.compiled_layers`: the actor's and the reference's decoder layers and vision blocks run their halves
    through `compile_halves` (Inductor on a GPU, as they are on the CPU), under selective recompute too."""
    texts = [spec_text(kl=0.1, device="cpu") + "memory: {recompute: selective, layers_kept: 0}\n", None]
    texts[1] = texts[0].replace("run: {", "run: {compiled_layers: true, ")
    assert texts[1] != texts[0]
    specs = [parse_spec(t) for t in texts]
    g = compile_graph(specs[0].spec, schedule=Schedule.ROLLPLEX)
    plain, compiled = (build_engines(compile_plan(s)) for s in specs)
    for model in (compiled.actor, compiled.reference):
        for unit in (model.model.language_model.layers[0], model.model.visual.blocks[0]):
            own = unit.__dict__  # patched on the instance, bound to it
            assert own["before_attention"].__func__ is not type(unit).before_attention and own["after_attention"]
    assert "before_attention" not in plain.actor.model.language_model.layers[0].__dict__
    step_alike(g, specs[0], plain, compiled)


@pytest.mark.slow
def test_compiled_layers_forced_on_the_cpu_score_and_backpropagate_as_the_eager_ones(monkeypatch):
    """The regions compiled on the CPU (through AOTAutograd, as on a GPU but for Inductor's kernels) inside a whole
    step: the prefix's reruns, the selective suffix, the reference; the step's loss and gradient norm within
    rounding of the eager step's."""
    from torch._dynamo.backends.registry import lookup_backend

    from rollplex.models import layers

    aot = lookup_backend("aot_eager")
    for name, fn in (("_before_region", layers._before), ("_after_region", layers._after)):
        monkeypatch.setattr(layers, name, layers.layout_compiled(fn, aot, lambda x: True, unbacked=True))
    memory = "memory: {recompute: selective, layers_kept: 0, prefix_activations: recompute}\n"
    text = spec_text(kl=0.1, device="cpu") + memory
    specs = [parse_spec(t) for t in (text, text.replace("run: {", "run: {compiled_layers: true, "))]
    g = compile_graph(specs[0].spec, schedule=Schedule.ROLLPLEX)
    plain, compiled = (build_engines(compile_plan(s)) for s in specs)
    dataset = open_dataset(specs[0].spec.workload.dataset, plain.tokenizer, 3)
    a, b = (run_iteration(g, e, batch_at(dataset, 0, 2)).stats for e in (plain, compiled))
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-7), key
    assert a["grad_norm"] > 0


def test_deterministic_kernels_train_the_same_on_the_cpu_and_the_setting_does_not_leak(tmp_path):
    on = parse_spec(spec_text(kl=0.1, device="cpu").replace("device: cpu,", "device: cpu, deterministic: true,"))
    a = train(compile_plan(on, Schedule("rollplex")), RunOptions(1, tmp_path / "on", progress=False, tensorboard=False))
    assert torch.are_deterministic_algorithms_enabled()
    b = run(tmp_path, "rollplex", 1, name="off")
    assert not torch.are_deterministic_algorithms_enabled()
    assert a[0]["param_digest"] == b[0]["param_digest"]  # the CPU's kernels are deterministic either way


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_attention_without_cudnn_runs_no_cudnn_kernel():
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile

    text = spec_text(kl=0.1, device="cuda").replace("run: {", "run: {cudnn_attention: false, ")
    q = torch.randn(4, 16, 300, 128, device="cuda", dtype=torch.bfloat16)
    mask = torch.rand(4, 1, 300, 300, device="cuda") > 0.1  # the suffix's kind of call: a boolean mask
    try:
        build_engines(compile_plan(parse_spec(text)))
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            F.scaled_dot_product_attention(q, q[:, :2], q[:, :2], is_causal=True, enable_gqa=True)  # the prefix's
            torch.cuda.synchronize()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert kernels and not [k for k in kernels if "cudnn" in k.lower()]
