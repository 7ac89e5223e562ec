"""Checkpoints of `rollplex run`: resume is exact, stops are safe, the optimizer state is written in parts and in
transformers' shapes, and a timing run writes none."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from run_testkit import ROOT, char_share, cli_here, loaded, run, spec_text, stopping_checkpoint
from safetensors import safe_open

from rollplex.data.rewards import REWARDS
from rollplex.errors import SpecError
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.memory.optimizer import ChunkedAdamW
from rollplex.models.config import CONFIG_DIR


@pytest.mark.slow
def test_resume_continues_with_the_digests_of_an_uninterrupted_run(tmp_path):
    whole = run(tmp_path, "rollplex", 4, name="whole")
    first = run(tmp_path, "rollplex", 2, name="split")
    rest = run(tmp_path, "rollplex", 4, name="split", resume=True)
    assert [r["param_digest"] for r in first + rest] == [r["param_digest"] for r in whole]
    lines = (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2, 3, 4]


def test_a_checkpoint_missing_an_optimizer_part_is_refused(tmp_path, monkeypatch):
    parts = ChunkedAdamW.state_parts
    monkeypatch.setattr(ChunkedAdamW, "state_parts", lambda self: parts(self, max_bytes=4096))  # several parts
    run(tmp_path, "rollplex", 1, name="cut")
    written = sorted((tmp_path / "cut" / "checkpoints" / "step-000001" / "optimizer").glob("part-*.pt"))
    assert len(written) > 2
    written[1].unlink()
    with pytest.raises(SpecError, match=r"step-000001 is damaged \(optimizer/part-00001.pt is missing\)"):
        run(tmp_path, "rollplex", 2, name="cut", resume=True)  # before any model is built: its manifest says so
    (tmp_path / "cut" / "checkpoints" / "step-000001" / "files.json").unlink()  # one written before manifests
    with pytest.raises(SpecError, match=r"covers .* of the optimizer's .* an incomplete checkpoint"):
        run(tmp_path, "rollplex", 2, name="cut", resume=True)


def test_checkpoints_hold_optimizer_state_in_transformers_shapes_and_resume_exactly_with_a_padded_vision_mlp(
    tmp_path,
):
    config = json.loads((CONFIG_DIR / "tiny.json").read_text())
    config["vision_config"]["intermediate_size"] = 60  # stored 64 wide (`VisionMLP`)
    (tmp_path / "config.json").write_text(json.dumps(config))
    spec = parse_spec(spec_text(kl=0.1, device="cpu", model=str(tmp_path / "config.json")))

    def go(name: str, steps: int, resume: bool = False) -> list[dict]:
        opts = RunOptions(steps, tmp_path / name, resume=resume, progress=False, tensorboard=False)
        return train(compile_plan(spec, Schedule("rollplex")), opts)

    whole = go("whole", 3)
    first, rest = go("split", 2), go("split", 3, resume=True)
    assert [r["param_digest"] for r in first + rest] == [r["param_digest"] for r in whole]
    step = tmp_path / "split" / "checkpoints" / "step-000002"
    (part,) = (step / "optimizer").glob("part-*.pt")
    ours = sorted(tuple(e["exp_avg"].shape) for e in torch.load(part, weights_only=False)["state"].values())
    with safe_open(str(step / "model" / "model.safetensors"), framework="pt") as f:
        theirs = sorted(tuple(f.get_slice(k).get_shape()) for k in f.keys())  # noqa: SIM118
    assert ours == theirs and (60, 32) in ours  # the weights' shapes: transformers', padding left out


def test_a_checkpoint_with_its_optimizer_state_in_one_file_still_resumes(tmp_path):
    whole = run(tmp_path, "rollplex", 3, name="whole")
    run(tmp_path, "rollplex", 2, name="old")
    step = tmp_path / "old" / "checkpoints" / "step-000002"
    (part,) = sorted((step / "optimizer").glob("part-*.pt"))
    shutil.copy(part, step / "optimizer.pt")  # the layout of earlier checkpoints: one whole state dict
    shutil.rmtree(step / "optimizer")
    (step / "files.json").unlink()  # written before checkpoints listed their files
    rest = run(tmp_path, "rollplex", 3, name="old", resume=True)
    assert rest[-1]["param_digest"] == whole[-1]["param_digest"]


def interrupt_at_step_3(tmp_path, steps: int, name: str, before=lambda: None) -> None:
    """A run of `steps` interrupted (Ctrl-C) at the first reward of step 3, `before()` called just before."""
    calls = {"n": 0}

    def interrupting(text, example):
        calls["n"] += 1
        if calls["n"] == 2 * 3 * 2 + 1:  # the first reward of step 3
            before()
            raise KeyboardInterrupt
        return char_share(text, example)

    REWARDS["test_char_share"] = interrupting
    try:
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path, "rollplex", steps, name=name)
    finally:
        REWARDS["test_char_share"] = char_share


def test_ctrl_c_inside_a_step_keeps_the_last_completed_step_and_no_half_written_checkpoint(tmp_path):
    whole = run(tmp_path, "rollplex", 4, name="whole")
    interrupt_at_step_3(tmp_path, 4, "stopped")
    names = sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir())
    assert names == ["step-000002"]
    rest = run(tmp_path, "rollplex", 4, name="stopped", resume=True)
    assert [r["param_digest"] for r in rest] == [r["param_digest"] for r in whole[2:]]


def test_no_checkpoints_writes_none_and_conflicts_with_checkpoint_every(tmp_path, capsys):
    records = run(tmp_path, "rollplex", 2, name="timing", checkpoints=False, checkpoint_every=1)
    assert len(records) == 2 and not (tmp_path / "timing" / "checkpoints").exists()
    assert (tmp_path / "timing" / "metrics.jsonl").is_file()
    code, err = cli_here(
        capsys,
        "run",
        str(ROOT / "specs/tiny_cpu.yaml"),
        "--no-checkpoints",
        "--checkpoint-every",
        "1",
        "--out",
        str(tmp_path / "x"),
    )
    assert code == 2 and "choose one" in err and len(err.splitlines()) == 1


def test_resume_without_checkpoints_is_a_one_line_error(tmp_path, capsys):
    code, err = cli_here(capsys, "run", str(ROOT / "specs/tiny_cpu.yaml"), "--resume", "--out", str(tmp_path))
    assert code == 2 and "no complete checkpoint" in err and "Traceback" not in err


class _Payload:
    """Unpickling this runs code: what a tampered checkpoint could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_a_checkpoint_part_holding_a_pickled_object_is_refused_unread(tmp_path):
    run(tmp_path, "rollplex", 1, name="tampered")
    part = next((tmp_path / "tampered" / "checkpoints" / "step-000001" / "optimizer").glob("part-*.pt"))
    marker = tmp_path / "ran"
    torch.save({"state": {0: _Payload(marker)}}, part)
    manifest = part.parents[1] / "files.json"  # what a tamperer would also rewrite
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "optimizer/" + part.name: part.stat().st_size}))
    with pytest.raises(SpecError, match="holds more than tensors and plain values, not loaded"):
        run(tmp_path, "rollplex", 2, name="tampered", resume=True)
    assert not marker.exists()


