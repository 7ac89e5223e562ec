"""`rollplex bench` on the tiny spec: the result document, the timeline, and its errors."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch

from rollplex.bench import harness as bench_module
from rollplex.bench.harness import ScheduleRun, noise_floor_grads
from rollplex.bench.provenance import source_commit
from rollplex.graph.ir import Schedule
from rollplex.graph.load import load_spec

ROOT = Path(__file__).resolve().parents[2]
KEYS = {"gpu", "model", "workload", "memory", "sharing", "run", "policy", "command", "step_s", "speedup", "per_step",
        "ideal_speedup", "overlap_speedup", "decode_slowdown", "decode_slowdown_on_device", "updates_match", "T_D_s",
        "T_P_s", "T_post_s", "phase_s", "prefix_beside_decode", "step_balance_s", "timeline_s"}  # fmt: skip


SHAPES = {
    "prompts_per_step: 8": "prompts_per_step: 2",
    "group_size: 16": "group_size: 4",
    "response_tokens: 6": "response_tokens: 16",
    "synthetic:colour@tiny": "synthetic:clevrer@tiny",
}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    """`rollplex bench` on the tiny spec with a decode long enough for the prefixes to run beside it."""
    text = (ROOT / "specs/tiny_cpu.yaml").read_text()
    for before, after in SHAPES.items():
        assert before in text
        text = text.replace(before, after)
    spec = tmp_path_factory.mktemp("spec") / "tiny.yaml"
    spec.write_text(text)

    def run(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "rollplex.cli", "bench", str(spec), *args]
        return subprocess.run(command, capture_output=True, text=True)

    run.spec = spec
    return run


@pytest.fixture
def bench_here(bench, capsys):
    """`rollplex bench` on the tiny spec in this process, for the one-line errors that stop it before any run: its
    exit code and stderr."""
    from rollplex.cli import main

    def run(*args: str) -> tuple[int, str]:
        code = main(["bench", str(bench.spec), *args])
        return code, capsys.readouterr().err

    return run


def _saving_bench(tmp_path_factory, bench, name: str, out: str, *flags: str):
    """A one-step bench with `flags` that saves its serial run (`serial.pt`) in a fresh folder: its process, and
    the folder."""
    tmp = tmp_path_factory.mktemp(name)
    saved = ("--save-serial", str(tmp / "serial.pt"), "--out", str(tmp / out))
    proc = bench("--steps", "1", "--warmup", "0", *flags, *saved)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc, tmp


@pytest.fixture(scope="module")
def saving(tmp_path_factory, bench):
    """A bench of one step that also saves its serial run. Its --out has no suffix (`tiny`): the bench names its
    result `tiny.json`, beside `tiny.png`."""
    return _saving_bench(tmp_path_factory, bench, "saving", "tiny")


@pytest.fixture(scope="module")
def serial_only(tmp_path_factory, bench):
    """A serial-only bench of one step saving its serial run, asked to write `none.json`."""
    return _saving_bench(tmp_path_factory, bench, "serial_only", "none.json", "--serial-only")


@pytest.fixture(scope="module")
def grouped(tmp_path_factory, bench):
    """A bench whose serial baseline runs all prompts in one chunk, with the noise floor, saving its serial run."""
    return _saving_bench(
        tmp_path_factory, bench, "grouped", "first.json", "--serial-prompts-per-chunk", "all", "--noise-floor"
    )


@pytest.mark.slow
def test_bench_writes_the_result_and_a_timeline_with_matching_updates(saving):
    proc, tmp = saving
    out = tmp / "tiny.json"
    result = json.loads(out.read_text())
    assert set(result) >= KEYS and set(result["step_s"]) == {"serial", "rollplex"}
    assert result["run"]["rollout_prefill"] == "auto" and result["prefills_from_actor"] is True  # as it resolved
    # the CPU decodes without the engine's kernels and scores with a dense mask
    assert result["decode_kernels"] == "plain loop" and result["scoring_attention"] == "sdpa"
    assert result["updates_match"] and result["max_param_relative_difference"] == 0.0
    assert result["first_step_rollouts_match"] and result["first_step_grad_relative_difference"] == 0.0
    assert result["commit"] == source_commit() and re.fullmatch(r"[0-9a-f]{40}(-dirty)?", result["commit"])
    t_d, t_p, t_post = result["T_D_s"], result["T_P_s"], result["T_post_s"]
    rollout = result["phase_s"]["rollplex"]["rollout"]
    assert abs(result["T_post_rollplex_s"] - (result["step_s"]["rollplex"] - rollout)) < 2e-3
    balance = result["step_balance_s"]
    assert balance["prefixes_hidden"] == -t_p and abs(balance["rollout_longer"] - (rollout - t_d)) < 2e-3
    step_difference = result["step_s"]["rollplex"] - result["step_s"]["serial"]
    assert abs(sum(balance.values()) - step_difference) < 2e-3  # the three parts are the whole difference
    assert abs(result["ideal_speedup"] - (t_d + t_p + t_post) / (max(t_d, t_p) + t_post)) < 2e-3  # Eq. 1, rounded
    at_equal_after = result["step_s"]["serial"] + balance["prefixes_hidden"] + balance["rollout_longer"]
    assert abs(result["overlap_speedup"] - result["step_s"]["serial"] / at_equal_after) < 2e-3
    assert result["prefix_beside_decode"] > 0.5
    on_device = result["per_step"]["rollplex"]["decode_slowdown_on_device"]  # the engine times steps on a GPU only
    assert len(on_device) in (0, 1) and result["decode_slowdown_on_device"] == (on_device[0] if on_device else None)
    for name in ("serial", "rollplex"):  # the medians come from the per-step record, which the JSON keeps
        steps = result["per_step"][name]
        assert len(steps["step_s"]) == len(steps["phase_s"]) == 1 and steps["step_s"][0] == result["step_s"][name]
        assert 1 <= steps["longest_response"][0] <= 16  # tiny spec: at most its response_tokens
        stalls = {"gc_s", "full_collections", "alloc_retries", "device_allocs", "triton_compiles", "torch_compiles"}
        assert set(steps["stalls"][0]) == stalls
        decode = steps["decode_s"]  # the rollout engine's own count, where it keeps one
        assert len(decode) in (0, 1) and all(0 < t <= steps["phase_s"][0]["rollout"] for t in decode)
        gap = steps["step_s"][0] - sum(steps["phase_s"][0].values())
        assert abs(result["unaccounted_s"][name] - gap) < 1e-3 and -1e-3 < gap < 0.5 * steps["step_s"][0]
        lanes = {lane for lane, _, start, end in result["timeline_s"][name] if 0 <= start <= end}
        assert lanes == {"rollout", "prefix stream", "trainer"}
    assert 0 < result["prefix_backward_s"]["serial"] < result["step_s"]["serial"]
    assert 0 < result["prefix_backward_s"]["rollplex"] < result["step_s"]["rollplex"]
    for name in ("serial", "rollplex"):  # a part of the actor's suffix + backward, bounded apart
        bound = result["prefix_backward_bound_s"][name]
        assert 0 <= bound <= result["bound_s"][name]["actor_suffix_backward"]  # the tiny model's round to 0
        expected = bound / result["prefix_backward_s"][name]
        assert result["prefix_backward_efficiency"][name] == pytest.approx(expected, rel=2e-3, abs=1e-4)
    assert result["phase_s"]["rollplex"]["ref_prefix"] == 0.0 < result["phase_s"]["serial"]["ref_prefix"]
    assert result["command"].startswith("rollplex bench ") and "--steps 1" in result["command"]
    assert out.with_suffix(".png").stat().st_size > 10_000
    assert "x (ideal" not in proc.stderr and "x (ideal" in proc.stdout  # the summary on stdout (a note may say more)


@pytest.mark.slow
def test_bench_names_its_result_json_when_out_has_no_suffix(saving):
    proc, tmp = saving
    assert proc.args[proc.args.index("--out") + 1] == str(tmp / "tiny")
    assert (tmp / "tiny.json").exists() and (tmp / "tiny.png").exists()


def test_bench_with_no_steps_is_a_one_line_error(tmp_path, bench_here):
    code, err = bench_here("--steps", "0", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "--steps" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_bench_with_unsplit_adds_textbook_grpo_beside_the_two_schedules(tmp_path, bench):
    out = tmp_path / "tiny.json"
    proc = bench("--steps", "1", "--warmup", "0", "--unsplit", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["step_s"]) == {"serial", "rollplex", "unsplit"}
    s = result["step_s"]
    assert abs(result["speedup_vs_unsplit"] - s["unsplit"] / s["rollplex"]) < 2e-3  # from unrounded medians
    assert result["unsplit_max_param_relative_difference"] < 1e-2  # another summation order, the same update
    assert result["unsplit_first_step_rollouts_match"] is True
    assert result["unsplit_first_step_grad_relative_difference"] < 1e-4


@pytest.mark.slow
def test_bench_runs_rollplex_once_per_policy_against_one_serial_run(tmp_path, bench):
    out = tmp_path / "tiny.json"
    policies = ("inline", "green:adaptive", "mps")
    proc = bench("--steps", "1", "--warmup", "0", "--policies", *policies, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    # one serial run per rollout engine: in process, and mps's own process
    assert proc.stderr.count("rollplex bench: serial") == 2 and proc.stderr.count("rollplex bench: rollplex") == 3
    results = [json.loads((tmp_path / f"tiny_{name}.json").read_text()) for name in ("inline", "greenadaptive", "mps")]
    assert results[0]["step_s"]["serial"] == results[1]["step_s"]["serial"]  # the same serial run
    for r in results:
        assert r["updates_match"] and set(r["plan_peak_gib"]) == {"serial", "rollplex"}
        assert set(r["plan_peak_gib"]["rollplex"]) == {"1", "2", "3"}
        assert r["peak_gib"] == {"serial": {}, "rollplex": {}}  # measured on a GPU only
    assert not out.exists() and (tmp_path / "tiny_greenadaptive.png").exists()


def test_bench_with_an_unknown_policy_is_a_one_line_error(tmp_path, bench_here):
    code, err = bench_here("--policies", "green:many", "--out", str(tmp_path / "x.json"))
    assert code == 2 and "green:many" in err and "Traceback" not in err


def test_a_schedule_is_built_only_after_the_last_ones_engines_are_gone(monkeypatch):
    """Two schedules' pinned host pools at once OOM-killed a 3B bench on a 128 GiB host."""
    built: list[weakref.ref] = []
    alive_at_build: list[bool] = []

    def build(loaded, **kw):
        alive_at_build.append(any(r() is not None for r in built))
        engines = real(loaded, **kw)
        built.append(weakref.ref(engines))
        loop = [engines]  # a reference cycle through the engines, as a GPU run's have (CUDA graphs, pools, closures)
        loop.append(loop)
        return engines

    real = bench_module.build_engines
    monkeypatch.setattr(bench_module, "build_engines", build)
    loaded = load_spec(ROOT / "specs/tiny_cpu.yaml")
    gc.disable()  # a long GPU run's engines reach the oldest generation, which automatic collection seldom visits
    try:
        for schedule in (Schedule.SERIAL, Schedule.ROLLPLEX):
            bench_module.run_schedule(loaded, schedule, steps=1, warmup=0)
    finally:
        gc.enable()
    assert alive_at_build == [False, False] and len(built) == 2


