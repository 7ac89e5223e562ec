"""`rollplex run` at training TP 2 (two gloo processes under torchrun, rollout TP 1 bound over both shards)
against the same spec in one process: same losses and rewards, same weights within float32 rounding; and
the one-line error when the process count does not match parallel.train_tp."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent

SPEC = """
model: tiny
cluster: {{gpus_per_node: {tp}, hbm_gib: 16, host_gib: 8}}
parallel: {{train_tp: {tp}, rollout_tp: 1, qkv_sharing: {qkv}, split_rollout: {split}, sequence_parallel: {sp}}}
workload: {{prompts_per_step: 2, group_size: 3, prompt_tokens: 384, response_tokens: 6, visual_tokens: 18,
            dataset: "synthetic:clevrer@tiny"}}
algorithm: {{kl_coef: 0.1, lr: 1.0e-2, max_grad_norm: 0.5, rewards: [{{name: "run_rewards:char_share"}}]}}
run: {{seed: 3, dtype: float32, device: {device}}}
"""


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def _rollplex(
    tmp: Path,
    tp: int,
    qkv: str,
    name: str,
    *args: str,
    launch: bool = True,
    device: str = "cpu",
    split: bool = False,
    sp: bool = False,
) -> subprocess.CompletedProcess:
    """Without `split`, both rollout replicas sample every prompt, as the one-process run does. `sp`: sequence
    parallelism."""
    spec = tmp / f"{name}.yaml"
    spec.write_text(SPEC.format(tp=tp, qkv=qkv, device=device, split=str(split).lower(), sp=str(sp).lower()))
    return _launch(tp if launch else 1, "run", str(spec), "--out", str(tmp / name), "--quiet", *args)


def _launch(tp: int, *rollplex_args: str) -> subprocess.CompletedProcess:
    cli = ["-m", "rollplex", *rollplex_args]
    if tp > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cli = ["-m", "torch.distributed.run", "--nproc-per-node", str(tp), "--master-port", str(port), *cli]
    return subprocess.run([sys.executable, *cli], env=_env(), capture_output=True, text=True, timeout=600)


def _metrics(tmp: Path, name: str) -> list[dict]:
    return [json.loads(line) for line in (tmp / name / "metrics.jsonl").read_text().splitlines()]


def _weights(tmp: Path, name: str, step: int) -> dict[str, torch.Tensor]:
    return load_file(tmp / name / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The spec run in one process (train TP 1) for 2 steps, once per device: the folder holding it as "one". At TP 1
    `qkv_sharing` changes only the plan's accounting, so the TP-2 runs of either path compare with this one run."""
    runs: dict[str, Path] = {}

    def run(device: str) -> Path:
        if device not in runs:
            tmp = tmp_path_factory.mktemp(f"one_{device}")
            one = _rollplex(tmp, 1, "in_place", "one", "--steps", "2", device=device)
            assert one.returncode == 0, one.stderr
            runs[device] = tmp
        return runs[device]

    return run


@pytest.mark.parametrize(
    ("qkv", "device", "sp"),
    [
        ("in_place", "cpu", False),
        ("copy", "cpu", False),
        ("in_place", "cpu", True),
        pytest.param(
            "in_place",
            "cuda",
            True,
            marks=[pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="2 GPUs")],
        ),
    ],
)
@pytest.mark.slow
def test_a_tp2_run_trains_like_the_one_process_run(tmp_path, one_process, qkv, device, sp):
    one = one_process(device)
    two = _rollplex(tmp_path, 2, qkv, "two", "--steps", "2", device=device, sp=sp)
    assert two.returncode == 0, two.stderr[-3000:]
    a, b = _metrics(one, "one"), _metrics(tmp_path, "two")
    assert len(a) == len(b) == 2
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == pytest.approx(y["reward_mean"], abs=1e-6)  # the same responses were sampled
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert x[key] == pytest.approx(y[key], rel=1e-4, abs=1e-6), key
    wa, wb = _weights(one, "one", 2), _weights(tmp_path, "two", 2)
    assert wa.keys() == wb.keys()
    # AdamW divides each gradient by its own running magnitude, so float rounding (TP sums partial products in
    # another order) on near-zero gradients moves a few elements by a fraction of a step (lr = 1e-2)
    diff = torch.cat([(wb[n] - wa[n]).abs().flatten() for n in wa])
    assert diff.max() < 1e-3 and (diff > 1e-5).float().mean() < 1e-3, (diff.max(), (diff > 1e-5).sum())
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints" / "step-000002").iterdir()) == [
        "files.json", "model", "optimizer-rank0", "optimizer-rank1", "rng.pt", "state.json",
    ]  # fmt: skip


@pytest.mark.slow
def test_a_resumed_tp2_run_with_replicas_sharing_the_prompts_continues_where_it_stopped(tmp_path):
    whole = _rollplex(tmp_path, 2, "in_place", "whole", "--steps", "2", split=True)
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = _rollplex(tmp_path, 2, "in_place", "parts", "--steps", "1", split=True)
    assert first.returncode == 0, first.stderr[-3000:]
    rest = _rollplex(tmp_path, 2, "in_place", "parts", "--steps", "2", "--resume", split=True)
    assert rest.returncode == 0, rest.stderr[-3000:]
    wa, wb = _weights(tmp_path, "whole", 2), _weights(tmp_path, "parts", 2)
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


def test_a_tp2_spec_launched_as_one_process_is_a_one_line_error(tmp_path, capsys, monkeypatch):
    from rollplex.cli import main

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a launcher's one process (without one, `rollplex run` starts both)
    monkeypatch.syspath_prepend(str(HERE))  # the spec's reward module
    spec = tmp_path / "alone.yaml"
    spec.write_text(SPEC.format(tp=2, qkv="in_place", device="cpu", split="false", sp="false"))
    code, err = main(["run", str(spec), "--out", str(tmp_path / "alone"), "--quiet"]), capsys.readouterr().err
    assert code == 2
    assert err.strip().count("\n") == 0, err
    assert "cluster.gpus_per_node" in err and "use rollplex run" in err


@pytest.mark.slow
def test_rollplex_bench_under_torchrun_compares_the_schedules_on_every_rank(tmp_path):
    spec = tmp_path / "bench.yaml"
    spec.write_text(SPEC.format(tp=2, qkv="in_place", device="cpu", split="true", sp="false"))
    out = tmp_path / "bench.json"
    done = _launch(2, "bench", str(spec), "--steps", "1", "--warmup", "0", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["updates_match"] and result["max_param_relative_difference"] == 0.0  # CPU: bitwise
    assert out.with_suffix(".png").is_file() and done.stdout.count("step serial") == 1  # rank 0 alone reports
