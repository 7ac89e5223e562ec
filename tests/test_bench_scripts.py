"""The GPU measurement scripts under bench/ run end to end on the tiny spec (on the CPU: times only)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollplex.graph.load import load_spec

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.parametrize(
    "schedule, grouping, kernels, tables",
    [
        ("serial", ["--prompts-per-chunk", "all"], "ref_score.suffix,actor_backward,nothing", ["ref_score.suffix: ",
                                                                                             "actor_backward: "]),
        ("rollplex", [], "suffix_rows,backward_through_prefix,suffix_backward",
         ["suffix_rows (", "backward_through_prefix: ", "suffix_backward ("]),
    ],
)  # fmt: skip
def test_profile_step_times_every_op_of_either_schedule(schedule, grouping, kernels, tables):
    command = [sys.executable, str(ROOT / "bench/profile_step.py"), str(ROOT / "specs/tiny_cpu.yaml"),
               "--schedule", schedule, "--kernels", kernels, "--top", "3", *grouping]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    timed = {line.split()[0] for line in out.stdout.splitlines() if line[:1].isalpha() and len(line.split()) == 5}
    # under rollplex the prefixes run beside decode: their befores all come before their afters
    assert {"rollout", "ref_score.prefix", "actor_score.prefix", "ref_score.suffix", "actor_backward"} <= timed
    for table in tables:  # a table per filter, each with kernels in it (an op's or each call of a function)
        heading = next(line for line in out.stdout.splitlines() if line.startswith(table))
        assert float(heading.split("kernels ")[1].split(" s")[0]) > 0, heading
    assert out.stdout.count("by class: ") == len(tables)
    assert ("no op id contains 'nothing'" in out.stdout) is (schedule == "serial")


def test_profile_step_refuses_op_ids_beside_a_function_in_one_line():
    command = [sys.executable, str(ROOT / "bench/profile_step.py"), str(ROOT / "specs/tiny_cpu.yaml"),
               "--kernels", "actor_backward,suffix_rows"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1 and "not both" in out.stderr


def test_kernel_classes_sort_a_profiles_kernel_names():
    spec = importlib.util.spec_from_file_location("profile_step", ROOT / "bench/profile_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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


def issue5_script_tree(tmp_path: Path) -> Path:
    """A copy of the script and the specs in `tmp_path`, with a stand-in python3 that prints its arguments (and
    fails a --serial-only run when FAIL=1); returns the stand-in's folder, to put first on PATH."""
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    (tmp_path / "bench").mkdir()
    shutil.copy(ROOT / "bench/issue5_h200.sh", tmp_path / "bench")
    (tmp_path / "rollplex").mkdir()
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(
        '#!/bin/bash\necho "python3 $*"\n[ "$FAIL" = 1 ] && [[ "$*" == *--serial-only* ]] && exit 1\nexit 0\n'
    )
    fake.chmod(0o755)
    return fake.parent


