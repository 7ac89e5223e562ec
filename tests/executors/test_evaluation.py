"""Held-out evaluation (`executors.evaluation`): a run with it trains bit for bit as the run without it and logs one
line per evaluation; its examples are none a run trains on; two evaluations of the same weights agree and other
weights change them; a resumed run keeps the evaluations up to its checkpoint only; the spec's evaluation errors
are one line each. Data parallelism: `test_dp_run.py`."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from run_testkit import ROOT, cli_here, spec_text
from test_preflight import refused

from rollplex.data.source import SYNTHETIC_SIZE, open_dataset
from rollplex.data.tokenizer import CharTokenizer
from rollplex.errors import SpecError
from rollplex.executors.engines import build_engines
from rollplex.executors.evaluation import evaluate, open_evaluation
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.models.inputs import pixels_of

TINY = (ROOT / "specs/tiny_cpu.yaml").read_text()


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run(tmp_path, text: str, name: str, steps: int, **kw) -> list[dict]:
    plan = compile_plan(parse_spec(text, str(tmp_path / "spec.yaml"), tmp_path))
    return train(plan, RunOptions(steps, tmp_path / name, progress=False, tensorboard=False, **kw))


def but_time(figures: dict) -> dict:
    return {k: v for k, v in figures.items() if k != "time_s"}


def test_a_run_with_evaluation_trains_as_without_and_logs_an_evaluation_after_every_kth_and_the_last_step(tmp_path):
    text = spec_text()  # responses of different lengths, a reward that differs between them
    evaluated = run(tmp_path, text + "evaluation: {every: 2, prompts: 4}\n", "with", 3)
    plain = run(tmp_path, text, "without", 3)
    keys = ("param_digest", "loss", "reward_mean", "response_len_mean")
    assert [[r[k] for k in keys] for r in evaluated] == [[r[k] for k in keys] for r in plain]
    assert not (tmp_path / "without/eval.jsonl").exists()
    held_out = lines(tmp_path / "with/eval.jsonl")
    assert [e["step"] for e in held_out] == [0, 2, 3]  # the starting weights too
    for e in held_out:
        assert (e["prompts"], e["responses"]) == (4, 4 * 3)  # two batches of a step's 2 prompts x 3 samples
        assert 0 <= e["accuracy"] <= 1 and 0 < e["response_len_mean"] <= 6 and e["rewards/test_char_share"] > 0
        assert e["reward_mean"] == pytest.approx(e["rewards/test_char_share"]) and e["reward_std"] > 0


def test_at_start_false_leaves_the_starting_weights_unevaluated(tmp_path):
    run(tmp_path, TINY + "evaluation: {every: 1, prompts: 8, at_start: false}\n", "late", 1)
    assert [e["step"] for e in lines(tmp_path / "late/eval.jsonl")] == [1]


def test_held_out_examples_are_none_a_run_trains_on(tmp_path):
    plan = compile_plan(parse_spec(TINY + "evaluation: {every: 5, prompts: 16}\n", str(tmp_path / "s.yaml")))
    ev = open_evaluation(plan.loaded)
    trained = open_dataset("synthetic:colour@tiny", CharTokenizer(), 0)
    assert len(ev.dataset) == 16 and ev.num_batches == 2
    for i in range(4):
        held, seen = ev.dataset[i], trained[i]
        assert held.meta["index"] == SYNTHETIC_SIZE + i and seen.meta["index"] == i
        assert not torch.equal(pixels_of(held.prompt.visuals), pixels_of(seen.prompt.visuals))


def test_two_evaluations_of_the_same_weights_agree_and_other_weights_change_them(tmp_path):
    plan = compile_plan(parse_spec(spec_text() + "evaluation: {every: 1, prompts: 4}\n"))
    engines, ev = build_engines(plan), open_evaluation(plan.loaded)
    first, again = evaluate(engines, ev, 1), evaluate(engines, ev, 2)
    assert but_time(first) == {**but_time(again), "step": 1}
    with torch.no_grad():
        for p in engines.actor.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(7)) * p.std().nan_to_num(0.1))
    other = evaluate(engines, ev, 1)
    assert (other["reward_mean"], other["response_len_mean"]) != (first["reward_mean"], first["response_len_mean"])


def test_a_resumed_run_keeps_the_evaluations_up_to_its_checkpoint_and_redoes_one_a_stop_cut_short(tmp_path):
    text = spec_text() + "evaluation: {every: 1}\n"
    run(tmp_path, text, "run", 2, checkpoint_every=1)
    # stopped during step 1's evaluation (its checkpoint saved, its line not written) and never saved step 2
    shutil.rmtree(tmp_path / "run/checkpoints/step-000002")
    written = (tmp_path / "run/eval.jsonl").read_text().splitlines()
    (tmp_path / "run/eval.jsonl").write_text(written[0] + "\n" + written[2] + "\n")
    run(tmp_path, text, "run", 3, resume=True)
    held_out = lines(tmp_path / "run/eval.jsonl")
    assert [e["step"] for e in held_out] == [0, 1, 2, 3]  # step 0 once, step 1 again, step 2's past the checkpoint
    whole = run(tmp_path, text, "whole", 3)
    assert len(whole) == 3
    assert [but_time(e) for e in held_out] == [but_time(e) for e in lines(tmp_path / "whole/eval.jsonl")]


def test_a_held_out_prompt_over_the_budget_is_one_line_before_step_1_and_in_the_data_check(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY + "evaluation: {every: 2, dataset: 'synthetic:colour'}\n")  # the full-size preset's prompts
    code, err = cli_here(capsys, "run", str(spec), "--out", str(tmp_path / "run"), "--quiet")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "evaluation.dataset: a held-out prompt has" in err and "over workload.prompt_tokens 384" in err
    assert (tmp_path / "run/metrics.jsonl").read_text() == ""  # before any step
    code, err = cli_here(capsys, "compile", str(spec), "--check-data")
    assert code == 2 and "evaluation.dataset: a held-out prompt has" in err, err


def test_an_unreadable_held_out_example_is_one_line_and_the_steps_before_it_stay(tmp_path, capsys):
    Image.fromarray(np.full((56, 56, 3), 30, np.uint8)).save(tmp_path / "i.png")
    (tmp_path / "broken.png").write_bytes(b"not an image")
    row = {"problem": "Is it?", "problem_type": "free-form", "solution": "<answer> Yes </answer>", "image": "i.png"}
    rows = [row] * 7 + [{**row, "image": "broken.png"}]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY + "evaluation: {every: 1, at_start: false, dataset: held.jsonl}\n")
    code, err = cli_here(capsys, "run", str(spec), "--out", str(tmp_path / "run"), "--quiet", "--steps", "2")
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert "the evaluation after step 1: a held-out example:" in err and "broken.png" in err, err
    assert [json.loads(line)["step"] for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()] == [1]
    assert (tmp_path / "run/checkpoints/step-000001").is_dir()


@pytest.mark.parametrize(
    ("section", "key", "words"),
    [
        ("{every: 0}", "evaluation.every", "greater than 0"),
        (
            "{every: 2, prompts: 12}",
            "evaluation",
            "12 held-out prompts are not a multiple of workload.prompts_per_step 8",
        ),
        ("{every: 2, dataset: 'synthetic:nope'}", "evaluation.dataset", "nope"),
        (
            "{every: 2, prompts: 8, each: 3}",
            "evaluation.each",
            "unknown key; allowed here: every, at_start, prompts, dataset",
        ),
    ],
)
def test_a_bad_evaluation_section_is_one_line_naming_its_key(tmp_path, capsys, section, key, words):
    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY + f"evaluation: {section}\n")
    code, err = cli_here(capsys, "compile", str(spec), "--dry-run")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert key in err and words in err, err


def test_a_training_file_needs_a_held_out_file_that_exists_and_holds_the_prompts(tmp_path, monkeypatch):
    Image.fromarray(np.full((56, 56, 3), 30, np.uint8)).save(tmp_path / "i.png")
    row = {"problem": "Is it?", "problem_type": "free-form", "solution": "<answer> Yes </answer>", "image": "i.png"}
    (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "held.jsonl").write_text((json.dumps(row) + "\n") * 3)
    on_file = TINY.replace("synthetic:colour@tiny", "train.jsonl")
    with pytest.raises(
        SpecError, match=r"evaluation needs held-out examples.*name a held-out file as evaluation\.dataset"
    ):
        parse_spec(on_file + "evaluation: {every: 2}\n", str(tmp_path / "spec.yaml"), tmp_path)
    same = refused(tmp_path, monkeypatch, on_file + "evaluation: {every: 2, dataset: train.jsonl}\n")
    assert "evaluation.dataset: 'train.jsonl' is the training file, whose examples are not held out" in same
    same = refused(tmp_path, monkeypatch, on_file + "evaluation: {every: 2, dataset: ./train.jsonl}\n")
    assert "evaluation.dataset: './train.jsonl' is the training file, whose examples are not held out" in same
    missing = refused(tmp_path, monkeypatch, TINY + "evaluation: {every: 2, dataset: gone.jsonl}\n")
    assert "evaluation.dataset: dataset 'gone.jsonl' is neither" in missing
    short = refused(tmp_path, monkeypatch, TINY + "evaluation: {every: 2, dataset: held.jsonl}\n")
    assert "evaluation.dataset: 8 held-out examples asked for, and the file has 3" in short


def test_the_dry_run_says_when_and_what_the_run_evaluates(tmp_path, capsys):
    from rollplex.cli import main

    spec = tmp_path / "spec.yaml"
    spec.write_text(TINY + "evaluation: {every: 50, prompts: 16}\n")
    assert main(["compile", str(spec), "--dry-run"]) == 0
    said = "evaluation: before step 1, every 50 steps and after the last, 16 prompts of synthetic:colour@tiny's "
    said += "held-out examples, in "
    assert said + "2 rollouts of a step's 8 prompts x 16 samples (not in the time plan)" in capsys.readouterr().out
    spec.write_text(TINY + "evaluation: {every: 1, at_start: false}\n")
    assert main(["compile", str(spec), "--dry-run"]) == 0
    assert "evaluation: every 1 step and after the last, 8 prompts" in capsys.readouterr().out
    spec.write_text(TINY)
    assert main(["compile", str(spec), "--dry-run"]) == 0
    assert "evaluation:" not in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_run_with_evaluation_trains_as_without(tmp_path):
    """The graph-captured engine prefills the held-out prompts itself where the step decodes from the actor prefix."""
    text = spec_text(device="cuda").replace("device: cuda,", "device: cuda, deterministic: true,")
    evaluated = run(tmp_path, text + "evaluation: {every: 1, prompts: 4}\n", "with", 2)
    plain = run(tmp_path, text, "without", 2)
    assert [r["param_digest"] for r in evaluated] == [r["param_digest"] for r in plain]
    held_out = lines(tmp_path / "with/eval.jsonl")
    assert [(e["step"], e["responses"]) for e in held_out] == [(0, 12), (1, 12), (2, 12)]
    assert all(0 < e["response_len_mean"] <= 6 for e in held_out)


def test_a_fresh_run_without_evaluation_leaves_no_earlier_runs_evaluations(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("")  # an earlier run stopped after its step-0 evaluation
    (tmp_path / "run/eval.jsonl").write_text('{"step": 0}\n')
    run(tmp_path, TINY, "run", 1)
    assert not (tmp_path / "run/eval.jsonl").exists()
