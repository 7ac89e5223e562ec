"""`rollplex compile`: the dry-run tables, JSON keys, plot and plan file; fast enough to be interactive."""

import json
import subprocess
import sys
import time
from pathlib import Path

from rollplex.cli import main
from rollplex.graph.planfile import PLAN_VERSION

SPECS = Path(__file__).resolve().parents[1] / "specs"
PAPER = str(SPECS / "qwen2_5_vl_32b_h800.yaml")


def test_dry_run_prints_graph_memory_peak_and_sharing_tables(capsys):
    assert main(["compile", PAPER, "--dry-run", "--naive"]) == 0
    out = capsys.readouterr().out
    for heading in (
        "Graph by phase and executor",
        "Memory per GPU by phase and role",
        "Peak vs capacity",
        "Actor weight sharing",
        "Naive colocation",
        "plan FITS",
    ):
        assert heading in out
    assert "Case 1: 19.68 B (60.1 %)" in out


def test_json_has_the_documented_keys(capsys):
    assert main(["compile", PAPER, "--dry-run", "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert isinstance(d["naive"]["total_gib"], float)
    assert {"role", "component", "gib"} <= set(d["naive"]["rows"][0])
    assert {"name", "peak_gib", "objects"} <= set(d["plan"]["phases"][0])
    backward = d["plan"]["phases"][1]["objects"]  # the split backward's turns: the microbatch's, the prefix layer's
    turns = {o["component"]: o["turn"] for o in backward if o["role"] == "actor" and o["turn"]}
    assert turns["activations (one microbatch)"] == "suffix" and turns["prefix, one layer in flight"] == "prefix"
    assert d["plan"]["peak_gib"] == max(p["peak_gib"] for p in d["plan"]["phases"])
    assert d["fits"] is True and d["capacity_gib"] == 79.6
    assert set(d["sharing"]["case_params"]) == {"1", "2", "3"} and set(d["sharing"]["case_percent"]) == {"1", "2", "3"}
    assert d["sharing"]["case3_buffer_gib"] > 0
    assert d["optimizer"]["chunk_bytes"] > 0 and d["optimizer"]["num_chunks"] > 0
    assert d["host"]["pinned_gib"] > 0


def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "memory.png"
    assert main(["compile", PAPER, "--dry-run", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_dry_run_the_plan_is_written_for_run(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["compile", str(SPECS / "tiny_cpu.yaml"), "-o", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["schedule"] == "rollplex" and plan["steps"] and plan["rollplex_plan_version"] == PLAN_VERSION


def test_an_output_path_without_its_folder_is_one_line_before_the_work(tmp_path, capsys):
    tiny = str(SPECS / "tiny_cpu.yaml")
    for args in (["-o", str(tmp_path / "no/plan.json")], ["--dry-run", "--plot", str(tmp_path / "no/m.png")]):
        assert main(["compile", tiny, *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"the folder {tmp_path / 'no'} does not exist" in err
    (tmp_path / "file").write_text("")
    assert main(["run", tiny, "--out", str(tmp_path / "file/run")]) == 2  # a folder under a file: never made
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--out" in err and "give a directory this user can write" in err


def test_a_float32_spec_is_told_the_plan_prices_bf16(capsys):
    assert main(["compile", str(SPECS / "tiny_cpu.yaml"), "--dry-run"]) == 0
    assert "run.dtype float32: the plan prices weights and activations in BF16" in capsys.readouterr().out
    assert main(["compile", PAPER, "--dry-run"]) == 0
    assert "run.dtype" not in capsys.readouterr().out


def test_dry_run_flags_without_dry_run_and_a_plan_given_to_compile_are_one_line(tmp_path, capsys):
    tiny = str(SPECS / "tiny_cpu.yaml")
    dry_only = (["--naive"], "--naive shapes"), (["--format", "json"], "--format json shapes")
    for flags, says in (*dry_only, (["--efficiency", "rollout=0.5"], "--efficiency shapes")):
        assert main(["compile", tiny, *flags]) == 2
        assert says in capsys.readouterr().err
    for flags, says in ((["--dry-run", "-o", "x.json"], "-o x.json with --dry-run"), (["--dry-run", "--plot",
                        str(tmp_path / "m.txt")], "no image format matplotlib writes")):  # fmt: skip
        assert main(["compile", tiny, *flags]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and says in err and not (tmp_path / "m.txt").exists()
    assert main(["compile", tiny, "-o", str(tmp_path / "plan.json")]) == 0
    assert main(["compile", str(tmp_path / "plan.json"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is a plan written by `rollplex compile`, not a spec" in err


def test_a_dry_run_process_finishes_in_under_1_5_seconds_without_importing_torch():
    code = (
        f"import sys; sys.argv = ['rollplex', 'compile', {PAPER!r}, '--dry-run'];"
        "import rollplex.cli as c; rc = c.main(sys.argv[1:]); assert 'torch' not in sys.modules; sys.exit(rc)"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 1.5, f"{elapsed:.2f} s"


def test_the_dry_run_says_how_many_processes_to_launch_and_which_ranks_form_each_group(capsys):
    assert main(["compile", str(SPECS / "qwen2_5_vl_32b_h800x4.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "processes: 32 (4 node(s) x 8); launch: torchrun --nnodes 4 --nproc-per-node 8 --node-rank R" in out
    assert "TP groups: [0,1,2,3,4,5,6,7] [8,9,10,11,12,13,14,15]" in out
    assert "DP groups: [0,8,16,24] [1,9,17,25]" in out and "rollout replicas: [0,2,4,6] [1,3,5,7]" in out
    refused = out.split("rollplex run refuses, as the spec stands: ")[1].splitlines()[0]
    assert refused.startswith("parallel.split_rollout (true reseeds each rollout replica")
    assert main(["compile", str(SPECS / "tiny_cpu_dp2.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "launch: rollplex run" in out and "DP groups: [0,1]" in out
    assert "TP groups" not in out and "refuses" not in out


def test_the_dry_run_says_where_the_rollouts_prefill_comes_from_and_why(capsys):
    assert main(["compile", str(SPECS / "qwen2_5_vl_3b_h200.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "rollout: decodes from the actor prefix's boundary, no prefill (run.rollout_prefill auto); " in out
    assert "decode kernels auto (rollplex_fused on Hopper or newer, else cublas)" in out
    assert (
        "scoring attention on a GPU: auto (cuDNN's ragged calls where cudnn-frontend is installed, else FlexAttention)"
        in out
    )
    assert main(["compile", str(SPECS / "qwen2_5_vl_3b_h200.yaml"), "--dry-run", "--schedule", "serial"]) == 0
    assert "rollout: decodes from the actor prefix's boundary" in capsys.readouterr().out
    assert main(["compile", str(SPECS / "tiny_cpu_dp2.yaml"), "--dry-run"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rollout: "))
    assert line.startswith("rollout: the engine prefills (run.rollout_prefill auto: actor_prefix needs one GPU")


def test_the_dry_run_names_the_other_residency_that_also_fits_and_is_faster_by_the_bound(capsys, tmp_path):
    """The 7B spec's pool holds its streamed FP32 state or the prefix's saved tensors: sending the tensors to the
    host frees HBM for more of the state, whose traffic is exposed in the update (the prefix's hides under its
    compute). Forced into HBM, the dry-run names the host; under auto the plan is the host one and the dry-run
    says why; on the 3B spec everything is in HBM already: what it names is the recompute it forces, full, beside the
    settings that rerun less."""
    efficiency = str(SPECS.parent / "bench/results/qwen2_5_vl_3b_h200_green66.json")
    seven = (SPECS / "qwen2_5_vl_7b_h200.yaml").read_text()
    forced = tmp_path / "seven_hbm.yaml"
    forced.write_text(seven.replace("memory:\n", "memory:\n  prefix_saved: hbm\n"))
    assert main(["compile", str(forced), "--dry-run", "--efficiency", efficiency]) == 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("also fits")]
    assert "set memory.prefix_saved: host and memory.layers_kept: 0 (step bound" in line and "predicted" in line
    assert main(["compile", str(SPECS / "qwen2_5_vl_7b_h200.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "also fits" not in out and "memory.prefix_saved auto: host, the HBM they leave" in out
    assert main(["compile", str(SPECS / "qwen2_5_vl_3b_h200.yaml"), "--dry-run"]) == 0
    found = [x for x in capsys.readouterr().out.splitlines() if x.startswith("also fits")]
    assert found and all("set memory.recompute: " in x for x in found), found


def test_a_flags_error_names_no_spec_and_the_launch_line_quotes_the_specs_path(tmp_path, capsys):
    assert main(["run", str(SPECS / "tiny_cpu.yaml"), "--steps", "-3"]) == 2
    assert capsys.readouterr().err.strip() == "rollplex: --steps -3; use --steps 1 or more"
    spaced = tmp_path / "my spec.yaml"
    spaced.write_text((SPECS / "tiny_cpu.yaml").read_text())
    assert main(["compile", str(spaced), "--dry-run"]) == 0
    assert f"launch: rollplex run '{spaced}'" in capsys.readouterr().out


def test_the_dry_run_names_the_files_a_run_would_refuse_for_their_absence(tmp_path, capsys):
    text = (SPECS / "tiny_cpu.yaml").read_text().replace("synthetic:colour@tiny", "missing.jsonl")
    (tmp_path / "spec.yaml").write_text(text.replace("dtype: float32", "dtype: float32, init: checkpoint"))
    assert main(["compile", str(tmp_path / "spec.yaml"), "--dry-run"]) == 0  # it plans; `run` refuses
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rollplex run refuses"))
    assert "run.init (checkpoint: " in line and "set run.init: random" in line
    assert "workload.dataset (dataset 'missing.jsonl' is neither" in line


def test_the_dry_run_names_a_reward_module_a_run_could_not_import_without_importing_any(tmp_path, capsys):
    rewards = "rewards: [{name: answer_format}, {name: accuracy}]"
    text = (SPECS / "tiny_cpu.yaml").read_text()
    assert rewards in text
    listed = '[{name: "nomod.sub:f"}, {name: "json:loads"}, {name: "rollplex_absent_pkg:f"}]'
    (tmp_path / "spec.yaml").write_text(text.replace(rewards, f"rewards: {listed}"))
    assert main(["compile", str(tmp_path / "spec.yaml"), "--dry-run"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("rollplex run refuses"))
    assert "reward 'nomod.sub:f': cannot import module 'nomod.sub' (no module named 'nomod')" in line
    assert "rollplex_absent_pkg" in line and "json" not in line