def test_issue5_stages_time_serial_and_rollplex_apart_and_never_against_a_stale_serial_run(tmp_path):
    fake = issue5_script_tree(tmp_path) / "python3"
    (tmp_path / "bench/baselines").mkdir()
    stale = tmp_path / "bench/baselines/serial_3b_h200_nocudnn.pt"
    stale.write_text("an earlier call's serial run")

    def stage(*args: str, fail: bool = False, ppc: str = "", prefill: str = "") -> list[str]:
        env = {**os.environ, "PATH": f"{fake.parent}:{os.environ['PATH']}", "OUT": str(tmp_path),
               "CUDNN": "off", "FAIL": "1" if fail else "0", "PPC": ppc, "PREFILL": prefill}  # fmt: skip
        proc = subprocess.run(["bash", "bench/issue5_h200.sh", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        return [line for line in (tmp_path / "bench3b.log").read_text().splitlines() if "rollplex bench" in line]

    serial, rollplex = stage("bench3b", "green:33", "2", "all")
    assert "--serial-only" in serial and "--policies green:33" in serial and "--serial-from" in rollplex
    assert ".qwen2_5_vl_3b_h200_nocudnn.yaml" in serial and "_nocudnn_green33" in rollplex
    assert "cudnn_attention: false" in (tmp_path / "specs/.qwen2_5_vl_3b_h200_nocudnn.yaml").read_text()
    assert not stale.exists()  # removed before serial ran, so that no rollplex run can be compared with it
    stale.write_text("an earlier call's serial run")
    assert len(stage("bench3b", fail=True)) == 1 and not stale.exists()  # serial failed: no rollplex run
    assert "no rollplex run" in (tmp_path / "bench3b.log").read_text()
    serial, rollplex = stage("bench3b", ppc="8")  # rollplex's prefixes grouped as serial's
    grouped = tmp_path / "specs/.qwen2_5_vl_3b_h200_nocudnn_ppc8.yaml"
    assert grouped.name in serial and "_nocudnn_ppc8_green66" in rollplex
    text = grouped.read_text()
    assert "\n  prompts_per_chunk: 8\n" in text and "prompts_per_chunk: null" not in text  # the spec's, replaced
    assert "cudnn_attention: false" in text and load_spec(grouped).spec.sharing.prompts_per_chunk == 8
    spec = tmp_path / "specs/qwen2_5_vl_3b_h200.yaml"  # a spec without the setting gets it added
    spec.write_text("".join(line for line in spec.read_text().splitlines(True) if "prompts_per_chunk" not in line))
    stage("bench3b", ppc="8")
    assert "sharing:\n  prompts_per_chunk: 8\n" in grouped.read_text()
    assert load_spec(grouped).spec.sharing.prompts_per_chunk == 8  # a spec the runtime takes
    serial, rollplex = stage("bench3b", prefill="actor")  # the rollout decodes from the actor prefix's boundary
    prefilled = tmp_path / "specs/.qwen2_5_vl_3b_h200_nocudnn_actorprefill.yaml"
    assert prefilled.name in serial and "_nocudnn_actorprefill_green66" in rollplex
    run = load_spec(prefilled).spec.run
    assert run.rollout_prefill == "actor_prefix" and run.cudnn_attention is False
    serial, rollplex = stage("bench3b", prefill="rollout")  # the engine prefills
    assert "_nocudnn_rolloutprefill_green66" in rollplex
    assert (
        load_spec(tmp_path / "specs/.qwen2_5_vl_3b_h200_nocudnn_rolloutprefill.yaml").spec.run.rollout_prefill
        == "rollout"
    )


def test_a_preset_stage_times_serial_once_and_each_policy_in_a_process_of_its_own(tmp_path):
    fake = issue5_script_tree(tmp_path) / "python3"

    def preset(*policies: str, fail: bool = False) -> list[str]:
        env = {
            **os.environ,
            "PATH": f"{fake.parent}:{os.environ['PATH']}",
            "OUT": str(tmp_path),
            "FAIL": str(int(fail)),
        }
        proc = subprocess.run(["bash", "bench/issue5_h200.sh", "preset", "star", *policies], cwd=tmp_path, env=env,
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        log = (tmp_path / "bench_star.log").read_text().splitlines()
        (tmp_path / "bench_star.log").unlink()
        return [line for line in log if line.startswith("python3 -m rollplex bench")]

    serial, *rollplex = preset("green:66", "streams", "mps:50")
    assert "--serial-only" in serial and "specs/qwen2_5_vl_3b_h200_star.yaml" in serial
    assert [line.split("--policies ")[1].split()[0] for line in rollplex] == ["green:66", "streams", "mps:50"]
    assert all("--serial-from bench/baselines/serial_3b_h200_star.pt" in line for line in rollplex)
    assert rollplex[2].endswith("--out " + str(tmp_path / "qwen2_5_vl_3b_h200_star_mps50"))
    assert [line.split("--policies ")[1].split()[0] for line in preset()[1:]] == ["green:66"]  # the default
    assert len(preset("green:66", "streams", fail=True)) == 1  # serial failed: no rollplex run at all


@pytest.mark.parametrize(
    ("script", "args", "message"),
    [
        ("share_efficiency", ["--ways", "bogus"], "unknown ways ['bogus']"),
        ("share_efficiency", ["--ways", "rest"], "the way rest is the partition beside --decode-sms D"),
        ("share_efficiency", ["--ways", "stream", "green:33"], "needs a CUDA GPU"),
        ("link_queue", ["--cases", "gated", "bogus"], "unknown cases ['bogus']"),
        ("link_queue", ["--cases", "idle"], "needs a CUDA GPU"),
        ("module_times", ["specs/tiny_cpu.yaml", "--gc", "python", "bogus"], "unknown --gc variants ['bogus']"),
    ],
)
def test_gpu_benches_refuse_bad_arguments_and_a_machine_without_a_gpu_in_one_line(tmp_path, script, args, message):
    if torch.cuda.is_available() and message == "needs a CUDA GPU":
        pytest.skip("checks the refusal on a machine without a GPU")
    command = [sys.executable, str(ROOT / f"bench/{script}.py"), *args, "--out", str(tmp_path / "out.json")]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out.json").exists()


def test_link_queue_summarises_each_pair_of_events_as_median_p90_and_longest(monkeypatch):
    spec = importlib.util.spec_from_file_location("link_queue", ROOT / "bench/link_queue.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "link_queue", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)

    class Mark:
        def __init__(self, ms: float) -> None:
            self.ms = ms

        def elapsed_time(self, other: Mark) -> float:
            return other.ms - self.ms

    pairs = [(Mark(10.0), Mark(10.0 + ms)) for ms in (3.0, 1.0, 250.0, 2.0, 4.0)]
    assert module.spread(pairs) == {"median": 3.0, "p90": 4.0, "max": 250.0}


def test_gemm_sweep_candidates_fit_in_shared_memory_and_never_leave_a_k_part_empty(monkeypatch):
    spec = importlib.util.spec_from_file_location("gemm_layouts", ROOT / "bench/gemm_layouts.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gemm_layouts", module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
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
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # decode_profile imports decode from its folder
    spec = importlib.util.spec_from_file_location("decode_profile", ROOT / "bench/decode_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    layer = ["add_rms_norm", "gemm", "sum_splits", "rotary_to_cache", "partial_kernel", "combine_kernel", "gemm"]
    unfused = [*layer, "sum_splits", "add_rms_norm", "gemm", "silu_mul", "gemm", "sum_splits"]
    fused = [*layer, "add_rms_norm", "gemm", "gemm"]
    tail = ["add_rms_norm", "gemm", "sample_partial", "sample_finish"]
    projections = ["qkv", "o_proj", "gate_up", "down", "lm_head"]
    for names in (unfused, fused):
        labels = module.label_kernels([*names, *tail], num_layers=1)
        assert [x for i, x in enumerate(labels) if x in projections and labels[i - 1] != x] == projections
    assert module.label_kernels([*unfused, *tail], 1)[1:3] == ["qkv", "qkv"]  # the split's sum: its product's


def test_gpu_clocks_parses_nvidia_smis_samples_and_takes_medians_over_a_window(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import gpu_clocks

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


@pytest.mark.slow
def test_startup_times_names_each_stage_of_a_run_and_each_step(tmp_path):
    command = [sys.executable, str(ROOT / "bench/startup_times.py"), "run", str(ROOT / "specs/tiny_cpu.yaml"),
               "--steps", "2", "--quiet", "--no-checkpoints", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stages = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("[startup] ")]
    assert {"_initial_model", "make_optimizer", "build_engines", "open_dataset"} <= set(stages)
    assert stages.count("run_iteration") == 2 and stages.index("build_engines") < stages.index("run_iteration")


def test_the_memory_history_tells_fragmentation_from_live_growth_and_names_the_marker_before_each():
    spec = importlib.util.spec_from_file_location("memory_history", ROOT / "bench/memory_history.py")
    history = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(history)
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


def test_prefix_packing_times_both_layouts_on_the_tiny_spec(tmp_path):
    out = tmp_path / "packing.json"
    command = [sys.executable, str(ROOT / "bench/prefix_packing.py"), str(ROOT / "specs/tiny_cpu.yaml"),
               "--steps", "1", "--iters", "1", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (step,) = json.loads(out.read_text())["steps"]
    assert step["padded_tokens"] > step["prompt_tokens"]  # the tiny spec's prompts differ in length
    assert set(step["padded"]) == set(step["packed"]) == {"reference_s", "actor_forward_s", "actor_backward_s"}


def test_decode_attention_times_every_option_set_and_checks_it_against_the_default(tmp_path):
    command = [sys.executable, str(ROOT / "bench/decode_attention.py"), "--batch", "8", "--live", "5",
               "--prompt-tokens", "40", "--tokens", "24", "--heads", "4", "2", "16", "--layers", "1",
               "--prompt-chunks", "16", "32", "--own-chunks", "16", "--block", "16",
               "--out", str(tmp_path / "a.json")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT / "bench")  # it imports decode.py
    assert out.returncode == 0, out.stderr[-2000:]
    cases = json.loads((tmp_path / "a.json").read_text())["cases"]
    assert [(c["batch"], c["options"]) for c in cases] == [
        (8, o) for o in ("p64/o64/w4/s3", "p16/o16/w4/s3", "p32/o16/w4/s3")
    ]  # the default first: the shape's picks (here the longest chunks) at 4 warps, 3 stages
    assert all(c["max_diff_from_default"] < 1e-2 and c["us_per_layer"] > 0 for c in cases)
    assert out.stdout.count("(default)") == 1 and "p32/o16/w4/s3" in out.stdout.split("(default)")[1]  # the table
    compiled = subprocess.run([*command[:-2], "--compile-only"], capture_output=True, text=True, cwd=ROOT / "bench")
    assert compiled.returncode == 0 and compiled.stdout == "", compiled.stderr[-2000:]  # runs each set, times none


def test_gemm_host_times_each_product_at_a_new_row_count_and_again(tmp_path):
    command = [sys.executable, str(ROOT / "bench/gemm_host.py"), "--rows", "2", "--scale", "0.01",
               "--out", str(tmp_path / "h.json")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    calls = json.loads((tmp_path / "h.json").read_text())["calls"]
    assert len(calls) == 5 * 2 * 3 and len({c["m"] for c in calls}) == 2  # shapes x row counts x products
    assert all(c["first_us"] > 0 and c["again_us"] > 0 for c in calls)
    assert len(out.stdout.splitlines()) == 1 + 5 * 3


def test_swap_tiles_times_each_products_tiles_against_its_default(tmp_path):
    command = [sys.executable, str(ROOT / "bench/swap_tiles.py"), "--rows", "5", "--layers", "1", "--scale", "0.12",
               "--block-n", "64", "32", "--splits", "1", "2", "--stages", "0", "2", "--products", "o_proj", "gate_up",
               "--out", str(tmp_path / "s.json")]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT / "bench")  # it imports decode.py
    assert out.returncode == 0, out.stderr[-2000:]
    cases = json.loads((tmp_path / "s.json").read_text())["cases"]
    shown = [(c["product"], c["tiles"]["block_n"], c["tiles"]["split_k"], c["tiles"]["num_stages"]) for c in cases]
    # 256 x 256 o_proj (fp32: 5 stages fit a 64-row tile, 6 a 32-row one): the default unsplit 64-row tiles at
    # the deepest pipeline first, then the others at it and at 2; gate_up pairs: K never split, 2 stages deepest
    assert shown == [("o_proj", 64, 1, 5), ("o_proj", 64, 1, 2), ("o_proj", 64, 2, 5), ("o_proj", 64, 2, 2),
                     ("o_proj", 32, 1, 6), ("o_proj", 32, 1, 2), ("o_proj", 32, 2, 6), ("o_proj", 32, 2, 2),
                     ("gate_up", 64, 1, 2), ("gate_up", 32, 1, 5), ("gate_up", 32, 1, 2)]  # fmt: skip
    assert [c["default"] for c in cases] == [True, *[False] * 7, True, False, False]
    # o_proj timed with the residual add and norm that read its parts; gate_up (read by a GEMM) alone
    assert [c["with_reader"] for c in cases] == [True] * 8 + [False] * 3
    assert all(c["max_diff_from_default"] < 1e-4 and c["us"] > 0 for c in cases)
    compiled = subprocess.run([*command[:-2], "--compile-only"], capture_output=True, text=True, cwd=ROOT / "bench")
    assert compiled.returncode == 0 and compiled.stdout == "", compiled.stderr[-2000:]  # runs each tile, times none


def test_op_timeline_counts_each_engines_busy_time_once_and_clips_it_to_the_span():
    spec = importlib.util.spec_from_file_location("op_timeline", ROOT / "bench/op_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    overlapping = [(0.0, 4.0), (2.0, 6.0), (8.0, 9.0), (1.0, 3.0)]
    assert module.union_s(overlapping, 0.0, 10.0) == 7.0
    assert module.union_s(overlapping, 3.0, 8.5) == 3.5
    assert module.engine("Memcpy HtoD (Pinned -> Device)", 7) == "copy host->device"
    assert module.engine("Memcpy DtoH (Device -> Pinned)", 7) == "copy device->host"
    assert module.engine("ampere_bf16_s16816gemm", 7) == "compute, stream 7"


def test_op_timeline_names_what_ends_each_idle_stretch_and_when_the_host_made_no_cuda_call():
    spec = importlib.util.spec_from_file_location("op_timeline", ROOT / "bench/op_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    us = [(0, 10_000), (50_000, 60_000), (62_000, 70_000)]  # a stream's kernels, in microseconds
    kernels = [(0, 1, "gemm"), (50_000, 2, "gather"), (62_000, 3, "norm")]
    launched = {1: -5_000, 2: 5_000, 3: 55_000, 11: 12_000}
    copies = [(49_950, 48_000, 11, "Memcpy HtoD (Pinned -> Device)")]  # (end, start, correlation, name)
    gaps = module.idle_gaps(us, 0, 100_000, "compute, stream 7", kernels, launched, copies)
    # the longest first: the gather, launched 5 ms before its stretch began, waited on its own copy, which was
    # launched 2 ms into the stretch and ran only in its last 2 ms; the norm's stretch has no copy on the stream
    assert gaps == {
        "stream": "compute, stream 7",
        "gaps": [
            [10.0, 40.0, -5.0, "gather", [38.0, 1.95, 2.0, "Memcpy HtoD (Pinned -> Device)"]],
            [60.0, 2.0, -5.0, "norm", None],
        ],
    }
    assert module.host_gaps([(0, 1_000), (500, 2_000), (10_000, 11_000)], 0) == [[2.0, 8.0]]


def test_op_timeline_profiles_the_op_it_is_asked_for(tmp_path):
    out = tmp_path / "timeline.json"
    command = [sys.executable, str(ROOT / "bench/op_timeline.py"), str(ROOT / "specs/tiny_cpu.yaml"), "--warmup",
               "0", "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["ops"]
    assert row["op"] == "actor_score.prefix" and row["host_s"] > 0


def test_the_7b_variants_set_their_keys_in_a_spec_the_loader_takes_and_summarise_a_run(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("run_variants", ROOT / "bench/run_variants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    seven = ROOT / "specs/qwen2_5_vl_7b_h200.yaml"
    monkeypatch.chdir(tmp_path)
    out = subprocess.run([sys.executable, str(ROOT / "bench/run_variants.py"), "spec", str(seven),
                          "nocudnn+joined+chunk128"], capture_output=True, text=True)  # fmt: skip
    loaded = load_spec(out.stdout.strip()).spec
    assert loaded.run.cudnn_attention is False and loaded.sharing.update_beside_prefix is False
    assert loaded.memory.optimizer_chunk_mib == 128 and loaded.memory.page_reference is True  # the rest kept
    data = module.yaml.safe_load(seven.read_text())
    assert module.variant(data, "shipped") == data and module.variant(data, "hbm") != data
    with pytest.raises(SystemExit, match="unknown variant part 'fast'"):
        module.variant({}, "hbm+fast")
    text = module.summary(ROOT / "bench/results/run_7b_h200_update_beside_metrics.jsonl", seven)
    phases, peaks, steps = text.splitlines()
    assert phases.startswith("phases, medians of steps 2-5") and "actor_prefix 2.56 s" in phases
    assert peaks.startswith("peaks GiB (measured / plan): 1: 113.3 / ") and steps.count(",") == 4


def test_op_timeline_names_the_torch_op_that_issued_each_memset():
    spec = importlib.util.spec_from_file_location("op_timeline", ROOT / "bench/op_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)

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
