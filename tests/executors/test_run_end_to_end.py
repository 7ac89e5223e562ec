"""`rollplex run` as a user runs it: the CLI trains the shipped tiny spec inside a minute with its metrics,
TensorBoard events, checkpoint and phase summary; a spec the machine cannot run is a one-line error; the main job
learns the answer form; under mps the rollout runs in its own process and the schedules still train alike;
replayed lengths end the responses at budgets drawn from the preset; on a GPU a phase's time counts the device work
its ops leave queued. Checkpoints: `test_checkpointing.py`."""

import json
import re
import time

import pytest
import torch
from run_testkit import ROOT, cli, cli_here, loaded, spec_text

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan

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