@pytest.mark.parametrize(
    "error, shown",
    [
        (OSError(28, "No space left on device"), "No space left on device"),
        (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"), "unexpected pos 64 vs 0"),
        (RuntimeError(), "RuntimeError"),  # an error without a message
        (
            RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0"),
            "the disk is full, 0 MiB free: [enforce fail",
        ),  # torch's words where the disk is full
        (
            torch.distributed.DistBackendError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1. This is"),
            "another rank stopped answering (DistBackendError)",
        ),  # a collective of the save, its peer gone (a data-parallel rank killed)
    ],  # the OS's error, torch's writer's own, and a collective's
)
def test_a_full_disk_while_checkpointing_is_one_line_and_keeps_the_previous_checkpoint(
    tmp_path, monkeypatch, capsys, error, shown
):
    from rollplex.cli import main
    from rollplex.executors import checkpointing

    if "disk is full" in shown:  # the folder's disk, as the OS reports it when the writer fails
        usage = shutil.disk_usage(tmp_path)
        monkeypatch.setattr(checkpointing.shutil, "disk_usage", lambda path: usage._replace(free=12))

    real = torch.save

    def full_at_the_second_checkpoint(obj, f, *args, **kw):
        if "step-000002" in str(f):
            raise error
        return real(obj, f, *args, **kw)

    monkeypatch.setattr(checkpointing.torch, "save", full_at_the_second_checkpoint)
    out = tmp_path / "full"
    assert main(["run", str(ROOT / "specs/tiny_cpu.yaml"), "--out", str(out), "--steps", "2", "--checkpoint-every",
                 "1", "--quiet"]) == 1  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "checkpoint of step 2 not written (" in err[0] and shown in err[0] and "; kept" in err[0]
    assert checkpointing.latest(out) == checkpointing.checkpoint_dir(out, 1)
    assert not list((out / "checkpoints").glob("*.tmp"))


def test_a_fresh_run_into_an_earlier_runs_checkpoints_is_refused_before_any_model_is_built(tmp_path, capsys):
    run(tmp_path, "rollplex", 1, name="earlier")
    with pytest.raises(SpecError, match=r"holds an earlier run's checkpoints \(step-000001\).*--resume"):
        run(tmp_path, "rollplex", 2, name="earlier")
    code, err = cli_here(
        capsys, "run", str(ROOT / "specs/tiny_cpu.yaml"), "--steps", "2", "--out", str(tmp_path / "earlier")
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_resume_takes_the_specs_optimizer_settings_and_a_metrics_line_cut_short(tmp_path):
    run(tmp_path, "rollplex", 1, name="a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    with (tmp_path / "b" / "metrics.jsonl").open("a") as f:
        f.write('{"step": 2, "loss": 0.')  # a run killed while writing its next line
    same = run(tmp_path, "rollplex", 2, name="a", resume=True)
    text = spec_text().replace("lr: 1.0e-2", "lr: 1.0e-4")
    assert text != spec_text()
    opts = RunOptions(2, tmp_path / "b", progress=False, tensorboard=False, resume=True)
    edited = train(compile_plan(parse_spec(text), Schedule.ROLLPLEX), opts)
    assert edited[0]["loss"] == same[0]["loss"] and edited[0]["param_digest"] != same[0]["param_digest"]
    lines = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]


def test_resuming_with_the_vision_tower_frozen_or_not_as_it_was_is_one_line(tmp_path):
    run(tmp_path, "rollplex", 1, name="trained")
    line = next(x for x in spec_text().splitlines() if x.startswith("model: "))
    text = spec_text().replace(line, f"model: {{name: {line[7:]}, freeze_vision: true}}")
    opts = RunOptions(2, tmp_path / "trained", progress=False, tensorboard=False, resume=True)
    with pytest.raises(SpecError, match=r"holds the state of .* parameters, this run trains .*: resume with the spec"):
        train(compile_plan(parse_spec(text), Schedule.ROLLPLEX), opts)


def test_a_row_the_data_cannot_read_mid_run_is_one_line_and_the_steps_before_it_are_kept(tmp_path, monkeypatch):
    from rollplex.data.prefetch import Prefetch
    from rollplex.errors import RunFailed

    take, calls = Prefetch.take, []

    def second_fails(self, position, next_position=None):
        calls.append(position)
        if len(calls) == 2:
            raise ValueError("rows.jsonl:7: cannot read clip.mp4: invalid data")
        return take(self, position, next_position)

    monkeypatch.setattr(Prefetch, "take", second_fails)
    with pytest.raises(RunFailed, match=r"step 2's data: rows.jsonl:7: cannot read clip.mp4.*--resume") as error:
        run(tmp_path, "serial", steps=3)
    assert "\n" not in str(error.value)
    assert [p.name for p in (tmp_path / "serial/checkpoints").iterdir()] == ["step-000001"]
    calls.clear()
    with pytest.raises(RunFailed, match=r"step 2's data: .*; fix or drop that row$"):  # no checkpoint: no --resume
        run(tmp_path, "serial", steps=3, name="timing", checkpoints=False)


def test_resuming_with_another_seed_dataset_or_dtype_is_one_line_and_the_run_is_left_as_it_was(tmp_path):
    run(tmp_path, "rollplex", 1, name="a")
    metrics = (tmp_path / "a" / "metrics.jsonl").read_text()
    edits = [
        ("seed: 3", "seed: 7", "run.seed: 3, the spec has 7"),
        ("dtype: float32", "dtype: bfloat16", "run.dtype: 'float32', the spec has 'bfloat16'"),
        ('dataset: "synthetic:clevrer@tiny"', 'dataset: "synthetic:star@tiny"', "workload.dataset: 'synthetic:cle"),
    ]
    for was, now, said in edits:
        assert was in spec_text()
        opts = RunOptions(2, tmp_path / "a", progress=False, tensorboard=False, resume=True)
        with pytest.raises(SpecError, match=r"--resume: .*step-000001 was written with " + re.escape(said)):
            train(compile_plan(parse_spec(spec_text().replace(was, now)), Schedule.ROLLPLEX), opts)
    assert (tmp_path / "a" / "metrics.jsonl").read_text() == metrics


def test_a_runs_identity_names_a_model_or_dataset_file_however_its_path_is_written(tmp_path):
    from rollplex.executors.checkpointing import identity
    from rollplex.graph.load import load_spec

    model = str(stopping_checkpoint())
    rows = tmp_path / "data" / "rows.jsonl"
    rows.parent.mkdir()
    rows.write_text("")
    for where, model_as, data_as in [
        (tmp_path, model, "data/rows.jsonl"),
        (tmp_path / "data", model + "/", "rows.jsonl"),
        (tmp_path / "data", model + "/config.json", str(rows)),
    ]:
        text = spec_text().replace(model, model_as).replace('"synthetic:clevrer@tiny"', f'"{data_as}"')
        (where / "spec.yaml").write_text(text)
        found = identity(load_spec(where / "spec.yaml"))
        assert found["model.name"] == str(Path(model).resolve() / "config.json")
        assert found["workload.dataset"] == str(rows.resolve())
    shipped = load_spec(ROOT / "specs" / "tiny_cpu.yaml")
    assert identity(shipped)["model.name"] == "tiny" and identity(shipped)["workload.dataset"].startswith("synthetic:")


def test_a_resumed_run_drops_its_tensorboard_events_past_the_checkpoint_and_a_save_clears_stale_tmp_dirs(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    opts = RunOptions(3, tmp_path / "a", progress=False, checkpoint_every=1)
    train(compile_plan(loaded(), Schedule.ROLLPLEX), opts)
    checkpoints = tmp_path / "a" / "checkpoints"
    shutil.rmtree(checkpoints / "step-000003")
    (checkpoints / "step-000001.tmp").mkdir()  # a save killed midway
    train(compile_plan(loaded(), Schedule.ROLLPLEX), RunOptions(3, tmp_path / "a", progress=False, resume=True))
    events = EventAccumulator(str(tmp_path / "a" / "tb"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001", "step-000002", "step-000003"]


def test_the_latest_checkpoint_is_the_highest_step_by_number(tmp_path):
    from rollplex.executors.checkpointing import latest

    for name in ("step-999999", "step-1000000", "step-000005", "step-1000001.tmp"):
        (tmp_path / "checkpoints" / name).mkdir(parents=True)
    assert latest(tmp_path).name == "step-1000000"


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory) -> Path:
    """A run directory with complete checkpoints of steps 1 and 2."""
    root = tmp_path_factory.mktemp("two")
    run(root, "rollplex", 2, name="run", checkpoint_every=1)
    return root / "run"


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


DAMAGES = {
    "weights truncated": lambda c: _truncate(next((c / "model").glob("*.safetensors"))),
    "rng zeroed": lambda c: (c / "rng.pt").write_bytes(bytes((c / "rng.pt").stat().st_size)),
    "optimizer part truncated": lambda c: _truncate(next((c / "optimizer").glob("part-*.pt"))),
    "state.json gone": lambda c: (c / "state.json").unlink(),
    "state.json garbled": lambda c: (c / "state.json").write_text("{"),
    "weights gone": lambda c: shutil.rmtree(c / "model"),
    "index emptied": lambda c: (
        (c / "files.json").write_text(json.dumps({"model/model.safetensors.index.json": 2}))
        or (c / "model" / "model.safetensors.index.json").write_text("{}")
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_resuming_from_a_damaged_checkpoint_is_one_line_before_any_model_is_built(
    tmp_path, two_checkpoints, monkeypatch, damage
):
    from rollplex.executors import loop

    out = tmp_path / "run"
    shutil.copytree(two_checkpoints, out)
    DAMAGES[damage](out / "checkpoints" / "step-000002")
    monkeypatch.setattr(loop, "build_engines", lambda *a, **k: pytest.fail("built the models"))
    with pytest.raises(SpecError) as info:
        run(tmp_path, "rollplex", 3, name="run", resume=True)
    message = str(info.value)
    assert "step-000002 is damaged" in message and "move it aside to resume from step-000001" in message
    assert "\n" not in message


def test_a_second_interrupt_while_the_last_checkpoint_is_written_waits_for_it(tmp_path, monkeypatch, capsys):
    import os
    import signal

    from rollplex.executors import checkpointing

    whole = run(tmp_path, "rollplex", 3, name="whole")
    real = torch.save

    def interrupted_again(obj, f, *args, **kw):
        os.kill(os.getpid(), signal.SIGINT)  # the user presses Ctrl-C again while the run saves on its way out
        return real(obj, f, *args, **kw)

    try:
        interrupt_at_step_3(tmp_path, 3, "stopped", lambda: monkeypatch.setattr(checkpointing.torch, "save",
                                                                                 interrupted_again))  # fmt: skip
    finally:
        monkeypatch.setattr(checkpointing.torch, "save", real)
    assert "ending the run: its last metrics and checkpoint first" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "stopped" / "checkpoints").iterdir()) == ["step-000002"]
    rest = run(tmp_path, "rollplex", 3, name="stopped", resume=True)
    assert [r["param_digest"] for r in rest] == [r["param_digest"] for r in whole[2:]]
