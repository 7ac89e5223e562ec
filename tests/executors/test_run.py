"""`rollplex run` on the tiny model: the schedules learn the same thing, on the CPU and the GPU; memory settings
change no number. Checkpoints: `test_checkpointing.py`."""

import json
import re
import time

import pytest
import torch
from run_testkit import ROOT, cli, cli_here, loaded, run, spec_text, train_fresh
from training_testkit import gradients

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan


def test_serial_and_rollplex_give_bitwise_identical_weights_and_losses(tmp_path):
    a, b = run(tmp_path, "serial", 3), run(tmp_path, "rollplex", 3)
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert len({r["param_digest"] for r in a}) == 3  # the weights do move


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_serial_and_rollplex_train_identically_with_the_graph_captured_rollout(tmp_path):
    a, b = run(tmp_path, "serial", 3, device="cuda"), run(tmp_path, "rollplex", 3, device="cuda")
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b]
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert len({r["param_digest"] for r in a}) == 3
    for r in a + b:  # the driver's view of the device, per phase: at least the CUDA context and the weights
        assert set(r["peak_gib_by_phase"]) == {"1", "2", "3"} and min(r["peak_gib_by_phase"].values()) > 0.1


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


def test_prefix_chunks_of_one_prompt_keep_serial_and_rollplex_bitwise_identical(tmp_path):
    spec = parse_spec(spec_text(kl=0.1, device="cpu") + "sharing: {prompts_per_chunk: 1, layers_per_chunk: 2}\n")
    runs = [
        train(compile_plan(spec, Schedule(s)), RunOptions(2, tmp_path / s, progress=False, tensorboard=False))
        for s in ("serial", "rollplex")
    ]
    assert [r["param_digest"] for r in runs[0]] == [r["param_digest"] for r in runs[1]]
    assert runs[1][0]["prefix_beside_decode"] > 0.5


def test_rollplex_runs_its_prefixes_beside_decode_and_serial_does_not(tmp_path):
    a, b = run(tmp_path, "serial", 1), run(tmp_path, "rollplex", 1)
    # 6 decode steps against 2 prompts x (vision blocks + decoder layers) of one-prompt chunks: a part fits
    assert a[0]["prefix_beside_decode"] == 0.0 and b[0]["prefix_beside_decode"] > 0.25
    # the reference's inside the rollout's time; the actor's runs before decode, which reads its boundary
    assert b[0]["time_s"]["ref_prefix"] == 0.0 < b[0]["time_s"]["actor_prefix"]


def test_unsplit_textbook_grpo_gives_the_same_losses(tmp_path):
    split, unsplit = run(tmp_path, "rollplex"), run(tmp_path, "unsplit")
    for s, u in zip(split, unsplit, strict=True):
        assert s["reward_mean"] == u["reward_mean"]
        assert s["loss"] == pytest.approx(u["loss"], rel=1e-5)
        assert s["loss"] != 0.0


def test_split_with_prefix_sharing_gives_every_parameter_the_unsplit_gradient():
    split, unsplit = gradients(Schedule.ROLLPLEX), gradients(Schedule.UNSPLIT)
    assert split.keys() == unsplit.keys()
    assert any(n.startswith("model.visual.") for n in split)
    for name, g in unsplit.items():  # float32 sums in another order: q and k carry ~1e-5 of the whole gradient
        assert g.norm() > 0, name
        assert (split[name] - g).norm() <= 1e-4 * g.norm(), name


def test_kl_coefficient_zero_runs_without_a_reference_model(tmp_path):
    engines = build_engines(compile_plan(loaded(kl=0.0)))
    assert engines.reference is None
    records = train(
        compile_plan(loaded(kl=0.0), Schedule.ROLLPLEX), RunOptions(1, tmp_path, progress=False, tensorboard=False)
    )
    assert not any(key.startswith("ref_") for key in records[0]["time_s"]) and records[0]["kl"] == 0.0


def test_the_shipped_graph_without_a_reference_trains_alike_in_every_schedule(tmp_path):
    spec = parse_spec((ROOT / "specs/grpo_no_reference_tiny.yaml").read_text())
    runs = {
        s: train(compile_plan(spec, Schedule(s)), RunOptions(2, tmp_path / s, progress=False, tensorboard=False))
        for s in ("serial", "rollplex", "unsplit")
    }
    assert [r["param_digest"] for r in runs["serial"]] == [r["param_digest"] for r in runs["rollplex"]]
    for s, u in zip(runs["rollplex"], runs["unsplit"], strict=True):
        assert s["kl"] == 0.0 and s["loss"] != 0.0 and s["loss"] == pytest.approx(u["loss"], rel=1e-5)


