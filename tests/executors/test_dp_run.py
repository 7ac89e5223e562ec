"""`rollplex run` on two data-parallel processes (gloo, train TP 1) against the same spec in one process: each
rank takes half the step's prompt groups, and the run gives the one-process run's rollouts, losses and weights
within float32 rounding and its held-out evaluations, also as two replicas of a tensor-parallel pair (4
processes), as two nodes over loopback resumed half-way, and with the optimizer state sharded over the ranks
(ZeRO-1) resumed from its shares, and started by `rollplex run` itself; a launch that does not match the cluster
is one line."""

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

ROOT = Path(__file__).resolve().parents[2]
DP2 = ROOT / "specs/tiny_cpu_dp2.yaml"


def launch(processes: int, spec: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    cli = ["-m", "rollplex", "run", str(spec), "--out", str(out), "--quiet", *args]
    if processes > 1:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        cli = ["-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--master-port", str(port), *cli]
    return subprocess.run([sys.executable, *cli], env=env, capture_output=True, text=True, timeout=600)


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


EVALUATION = "evaluation: {every: 1, prompts: 16}\n"  # after each step, two batches of a step's 8 prompts


def evaluations(out: Path) -> list[dict]:
    """The run's held-out evaluations but their seconds."""
    lines = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k != "time_s"} for line in lines]


