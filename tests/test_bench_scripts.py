"""The GPU measurement scripts under bench/ run end to end on the tiny spec (on the CPU: times only)."""

from __future__ import annotations

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
        ("host_stalls", ["--cases", "memset", "bogus"], "unknown cases ['bogus']"),
        ("host_stalls", ["--cases", "sdpa_new"], "needs a CUDA GPU"),
        ("module_times", ["specs/tiny_cpu.yaml", "--gc", "python", "bogus"], "unknown --gc variants ['bogus']"),
        ("token_scores", ["--model", "9b"], "no model '9b'"),
        ("token_scores", ["--tokens", "64"], "needs a CUDA GPU"),
    ],
)
def test_gpu_benches_refuse_bad_arguments_and_a_machine_without_a_gpu_in_one_line(
    tmp_path, monkeypatch, capsys, script, args, message
):
    import runpy

    if torch.cuda.is_available() and message == "needs a CUDA GPU":
        pytest.skip("checks the refusal on a machine without a GPU")
    path = ROOT / f"bench/{script}.py"
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(path.parent))  # as `python bench/X.py` puts its folder first
    monkeypatch.setattr(sys, "argv", [str(path), *args, "--out", str(tmp_path / "out.json")])
    with pytest.raises(SystemExit) as exited:  # sys.exit("message"): Python prints it and exits 1
        runpy.run_path(str(path), run_name="__main__")
    said = exited.value.code
    assert isinstance(said, str) and message in said and len(said.strip().splitlines()) == 1
    assert capsys.readouterr().err == ""
    assert not (tmp_path / "out.json").exists()


@pytest.mark.slow
def test_startup_times_names_each_stage_of_a_run_and_each_step(tmp_path):
    command = [sys.executable, str(ROOT / "bench/startup_times.py"), "run", str(ROOT / "specs/tiny_cpu.yaml"),
               "--steps", "2", "--quiet", "--no-checkpoints", "--out", str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    stages = [line.split()[1] for line in done.stderr.splitlines() if line.startswith("[startup] ")]
    assert {"_initial_model", "make_optimizer", "build_engines", "open_dataset"} <= set(stages)
    assert stages.count("run_iteration") == 2 and stages.index("build_engines") < stages.index("run_iteration")


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


def test_op_timeline_profiles_the_op_it_is_asked_for(tmp_path):
    out = tmp_path / "timeline.json"
    command = [sys.executable, str(ROOT / "bench/op_timeline.py"), str(ROOT / "specs/tiny_cpu.yaml"), "--warmup",
               "0", "--out", str(out)]  # fmt: skip
    run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["ops"]
    assert row["op"] == "actor_score.prefix" and row["host_s"] > 0


def test_prompt_attention_times_both_forms_and_refuses_lengths_with_nothing_padded(tmp_path):
    script, out = str(ROOT / "bench/prompt_attention.py"), tmp_path / "attention.json"
    command = [sys.executable, script, "--model", "tiny", "--lens", "40", "21", "6", "--iters", "1", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    for form in ("per_prompt", "padded", "bound"):
        assert result[form]["forward_ms"] > 0 and result[form]["forward_backward_ms"] > result[form]["forward_ms"]
    assert result["useful"] == (40 * 40 + 21 * 21 + 6 * 6) / (3 * 40 * 40) and result["lens"] == [40, 21, 6]
    refused = subprocess.run([sys.executable, script, "--lens", "7", "7"], capture_output=True, text=True, cwd=ROOT)
    assert (
        refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1 and "not all equal" in refused.stderr
    )
    shipped = subprocess.run(
        [sys.executable, script, "--lens", "9", "5", "--iters", "1"], capture_output=True, text=True, cwd=ROOT
    )
    assert shipped.returncode == 0, shipped.stderr[-2000:]  # the default model, named as the benches name it (3b)


def test_grid_sync_checks_every_phase_of_each_way_and_refuses_bad_phase_counts(tmp_path):
    script, out = str(ROOT / "bench/grid_sync.py"), tmp_path / "sync.json"
    command = [sys.executable, script, "--ways", "plain", "barrier", "--phases", "2", "5", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["programs"] == 1 and result["phases"] == [2, 5] and set(result["ways"]) == {"plain", "barrier"}
    for row in result["ways"].values():
        assert set(row["seconds"]) == {"2", "5"} and all(s > 0 for s in row["seconds"].values())
    for bad in (["--phases", "5", "2"], ["--ways", "pdl"]):
        refused = subprocess.run([sys.executable, script, *bad], capture_output=True, text=True, cwd=ROOT)
        assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr


def test_persistent_mlp_matches_the_fused_chain_and_refuses_bad_arguments(tmp_path):
    script, out = str(ROOT / "bench/persistent_mlp.py"), tmp_path / "mlp.json"
    command = [sys.executable, script, "--model", "tiny", "--batch", "3", "--layers", "2", "--per-sm", "1"]
    done = subprocess.run([*command, "--replays", "1", "--out", str(out)], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["chain_s"] > 0 and result["layers"] == 2 and result["batch"] == 3
    (row,) = result["persistent"].values()
    assert row["s"] > 0 and row["parts_diff"] <= 1e-5 and row["residual_diff"] <= 1e-5
    refused = subprocess.run([sys.executable, script, "--batch", "65"], capture_output=True, text=True, cwd=ROOT)
    assert refused.returncode == 1 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
