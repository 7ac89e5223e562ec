"""The bench scripts' summaries on made-up inputs: how each script reads and reduces what it measured (the runs
themselves need a GPU; `test_bench_scripts.py` runs the scripts end to end on the tiny spec)."""

from __future__ import annotations

import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from rollplex.graph.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


def bench_module(name: str, monkeypatch) -> ModuleType:
    """bench/NAME.py as a module: registered in sys.modules (its dataclasses look their module up), bench/ on the
    path (a script may import its neighbours)."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    spec = importlib.util.spec_from_file_location(name, ROOT / f"bench/{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module


def test_kernel_classes_sort_a_profiles_kernel_names(monkeypatch):
    module = bench_module("profile_step", monkeypatch)
    assert module.kernel_class("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_TNN") == "matmul"
    assert module.kernel_class("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64") == "matmul"
    assert module.kernel_class("cudnn_generated_fort_native_sdpa_sm90_flash_fprop") == "attention"
    assert module.kernel_class("triton_tem_fused_flex_attention_0") == "attention"
    assert module.kernel_class("triton_poi_fused_add_mul_rsqrt_0") == "fused (triton)"
    assert module.kernel_class("Memcpy DtoD (Device -> Device)") == "copy"
    assert module.kernel_class("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor>") == (
        "elementwise (torch)"
    )
    assert module.kernel_class("ncclKernel_AllReduce") == "other"


def test_link_queue_summarises_each_pair_of_events_as_median_p90_and_longest(monkeypatch):
    module = bench_module("link_queue", monkeypatch)

    class Mark:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, other: Mark) -> float:
            return other.ms - self.ms

    pairs = [(Mark(10.0), Mark(10.0 + ms)) for ms in (3.0, 1.0, 250.0, 2.0, 4.0)]
    assert module.spread(pairs) == {"median": 3.0, "p90": 4.0, "max": 250.0}


def test_host_stalls_tables_each_calls_host_time_idle_and_queued(monkeypatch):
    module = bench_module("host_stalls", monkeypatch)

    def row(case: str, idle: float, queued: float, drain: float) -> dict:
        times = {"idle": (idle, 2 * idle, 1.0), "queued": (queued, 2 * queued, drain)}
        keys = ("host_ms_median", "host_ms_max", "drain_ms_median")
        return {"case": case} | {k: dict(zip(keys, v, strict=True)) for k, v in times.items()}

    text = module.table({"queued_gib": 6.0, "cases": [row("launch", 0.01, 0.02, 130.0), row("sdpa_new", 40, 161, 162)]})
    lines = text.splitlines()
    assert "6.0 GiB of state copies queued" in lines[0]
    assert lines[2].split() == ["launch", "0.01", "/", "0.02", "0.02", "/", "0.04", "130.0"]
    assert lines[3].split() == ["sdpa_new", "40.00", "/", "80.00", "161.00", "/", "322.00", "162.0"]


def test_gemm_sweep_candidates_fit_in_shared_memory_and_never_leave_a_k_part_empty(monkeypatch):
    module = bench_module("gemm_layouts", monkeypatch)
    from rollplex.kernels.tiles import SHARED_BYTES, shortest_part

    for model, tp in (("3b", 1), ("7b", 2)):
        for shape in module.shapes(model, tp):
            for rows in (1, 32, 64):
                found = module.candidates(shape, rows, wide=True)
                assert len(found) == len(set(found)) > 24
                for t in found:
                    assert (t.block_m + t.block_n) * t.block_k * 2 * t.num_stages <= SHARED_BYTES
                    assert shortest_part(shape.in_features, t.split_k, t.block_k) > 0
            prefill = module.candidates(shape, 4096)
            assert {t.split_k for t in prefill} == {None, 1}  # each tile with the wave plan and as one launch


def test_the_decode_profile_labels_the_fused_steps_products_and_a_splits_sum_as_its_product(monkeypatch):
    module = bench_module("decode_profile", monkeypatch)
    layer = ["add_rms_norm", "gemm", "sum_splits", "rotary_to_cache", "partial_kernel", "combine_kernel", "gemm"]
    unfused = [*layer, "sum_splits", "add_rms_norm", "gemm", "silu_mul", "gemm", "sum_splits"]
    fused = [*layer, "add_rms_norm", "gemm", "gemm"]
    tail = ["add_rms_norm", "gemm", "sample_partial", "sample_finish"]
    projections = ["qkv", "o_proj", "gate_up", "down", "lm_head"]
    for names in (unfused, fused):
        labels = module.label_kernels([*names, *tail], num_layers=1)
        assert [x for i, x in enumerate(labels) if x in projections and labels[i - 1] != x] == projections
    assert module.label_kernels([*unfused, *tail], 1)[1:3] == ["qkv", "qkv"]  # the split's sum: its product's


def test_the_decode_profile_spreads_a_tail_batch_over_live_prompts_as_the_engine_places_it(monkeypatch):
    import torch

    module = bench_module("decode_profile", monkeypatch)
    n, prompts = module.NUM_SAMPLES, 8
    step = SimpleNamespace(slots=torch.arange(prompts * n), row_start=torch.zeros(prompts, dtype=torch.long),
                           row_count=torch.zeros(prompts, dtype=torch.long),
                           batch_prompts=torch.zeros(prompts, dtype=torch.long))  # fmt: skip
    assert module.spread_rows(step, 8, 5, prompts) == 5
    assert step.row_count.tolist() == [2, 2, 2, 1, 1, 0, 0, 0]  # rows 0-7 over prompts 0-4, round robin
    assert step.batch_prompts.tolist() == list(range(prompts))  # prompts 0-4 have rows: first
    assert step.row_start.tolist() == [0, 2, 4, 6, 7, 8, 8, 8]
    assert step.slots[:8].tolist() == [0, 1, n, n + 1, 2 * n, 2 * n + 1, 3 * n, 4 * n]  # sorted, grouped by prompt
    assert step.slots[8:].tolist() == list(range(8, prompts * n))  # past the batch: untouched
    for rows, live in ((2, 3), (17, 2), (4, 9)):  # more prompts than rows, more rows than samples, than prompts
        with pytest.raises(AssertionError, match="rows over"):
            module.spread_rows(step, rows, live, prompts)


def test_gpu_clocks_parses_nvidia_smis_samples_and_takes_medians_over_a_window(monkeypatch):
    gpu_clocks = bench_module("gpu_clocks", monkeypatch)

    lines = ["2026/12/01 21:00:00.000, 1980, 3201, 690.5", "2026/12/01 21:00:00.050, 1755, 3201, 700.1",
             "2026/12/01 21:00:00.100, 1650, 3201, 699.0", "[N/A], 1, 2", "2026/12/01 21:00:00.150, 19"]  # fmt: skip
    samples = gpu_clocks.parse(lines)
    assert [s[1] for s in samples] == [1980, 1755, 1650]
    t0 = samples[0][0]
    assert gpu_clocks.medians(samples, t0 + 0.04, t0 + 0.2) == {
        "sm_mhz": 1702.5, "mem_mhz": 3201, "power_w": 699.5, "samples": 2
    }  # fmt: skip
    assert gpu_clocks.medians(samples, t0 + 1, t0 + 2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-abc,GPU-def")
    assert gpu_clocks.first_visible() == "GPU-abc"


def test_the_memory_history_tells_fragmentation_from_live_growth_and_names_the_marker_before_each(monkeypatch):
    history = bench_module("memory_history", monkeypatch)
    gib = 2**30

    def event(action, size, stream=0, addr=0):
        return {"action": action, "addr": addr, "size": size, "stream": stream}

    def marker(size):
        return [event("alloc", size, addr=99), event("free_requested", size, addr=99),
                event("free_completed", size, addr=99)]  # fmt: skip

    trace = [
        *marker(5000),
        event("segment_map", 4 * gib),
        event("alloc", 4 * gib),  # live growth to the peak: 4 GiB
        event("free_completed", 4 * gib),
        *marker(6000),
        event("alloc", 5000, addr=1),
        event("free_completed", 5000),  # a marker's size, not freed next
        event("segment_map", gib, stream=7),
        event("alloc", gib, stream=7),  # 4 GiB free, but on stream 0
        event("free_completed", gib, stream=7),
        event("segment_map", 2 * gib),
        event("alloc", 2 * gib),  # 4 GiB free on its own stream: fragmentation
    ]
    summary = history.analyse(trace, {"allocated": gib, "reserved": gib}, {5000: "suffix", 6000: "backward"})
    assert summary["peak_allocated_gib"] == 5 and summary["peak_reserved_gib"] == 8
    assert summary["reserved_above_live_peak_gib"] == 3 and summary["end_gib"] == {"allocated": 3, "reserved": 8}
    assert summary["grown_below_live_peak_gib"] == 3  # the 1 and the 2 GiB, not the growth to the peak
    assert summary["grown_with_free_on_stream_gib"] == 2  # only the last: stream 7 had nothing free
    assert summary["growth_by_marker_gib"] == {"suffix": 4, "backward": 3}
    first, second, third = (summary["largest_growths"][i] for i in (0, 2, 1))
    assert first["at"] == "suffix" and first["allocated_gib"] == 1
    assert second["free_elsewhere_gib"] == 4 and second["free_on_stream_gib"] == 0
    assert third["free_on_stream_gib"] == 4 and third["at"] == "backward"


def test_op_timeline_counts_each_engines_busy_time_once_and_clips_it_to_the_span(monkeypatch):
    module = bench_module("op_timeline", monkeypatch)
    overlapping = [(0.0, 4.0), (2.0, 6.0), (8.0, 9.0), (1.0, 3.0)]
    assert module.union_s(overlapping, 0.0, 10.0) == 7.0
    assert module.union_s(overlapping, 3.0, 8.5) == 3.5
    assert module.engine("Memcpy HtoD (Pinned -> Device)", 7) == "copy host->device"
    assert module.engine("Memcpy DtoH (Device -> Pinned)", 7) == "copy device->host"
    assert module.engine("ampere_bf16_s16816gemm", 7) == "compute, stream 7"


def test_op_timeline_names_what_ends_each_idle_stretch_and_when_the_host_made_no_cuda_call(monkeypatch):
    module = bench_module("op_timeline", monkeypatch)
    us = [(0, 10_000), (50_000, 60_000), (62_000, 70_000)]  # a stream's kernels, in microseconds
    kernels = [(0, 1, "gemm"), (50_000, 2, "gather"), (62_000, 3, "norm")]
    launched = {1: -5_000, 2: 5_000, 3: 61_000, 11: 12_000}
    copies = [(49_950, 48_000, 11, "Memcpy HtoD (Pinned -> Device)")]  # (end, start, correlation, name)
    gaps = module.idle_gaps(us, 0, 100_000, "compute, stream 7", kernels, launched, copies)
    # the longest first: the gather, launched 5 ms before its stretch began, waited on its own copy, which was
    # launched 2 ms into the stretch and ran only in its last 2 ms; the norm, launched 1 ms into its stretch, waited
    # for the host, and its stretch has no copy on the stream
    assert gaps == {
        "stream": "compute, stream 7",
        "gaps": [
            [10.0, 40.0, -5.0, "gather", [38.0, 1.95, 2.0, "Memcpy HtoD (Pinned -> Device)"]],
            [60.0, 2.0, 1.0, "norm", None],
        ],
        "idle": {"count": 2, "device_waited_s": 0.04, "host_late_s": 0.002},
    }
    assert module.host_gaps([(0, 1_000), (500, 2_000), (10_000, 11_000)], 0) == [[2.0, 8.0]]


def test_the_7b_variants_set_their_keys_in_a_spec_the_loader_takes_and_summarise_a_run(tmp_path, monkeypatch):
    module = bench_module("run_variants", monkeypatch)
    seven = ROOT / "specs/qwen2_5_vl_7b_h200.yaml"
    monkeypatch.chdir(tmp_path)
    out = subprocess.run([sys.executable, str(ROOT / "bench/run_variants.py"), "spec", str(seven),
                          "nocudnn+joined+chunk128+tail8+adaptive"], capture_output=True, text=True)  # fmt: skip
    loaded = load_spec(out.stdout.strip()).spec
    assert loaded.run.cudnn_attention is False and loaded.sharing.update_beside_prefix is False
    assert loaded.sharing.tail_rows == 8 and loaded.sharing.prefix_sms == "adaptive"
    assert loaded.memory.optimizer_chunk_mib == 128 and loaded.memory.page_reference is True  # the rest kept
    data = module.yaml.safe_load(seven.read_text())
    assert module.variant(data, "shipped") == data and module.variant(data, "hbm") != data
    with pytest.raises(SystemExit, match="unknown variant part 'fast'"):
        module.variant({}, "hbm+fast")
    three = module.variant(module.yaml.safe_load((ROOT / "specs/qwen2_5_vl_3b_h200.yaml").read_text()),
                           "norecompute+mb4096")  # fmt: skip
    assert three["memory"]["recompute"] == "none" and three["memory"]["microbatch_tokens"] == 4096
    text = module.summary(ROOT / "bench/results/run_7b_h200_update_beside_metrics.jsonl", seven)
    phases, peaks, steps = text.splitlines()
    assert phases.startswith("phases, medians of steps 2-5") and "actor_prefix 2.56 s" in phases
    assert peaks.startswith("peaks GiB (measured / plan): 1: 113.3 / ") and steps.count(",") == 4


def test_op_timeline_names_the_torch_op_that_issued_each_memset(monkeypatch):
    module = bench_module("op_timeline", monkeypatch)

    class Event:
        def __init__(self, name: str, parent, start: float = 0.0, end: float = 0.0) -> None:
            self.name, self.cpu_parent = name, parent
            self.time_range = type("Range", (), {"start": start, "end": end})()

    attention = Event("aten::_cudnn_attention_forward", None)
    zero = Event("aten::zero_", Event("aten::zeros", None))
    events = [
        Event("cudaMemsetAsync", attention, 0, 3_000),
        Event("cudaMemsetAsync", Event("cuLaunchKernel", attention), 10, 1_010),  # under another runtime call
        Event("cudaMemsetAsync", zero, 20, 40),
        Event("cudaMemsetAsync", None, 50, 60),
        Event("cudaLaunchKernel", zero, 70, 80),
    ]
    assert module.issuers(events, "cudaMemsetAsync") == [
        {"name": "aten::_cudnn_attention_forward", "count": 2, "total_ms": 4.0, "max_ms": 3.0},
        {"name": "aten::zero_", "count": 1, "total_ms": 0.02, "max_ms": 0.02},
        {"name": "(none)", "count": 1, "total_ms": 0.01, "max_ms": 0.01},
    ]


def test_the_time_plan_check_prices_a_run_that_recorded_its_tokens_at_those_tokens(monkeypatch, tmp_path):
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import compile_plan
    from rollplex.graph.timeplan import planned_steps, time_plan

    check = bench_module("timeplan_check", monkeypatch)
    spec = ROOT / "specs/qwen2_5_vl_3b_h200.yaml"
    plan = compile_plan(load_spec(spec))
    steps = planned_steps(plan)[:4]  # steps of different lengths, recorded as a run writes them
    lines = (ROOT / "bench/results/run_3b_h200_5steps_metrics.jsonl").read_text().splitlines()[:4]
    records = [{**json.loads(line), "tokens": t.record()} for line, t in zip(lines, steps, strict=True)]
    run = tmp_path / "metrics.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in records))
    rows = {phase: at for phase, _, at, _ in check.compare(spec, run, str(check.BENCH_3B))}
    effs = check.read_efficiencies(str(check.BENCH_3B), plan.schedule.value)
    each = [{r.timer: r.predicted_s for r in time_plan(plan, effs, (t,))} for t in steps[1:]]  # the warm steps
    assert rows["rollout"] == pytest.approx(statistics.median(e["rollout"] for e in each))
    assert len({round(e["rollout"], 3) for e in each}) == 3  # the steps differ: each is priced at its own


def test_the_time_plan_check_prices_each_phase_at_the_plan_and_at_the_runs_own_steps(monkeypatch):
    check = bench_module("timeplan_check", monkeypatch)
    run = ROOT / "bench/results/run_3b_h200_5steps_metrics.jsonl"
    rows = check.compare(ROOT / "specs/qwen2_5_vl_3b_h200.yaml", run, str(check.BENCH_3B))
    by = {phase: (predicted, at_steps, measured) for phase, predicted, at_steps, measured in rows}
    assert list(by)[-1] == "step" and "ref_prefix" not in by  # beside decode: no seconds of its own
    predicted, at_steps, measured = by["rollout"]
    assert at_steps > predicted * 1.2 and measured == pytest.approx(
        7.06, abs=0.005
    )  # those steps decoded longer than the plan's average
    shift = sum(at - predicted for phase, (predicted, at, _) in by.items() if phase != "step")
    assert by["step"][1] - by["step"][0] == pytest.approx(shift) and by["step"][2] == pytest.approx(
        14.55, abs=0.005
    )  # the run's median step