def weights(out: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(out / "checkpoints" / f"step-{step:06d}" / "model" / "model.safetensors")


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    """The same spec run in one process (cluster of one GPU, train TP 1), 2 steps, each followed by an evaluation."""
    tmp = tmp_path_factory.mktemp("one")
    spec = tmp / "one.yaml"
    spec.write_text(DP2.read_text().replace("gpus_per_node: 2", "gpus_per_node: 1") + EVALUATION)
    proc = launch(1, spec, tmp / "run", "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "run"


def assert_trains_as(out: Path, reference: Path, weights_rel: float = 1e-5, loss_abs: float = 1e-9) -> None:
    a, b = metrics(reference), metrics(out)
    assert [r["step"] for r in b] == [1, 2]
    for x, y in zip(a, b, strict=True):
        assert x["reward_mean"] == y["reward_mean"] and x["response_len_mean"] == y["response_len_mean"]
        for key in ("loss", "kl", "entropy", "grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=loss_abs if key == "loss" else 1e-9), key
    w1, w2 = weights(reference, 2), weights(out, 2)
    assert w1.keys() == w2.keys()
    for name, t in w1.items():
        assert (w2[name] - t).norm() <= weights_rel * t.norm() + 1e-9, name
    assert not list((out / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_two_data_parallel_ranks_train_and_evaluate_as_one_process_and_resume_bitwise(tmp_path, one_process):
    spec = tmp_path / "dp2_eval.yaml"
    spec.write_text(DP2.read_text() + EVALUATION)
    two = launch(2, spec, tmp_path / "two", "--steps", "2")
    assert two.returncode == 0, two.stderr[-3000:]
    assert_trains_as(tmp_path / "two", one_process)
    held_out = evaluations(one_process)  # each rank answers its share of each batch, as of a step
    assert [e["step"] for e in held_out] == [0, 1, 2] and held_out[0]["responses"] == 16 * 16
    assert evaluations(tmp_path / "two") == held_out
    for steps, more in (("1", ()), ("2", ("--resume",))):  # stopped after step 1, resumed on the same layout
        part = launch(2, DP2, tmp_path / "resumed", "--steps", steps, *more)
        assert part.returncode == 0, part.stderr[-3000:]
    whole, resumed = weights(tmp_path / "two", 2), weights(tmp_path / "resumed", 2)
    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole)
    keys = ("loss", "kl", "entropy", "grad_norm", "reward_mean")
    assert [[r[k] for k in keys] for r in metrics(tmp_path / "resumed")] == [
        [r[k] for k in keys] for r in metrics(tmp_path / "two")
    ]


@pytest.mark.slow
def test_two_data_parallel_replicas_of_two_tensor_parallel_ranks_train_as_one_process(tmp_path, one_process):
    spec = tmp_path / "dp2_tp2.yaml"
    text = DP2.read_text().replace("gpus_per_node: 2", "gpus_per_node: 4") + EVALUATION
    spec.write_text(text.replace("parallel: {train_tp: 1, rollout_tp: 1}", "parallel: {train_tp: 2, rollout_tp: 1, "
                                 "split_rollout: false}"))  # fmt: skip
    four = launch(4, spec, tmp_path / "four", "--steps", "2")
    assert four.returncode == 0, four.stderr[-3000:]
    assert_trains_as(tmp_path / "four", one_process)
    assert evaluations(tmp_path / "four") == evaluations(one_process)


@pytest.mark.slow
def test_two_ranks_sharing_the_optimizer_state_zero1_train_as_one_process_and_resume_from_their_shares(
    tmp_path, one_process
):
    spec = tmp_path / "zero1.yaml"
    spec.write_text(DP2.read_text().replace("parallel: {train_tp: 1, rollout_tp: 1}", "parallel: {train_tp: 1, "
                                            "rollout_tp: 1, distributed_optimizer: true}"))  # fmt: skip
    first = launch(2, spec, tmp_path / "zero1", "--steps", "1")
    assert first.returncode == 0, first.stderr[-3000:]
    written = tmp_path / "zero1" / "checkpoints" / "step-000001"
    assert {p.name for p in written.glob("optimizer*")} == {"optimizer-dp0", "optimizer-dp1"}  # a share each
    shares = [torch.load(f, weights_only=True) for d in ("optimizer-dp0", "optimizer-dp1")
              for f in sorted((written / d).glob("part-*.pt"))]  # fmt: skip
    elements = sum(e["master"].numel() for part in shares for e in part["state"].values())
    assert elements == sum(t.numel() for t in weights(tmp_path / "zero1", 1).values())  # every element once
    rest = launch(2, spec, tmp_path / "zero1", "--steps", "2", "--resume")
    assert rest.returncode == 0, rest.stderr[-3000:]
    assert_trains_as(tmp_path / "zero1", one_process)


@pytest.mark.slow
def test_two_ranks_with_two_mini_batches_train_as_one_process_with_two(tmp_path, one_process):
    """Each rank takes its part of each mini-batch: its m-th local mini-batch is its part of the step's m-th. The
    prefix reruns its layers in backward, one accumulation per layer and prompt group: the gradients' sum waits
    for the backward's end (`OverlappedSum(from_backward=False)`)."""
    text = DP2.read_text().replace("  lr: 2.0e-3\n", "  lr: 2.0e-3\n  minibatches_per_step: 2\n")
    text = text.replace(
        "memory: {runtime_reserve_gib: 0.1}", "memory: {runtime_reserve_gib: 0.1, prefix_activations: recompute}"
    )
    assert "minibatches_per_step: 2" in text and "prefix_activations: recompute" in text
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text(text.replace("gpus_per_node: 2", "gpus_per_node: 1"))
    two.write_text(text)
    alone = launch(1, one, tmp_path / "alone", "--steps", "2")
    assert alone.returncode == 0, alone.stderr[-3000:]
    pair = launch(2, two, tmp_path / "pair", "--steps", "2")
    assert pair.returncode == 0, pair.stderr[-3000:]
    # four updates: the keys' biases, whose gradient is zero but for float rounding (softmax ignores a shift),
    # take Adam steps of that rounding, which the ranks' summation order changes
    assert_trains_as(tmp_path / "pair", tmp_path / "alone", weights_rel=5e-5)
    one_batch = metrics(one_process)[1]["loss"]  # one update a step trains otherwise: the test tells them apart
    assert metrics(tmp_path / "pair")[1]["loss"] != pytest.approx(one_batch, rel=1e-3)


@pytest.mark.slow
def test_ppo_with_a_critic_on_two_ranks_trains_as_one_process(tmp_path):
    """The critic's value loss normalised over the whole step, its gradients summed, the advantages whitened over
    every rank's tokens."""
    # Adam's eps as the DP spec has it: at 1e-8 elements whose gradient is rounding take rounding-sized steps
    text = (ROOT / "specs/ppo_critic_tiny.yaml").read_text().replace("lr: 1.0e-3,", "lr: 1.0e-3, eps: 1.0e-6,", 1)
    assert "eps: 1.0e-6" in text
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    one.write_text(text)
    two.write_text(text.replace("cluster: {hbm_gib: 16", "cluster: {gpus_per_node: 2, hbm_gib: 16"))
    assert two.read_text() != text
    alone = launch(1, one, tmp_path / "alone", "--steps", "2")
    assert alone.returncode == 0, alone.stderr[-3000:]
    pair = launch(2, two, tmp_path / "pair", "--steps", "2")
    assert pair.returncode == 0, pair.stderr[-3000:]
    # PPO's loss is a mean of whitened advantages (zero but for rounding) and a KL term: compared absolutely; the
    # keys' biases (a zero gradient but for rounding) as in the mini-batch test, and the merger's last bias, one of
    # whose elements gets a gradient near Adam's eps (its two steps move it 0.14 lr): there the order of the ranks'
    # sum moves it by up to 1e-6, 7e-5 of the bias's norm
    assert_trains_as(tmp_path / "pair", tmp_path / "alone", weights_rel=2e-4, loss_abs=1e-6)
    for x, y in zip(metrics(tmp_path / "alone"), metrics(tmp_path / "pair"), strict=True):
        for key in ("value_loss", "critic_grad_norm"):
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-9), key


@pytest.mark.slow
def test_rollplex_run_starts_a_nodes_ranks_itself_and_they_train_as_one_process(tmp_path, one_process):
    """Without torchrun `rollplex run` starts the cluster's two ranks; what they print is theirs alone (no launcher
    warnings or failure report), a spec or flag error once, not once a rank."""
    itself = launch(1, DP2, tmp_path / "itself", "--steps", "2")  # one command: no torchrun around it
    assert itself.returncode == 0, itself.stderr[-3000:]
    assert "Traceback" not in itself.stderr, itself.stderr[-3000:]
    assert_trains_as(tmp_path / "itself", one_process)
    failed = launch(1, DP2, tmp_path / "empty", "--steps", "1", "--resume")  # every rank finds no checkpoint: one
    # line, from rank 0, and none of the launcher's failure report
    assert failed.returncode == 2, failed.stderr[-3000:]
    assert failed.stderr.strip().splitlines() == [
        f"rollplex: --resume: no complete checkpoint in {tmp_path / 'empty' / 'checkpoints'}; run once without "
        "--resume first"
    ]


def test_a_launch_that_does_not_match_the_cluster_is_one_line(tmp_path, capsys, monkeypatch):
    from rollplex.cli import main

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")  # a launcher's one process, where the cluster has two GPUs
    code = main(["run", str(DP2), "--out", str(tmp_path / "alone"), "--quiet", "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "the cluster has 2 GPUs but 1 processes were launched: use rollplex run" in err


def launch_nodes(spec: Path, out: Path, *args: str) -> list[subprocess.CompletedProcess]:
    """Two torchrun "nodes" of one process each on this machine, meeting over loopback (c10d rendezvous)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                  f"127.0.0.1:{port}"]  # fmt: skip
    run = ["-m", "rollplex", "run", str(spec), "--out", str(out), "--quiet", *args]
    command = [sys.executable, "-m", "torch.distributed.run", *rendezvous]
    procs = [
        subprocess.Popen(
            [*command, "--node-rank", str(r), *run], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]
    return [subprocess.CompletedProcess(p.args, p.wait(timeout=600), *p.communicate()) for p in procs]


@pytest.mark.slow
def test_two_nodes_over_loopback_train_as_one_process_and_resume(tmp_path, one_process):
    spec = tmp_path / "nodes.yaml"
    spec.write_text(DP2.read_text().replace("nodes: 1, gpus_per_node: 2", "nodes: 2, gpus_per_node: 1"))
    first = launch_nodes(spec, tmp_path / "nodes", "--steps", "1")
    assert all(p.returncode == 0 for p in first), [p.stderr[-2000:] for p in first]
    rest = launch_nodes(spec, tmp_path / "nodes", "--steps", "2", "--resume")
    assert all(p.returncode == 0 for p in rest), [p.stderr[-2000:] for p in rest]
    assert_trains_as(tmp_path / "nodes", one_process)