@pytest.mark.slow
def test_the_serial_baseline_may_group_its_prefixes_otherwise_and_the_json_says_how(grouped):
    _, tmp = grouped
    result = json.loads((tmp / "first.json").read_text())
    assert result["prompts_per_chunk"] == {"serial": "all", "rollplex": 1}
    assert result["first_step_rollouts_match"] and result["updates_match"]


def test_a_bad_serial_grouping_is_one_line_and_exit_2_before_any_run(bench_here):
    code, err = bench_here("--serial-prompts-per-chunk", "0")
    assert code == 2 and "--serial-prompts-per-chunk" in err and len(err.splitlines()) == 1
    assert "rollplex bench:" not in err


@pytest.mark.slow
def test_a_saved_unsplit_run_joins_a_later_bench_of_the_same_spec_with_its_phases_and_peaks(tmp_path, bench):
    saved = tmp_path / "unsplit.pt"
    proc = bench("--steps", "1", "--warmup", "0", "--save-unsplit", str(saved), "--out", str(tmp_path / "none.json"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert saved.is_file() and not (tmp_path / "none.json").exists()
    assert "rollplex bench: serial" not in proc.stderr and "rollplex bench: rollplex" not in proc.stderr
    out = tmp_path / "later.json"
    proc = bench("--steps", "1", "--warmup", "0", "--unsplit-from", str(saved), "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "unsplit from" in proc.stderr and "rollplex bench: unsplit," not in proc.stderr
    result = json.loads(out.read_text())
    assert result["unsplit_from"] == str(saved)
    assert set(result["step_s"]) == {"serial", "rollplex", "unsplit"}
    for key in ("phase_s", "bound_s", "efficiency", "per_step", "peak_gib", "plan_peak_gib"):
        assert set(result[key]) == {"serial", "rollplex", "unsplit"}, key
    assert not result["phase_s"]["unsplit"].get("ref_prefix") and result["phase_s"]["unsplit"]["ref_suffix"] > 0
    assert result["unsplit_max_param_relative_difference"] is None  # final weights are not saved
    assert result["unsplit_first_step_rollouts_match"] is True  # the saved run keeps its first rollout
    assert result["unsplit_first_step_grad_relative_difference"] < 1e-4  # the same examples, the same update


def test_a_saved_run_stands_in_only_for_its_own_schedule_and_step_counts(tmp_path):
    from rollplex.bench.baseline import baseline_key, load_baseline, save_baseline

    loaded = load_spec(ROOT / "specs/tiny_cpu.yaml")
    unsplit = baseline_key(loaded, 1, 0, Schedule.UNSPLIT)
    assert len({unsplit, baseline_key(loaded, 1, 0), baseline_key(loaded, 2, 0, Schedule.UNSPLIT)}) == 3
    save_baseline(tmp_path / "u.pt", ScheduleRun(step_s=[2.5]), unsplit, "rollplex bench ... --save-unsplit u.pt")
    assert load_baseline(tmp_path / "u.pt", unsplit)[0].step_s == [2.5]
    with pytest.raises(ValueError, match="another schedule, spec, grouping or step count"):
        load_baseline(tmp_path / "u.pt", baseline_key(loaded, 1, 0))  # a serial bench of the same spec


@pytest.mark.parametrize(
    "flags",
    [
        ["--save-unsplit", "u.pt", "--unsplit"],
        ["--save-unsplit", "u.pt", "--serial-from", "s.pt"],
        ["--save-unsplit", "u.pt", "--policies", "inline", "streams"],
        ["--unsplit-from", "missing.pt"],
        ["--unsplit-from", "u.pt", "--unsplit"],
        ["--save-unsplit", "u.pt", "--noise-floor"],
        ["--unsplit-from", "u.pt", "--serial-only", "--save-serial", "s.pt"],
        ["--unsplit-from", "u.pt", "--policies", "inline", "mps"],
    ],
)
def test_an_unsplit_flag_that_cannot_hold_is_one_line_and_exit_2(tmp_path, capsys, flags):
    from rollplex.cli import main

    (tmp_path / "u.pt").write_bytes(b"")
    (tmp_path / "s.pt").write_bytes(b"")
    paths = [str(tmp_path / f) if f.endswith(".pt") else f for f in flags]
    assert main(["bench", str(ROOT / "specs/tiny_cpu.yaml"), *paths]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "unsplit" in err and "rollplex bench:" not in err


@pytest.mark.slow
def test_a_saved_serial_run_stands_in_for_serial_in_a_later_bench_of_the_same_spec(tmp_path, bench, saving):
    first, later, baseline = saving[1] / "tiny.json", tmp_path / "later.json", saving[1] / "serial.pt"
    proc = bench("--steps", "1", "--warmup", "0", "--serial-from", str(baseline), "--policies", "inline",
                 "--out", str(later))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    a, b = json.loads(first.read_text()), json.loads(later.read_text())
    assert a["serial_from"] is None and b["serial_from"] == str(baseline)
    assert a["after_another_schedule_in_process"] and not b["after_another_schedule_in_process"]
    assert b["step_s"]["serial"] == a["step_s"]["serial"] and b["phase_s"]["serial"] == a["phase_s"]["serial"]
    assert b["updates_match"] and b["first_step_grad_relative_difference"] == 0.0
    assert b["max_param_relative_difference"] is None  # final weights are not saved
    assert "serial from" in proc.stderr and "rollplex bench: serial," not in proc.stderr


@pytest.mark.slow
def test_serial_only_saves_serial_and_times_no_rollplex_and_the_later_bench_runs_rollplex_first(
    tmp_path, bench, serial_only
):
    proc, saved = serial_only
    assert (saved / "serial.pt").is_file() and not (saved / "none.json").exists()
    assert "rollplex bench: rollplex" not in proc.stderr
    # the later bench from this file: test_a_second_policy_timed_in_the_same_process_is_flagged_as_following_another


@pytest.mark.slow
def test_serial_only_without_a_file_to_save_to_is_one_line_and_exit_2(tmp_path, bench_here):
    for flags in (["--serial-only"], ["--serial-only", "--save-serial", "a.pt", "--serial-from", "missing.pt"]):
        code, err = bench_here(*flags)
        assert code == 2 and "--serial-only" in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_a_second_policy_timed_in_the_same_process_is_flagged_as_following_another(tmp_path, bench, serial_only):
    baseline = serial_only[1] / "serial.pt"
    out = tmp_path / "p.json"
    proc = bench("--steps", "1", "--warmup", "0", "--serial-from", str(baseline), "--policies", "inline", "streams",
                 "--out", str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    first, second = (json.loads((tmp_path / f"p_{p}.json").read_text()) for p in ("inline", "streams"))
    assert not first["after_another_schedule_in_process"] and second["after_another_schedule_in_process"]
    noted = 1 if torch.cuda.is_available() else 0  # the shapes a GPU caches (cuDNN's plans): none on the CPU
    assert proc.stderr.count("an earlier schedule ran in this process") == noted


@pytest.mark.slow
def test_a_saved_serial_run_of_another_step_count_is_refused_in_one_line(tmp_path, bench_here, serial_only):
    baseline = serial_only[1] / "serial.pt"  # of one step
    code, err = bench_here(
        "--steps", "2", "--warmup", "0", "--serial-from", str(baseline), "--out", str(tmp_path / "b.json")
    )
    assert code == 2 and "another schedule, spec, grouping or step count" in err
    assert len(err.strip().splitlines()) == 1
    code, err = bench_here("--serial-from", str(tmp_path / "missing.pt"))
    assert code == 2 and "no such file" in err


def test_a_noise_floor_run_that_sampled_other_tokens_gives_no_floor():
    tokens, lens = torch.arange(12).view(1, 3, 4), torch.tensor([[4, 2, 3]])
    serial = ScheduleRun(first_rollout=(tokens, lens), first_grads=torch.ones(3))
    same = ScheduleRun(first_rollout=(tokens.clone(), lens.clone()), first_grads=torch.full((3,), 2.0))
    other = ScheduleRun(first_rollout=(tokens + 1, lens), first_grads=torch.full((3,), 2.0))
    assert torch.equal(noise_floor_grads(serial, same), same.first_grads)
    assert noise_floor_grads(serial, other) is None


@pytest.mark.slow
def test_bench_measures_the_noise_floor_and_a_saved_serial_run_carries_it(tmp_path, bench, grouped, saving):
    proc, saved = grouped
    first, later, baseline = saved / "first.json", tmp_path / "later.json", saved / "serial.pt"
    assert "serial's first step, 1 prompts per chunk as rollplex (noise floor)" in proc.stderr
    a = json.loads(first.read_text())
    # serial grouped all prompts, its rerun one per chunk as rollplex: FP32 rounding apart at most
    assert 0.0 <= a["grad_noise_floor"] < 1e-4 and a["updates_match"]
    later_args = ("--steps", "1", "--warmup", "0", "--serial-prompts-per-chunk", "all", "--serial-from", str(baseline),
                  "--policies", "inline", "--out", str(later))  # fmt: skip
    proc = bench(*later_args, "--noise-floor")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(later.read_text())["grad_noise_floor"] == a["grad_noise_floor"]
    proc = bench(*later_args)  # a saved floor counts only when asked for
    assert proc.returncode == 0 and json.loads(later.read_text())["grad_noise_floor"] is None
    plain = saving[1] / "tiny.json"  # a bench not asked for the floor
    assert json.loads(plain.read_text())["grad_noise_floor"] is None


def test_the_op_clock_times_an_op_until_the_device_is_done_and_counts_ops_beside_another_once(monkeypatch):
    from rollplex.graph.ir import NodeKind, Op, Part, Role

    now = [0.0]
    synced = []
    monkeypatch.setattr(bench_module.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(bench_module, "_sync", lambda device: synced.append(now[0]))
    decode = Op("rollout", NodeKind.DECODE, Role.ROLLOUT, (), ())
    prefix = Op("ref_score.prefix", NodeKind.FORWARD, Role.REFERENCE, (), (), part=Part.PREFIX)
    suffix = Op("ref_score.suffix", NodeKind.FORWARD, Role.REFERENCE, (), (), part=Part.SUFFIX)
    clock = bench_module._OpClock(torch.device("cpu"))
    clock.before(decode)
    clock.before(prefix)  # beside decode: rollplex's Phase 1
    now[0] = 10.0
    clock.after(decode)
    clock.after(prefix)
    clock.before(suffix)
    now[0] = 11.0  # the host launched its last kernel here (the runtime's own time stops)...
    monkeypatch.setattr(bench_module, "_sync", lambda device: now.__setitem__(0, 12.5))  # ...the GPU finished here
    clock.after(suffix)
    assert clock.times == {"rollout": 10.0, "ref_suffix": 2.5}  # the prefix beside decode is not counted again
    assert [label for _, label, _, _ in clock.spans] == ["rollout", "ref_score.prefix", "ref_score.suffix"]