METRIC_KEYS = {
    "peak_gib_by_phase",
    "prefix_beside_decode",
    "step",
    "schedule",
    "reward_mean",
    "reward_std",
    "loss",
    "kl",
    "entropy",
    "grad_norm",
    "response_len_mean",
    "param_digest",
    "time_s",
    "peak_mem_bytes",
    "data_wait_s",
    "gc_s",
    "gaps_s",
    "gaps_at_s",
    "tokens",
}
PHASE_TIMES = {"rollout", "ref_prefix", "actor_prefix", "ref_suffix", "actor_suffix_backward", "update"}


@pytest.mark.slow
def test_the_cli_runs_the_tiny_spec_in_under_60_seconds_with_metrics_and_tensorboard(tmp_path):
    start = time.perf_counter()
    proc = cli("--steps", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert time.perf_counter() - start < 60
    said = [line for line in proc.stderr.splitlines() if line.startswith("rollplex:")]  # start-up, before the bars
    assert said[0] == "rollplex: building the models, the optimizer state and the host pool"
    assert re.fullmatch(r"rollplex: ready in \d+\.\d s", said[1]), said
    records = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert set(records[0]) >= METRIC_KEYS and set(records[0]["time_s"]) >= PHASE_TIMES
    assert not any(key.startswith("critic") for key in records[0]["time_s"])  # timers of the graph's ops only
    assert records[1]["data_wait_s"] < records[0]["data_wait_s"]  # step 2's examples were made during step 1
    tokens = records[0]["tokens"]  # the step's counts, for a later cost model (`bench/timeplan_check.py`)
    lens = [n for row in tokens["response_lens"] for n in row]
    assert len(tokens["prompt_tokens"]) == len(tokens["response_lens"]) and min(tokens["patches"]) > 0
    assert sum(lens) / len(lens) == pytest.approx(records[0]["response_len_mean"])
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert (tmp_path / "checkpoints" / "step-000002" / "model" / "model.safetensors").is_file()
    last = proc.stdout.splitlines()[-1]  # each phase's seconds, bound and efficiency over the warm step
    assert last.startswith("phases, medians of step 2 (seconds, bound, efficiency): ") and "rollout " in last


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without a GPU")
def test_run_device_cuda_without_a_gpu_is_a_one_line_error(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    text = (ROOT / "specs/tiny_cpu.yaml").read_text()
    assert "dtype: float32}" in text
    spec.write_text(text.replace("dtype: float32}", "dtype: float32, device: cuda}"))
    code, err = cli_here(capsys, "run", str(spec), "--out", str(tmp_path / "out"))
    assert code == 2 and "run.device" in err and "no GPU" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_main_job_learns_the_answer_form_from_random_weights_in_its_first_140_steps(tmp_path):
    spec = parse_spec((ROOT / "specs/tiny_cpu.yaml").read_text())  # the last 20 steps' form: 0.40 from 0.005
    opts = RunOptions(140, tmp_path, progress=False, tensorboard=False, checkpoints=False)
    records = train(compile_plan(spec), opts)
    early = sum(r["rewards/answer_format"] for r in records[:10]) / 10
    late = sum(r["rewards/answer_format"] for r in records[-20:]) / 20
    assert late > early + 0.3, (early, late)
    assert all(0.0 <= r["accuracy"] <= 1.0 and r["logprob_diff_max"] < 1e-4 for r in records)


def step_noting_prefills(spec, schedule: Schedule):
    """One step of `spec`: its record, whether each rollout was handed a prefill, and the updated weights."""
    engines = build_engines(compile_plan(spec, schedule))
    dataset = open_dataset(spec.spec.workload.dataset, engines.tokenizer, 3)
    prefills, rollout = [], engines.rollout
    engines.rollout = lambda *a, **kw: prefills.append("boundary" in kw) or rollout(*a, **kw)
    record = run_iteration(compile_graph(spec.spec, schedule=schedule), engines, batch_at(dataset, 0, 2))
    return record, prefills, [p.detach().clone() for p in engines.actor.parameters()]


def test_a_rollout_from_the_actors_prefix_samples_and_trains_as_its_own_prefill_does():
    """The actor prefix computes the prompts' KV and first-token log-probs on the rollout's weights, so the
    rollout decoding from it samples the same tokens and the step trains the same weights as the rollout's own
    prefill (to rounding: the two prefill in other batches); serial and rollplex stay bitwise alike with it."""
    text = spec_text(kl=0.1, device="cpu")
    assert "run: {seed: 3," in text
    own = parse_spec(text.replace("run: {seed: 3,", "run: {seed: 3, rollout_prefill: rollout,"))
    shared = parse_spec(text)  # auto: the actor's prefix, as the spec allows it
    a, own_prefills, wa = step_noting_prefills(own, Schedule.SERIAL)
    b, serial_prefills, wb = step_noting_prefills(shared, Schedule.SERIAL)
    c, rollplex_prefills, wc = step_noting_prefills(shared, Schedule.ROLLPLEX)
    assert own_prefills == [False] and serial_prefills == rollplex_prefills == [True]
    assert torch.equal(a.responses, b.responses) and torch.equal(a.rewards, b.rewards)
    for key, value in a.stats.items():
        assert b.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for p, q in zip(wa, wb, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(c.stats[k] == v for k, v in b.stats.items())  # rollplex also says how its prefixes overlapped
    assert all(torch.equal(p, q) for p, q in zip(wb, wc, strict=True))


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


def test_replayed_lengths_end_the_responses_at_budgets_drawn_from_the_preset():
    text = spec_text(kl=0.0, device="cpu", model="tiny").replace("response_tokens: 6", "response_tokens: 32")
    spec = parse_spec(
        text.replace('dataset: "synthetic:clevrer@tiny"', 'dataset: "synthetic:clevrer@tiny", replay_lengths: true')
    )
    g = compile_graph(spec.spec, schedule=Schedule.ROLLPLEX)
    lens = []
    for _ in range(2):  # the same seed draws the same budgets
        engines = build_engines(compile_plan(spec))
        dataset = open_dataset(spec.spec.workload.dataset, engines.tokenizer, 3)
        lens.append(run_iteration(g, engines, batch_at(dataset, 0, 2)).response_lens)
    assert torch.equal(lens[0], lens[1])
    assert len(set(lens[0].flatten().tolist())) > 2  # long-tailed, not everyone at max tokens
    assert engines.response_lengths is not None and int(lens[0].max()) <= 32


def step_alike(g, spec, first, second) -> None:
    """One step of each engine on the same batch of `spec`'s data: the same stats, bitwise the same weights."""
    dataset = open_dataset(spec.spec.workload.dataset, first.tokenizer, 3)
    a, b = (run_iteration(g, e, batch_at(dataset, 0, 2)) for e in (first, second))
    assert a.stats == b.stats
    for (name, p), q in zip(first.actor.named_parameters(), second.actor.parameters(), strict=True):
        assert torch.equal(p, q), name


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


@pytest.mark.slow
def test_under_mps_rollout_runs_in_its_own_process_and_both_schedules_train_identically(tmp_path):
    spec = parse_spec(spec_text(kl=0.1, device="cpu") + "sharing: {policy: mps}\n")
    opts = {"progress": False, "tensorboard": False}
    a = train(compile_plan(spec, Schedule.SERIAL), RunOptions(2, tmp_path / "serial", **opts))
    b = train(compile_plan(spec, Schedule.ROLLPLEX), RunOptions(2, tmp_path / "rollplex", **opts))
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b]
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert len({r["param_digest"] for r in a}) == 2 and b[0]["prefix_beside_decode"] > 0


def test_mps_under_tensor_parallelism_is_a_spec_error():
    with pytest.raises(ValueError, match="mps runs on one GPU"):
        parse_spec(spec_text(kl=0.1, device="cpu").replace("hbm_gib: 16", "hbm_gib: 16, gpus_per_node: 2")
                   + "parallel: {train_tp: 2}\nsharing: {policy: mps}\n")  # fmt: skip


def test_deterministic_kernels_train_the_same_on_the_cpu_and_the_setting_does_not_leak(tmp_path):
    on = parse_spec(spec_text(kl=0.1, device="cpu").replace("device: cpu,", "device: cpu, deterministic: true,"))
    a = train(compile_plan(on, Schedule("rollplex")), RunOptions(1, tmp_path / "on", progress=False, tensorboard=False))
    assert torch.are_deterministic_algorithms_enabled()
    b = run(tmp_path, "rollplex", 1, name="off")
    assert not torch.are_deterministic_algorithms_enabled()
    assert a[0]["param_digest"] == b[0]["param_digest"]  # the CPU's kernels are deterministic either way


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_phase_time_counts_the_device_work_its_ops_leave_queued(monkeypatch):
    from rollplex.executors import runtime
    from rollplex.graph.ir import NodeKind

    spec = loaded(device="cuda")
    plan = compile_plan(spec)
    engines = build_engines(plan)
    handler = runtime._handler

    def slowed(o):  # the update's handler leaves ~0.5 s of device work queued when it returns
        if o.kind is NodeKind.UPDATE:
            return lambda *args: (handler(o)(*args), torch.cuda._sleep(10**9))
        return handler(o)

    monkeypatch.setattr(runtime, "_handler", slowed)
    dataset = open_dataset(spec.spec.workload.dataset, engines.tokenizer, 3)
    began = time.perf_counter()
    record = run_iteration(plan.graph, engines, batch_at(dataset, 0, 2))
    assert record.times["update"] >= 0.3  # the device's time, not the host's launch
    assert time.perf_counter() - began >= record.times["update"]  # the step's record waits for its last op
