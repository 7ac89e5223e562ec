"""What `rollplex run` refuses before it builds a model: each case is one SpecError, raised before the engines are
built and before the run directory is made."""

from __future__ import annotations

from run_testkit import ROOT

from rollplex.errors import SpecError
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan

TINY = (ROOT / "specs/tiny_cpu.yaml").read_text()


class Built(Exception):
    """Raised in place of building the engines: the checks let the run through."""


def refused(tmp_path, monkeypatch, text: str, *, steps: int = 2, resume: bool = False) -> str:
    """The one line `train` refuses the spec with ("" where it went on to build); the run directory is made only
    by a run that goes on."""
    monkeypatch.setattr("rollplex.executors.loop.build_engines", lambda *a: (_ for _ in ()).throw(Built()))
    out = tmp_path / "run"
    existed = out.exists()
    plan = compile_plan(parse_spec(text, str(tmp_path / "spec.yaml"), tmp_path))
    try:
        train(plan, RunOptions(steps, out, resume=resume, progress=False, tensorboard=False))
    except Built:
        return ""
    except SpecError as e:
        assert out.exists() == existed
        return str(e)
    raise AssertionError("train returned without building")


def test_resume_needs_a_complete_checkpoint(tmp_path, monkeypatch):
    assert refused(tmp_path, monkeypatch, TINY) == ""  # the shipped spec goes on to build
    assert "--resume: no complete checkpoint" in refused(tmp_path, monkeypatch, TINY, resume=True)
    (tmp_path / "run/checkpoints/step-000001.tmp").mkdir(parents=True)  # a save cut short: nothing to resume
    assert "--resume: no complete checkpoint" in refused(tmp_path, monkeypatch, TINY, resume=True)
    (tmp_path / "run/metrics.jsonl").write_text('{"step": 1}\n')  # a run that saved none: where it can go on
    line = refused(tmp_path, monkeypatch, TINY, resume=True)
    assert "no complete checkpoint" in line and f"start again with another --out, or remove {tmp_path / 'run'}" in line


def test_resume_needs_steps_left_after_its_checkpoint(tmp_path, monkeypatch):
    (tmp_path / "run/checkpoints/step-000002").mkdir(parents=True)
    (tmp_path / "run/checkpoints/step-000002.bak").mkdir()  # a copy left beside: not a checkpoint
    line = refused(tmp_path, monkeypatch, TINY, steps=2, resume=True)
    assert "is step 2, and the run has 2 steps" in line and "raise --steps above 2" in line


def test_a_spec_too_large_for_this_machine_is_refused_where_auto_finds_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setattr("rollplex.executors.preflight.torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("rollplex.executors.preflight.os.sysconf", lambda name: 4096 if name == "SC_PAGE_SIZE" else 1)
    line = refused(tmp_path, monkeypatch, TINY)  # the shipped spec's run.device is auto
    assert "run.device: auto found no GPU" in line and "set run.device: cpu" in line
    assert refused(tmp_path, monkeypatch, TINY.replace("dtype: float32", "dtype: float32, device: cpu")) == ""


def test_missing_weights_dataset_and_reward_module_are_one_line_each(tmp_path, monkeypatch):
    line = refused(tmp_path, monkeypatch, TINY.replace("dtype: float32", "dtype: float32, init: checkpoint"))
    assert "run.init: checkpoint:" in line and "set run.init: random" in line
    line = refused(tmp_path, monkeypatch, TINY.replace("synthetic:colour@tiny", "missing.jsonl"))
    assert "workload.dataset: dataset 'missing.jsonl' is neither" in line
    line = refused(tmp_path, monkeypatch, TINY.replace("name: answer_format", 'name: "nosuch_module:fn"'))
    assert "algorithm.rewards: reward 'nosuch_module:fn': cannot import module" in line
    (tmp_path / "broken_reward.py").write_text("raise RuntimeError('the module fails')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    line = refused(tmp_path, monkeypatch, TINY.replace("name: answer_format", 'name: "broken_reward:fn"'))
    assert "importing it raised RuntimeError: the module fails" in line


def test_a_dataset_row_that_cannot_be_read_is_refused_before_anything_is_built(tmp_path, monkeypatch):
    (tmp_path / "rows.jsonl").write_text('{"problem": "x", "solution": "1", "path": "gone.mp4"}\n{"problem"\n')
    line = refused(tmp_path, monkeypatch, TINY.replace("synthetic:colour@tiny", "rows.jsonl"))
    assert "workload.dataset:" in line and "rows.jsonl:1: media file" in line and "gone.mp4 does not exist" in line


def test_a_fresh_run_into_an_earlier_runs_metrics_is_refused(tmp_path, monkeypatch):
    (tmp_path / "run").mkdir()
    (tmp_path / "run/metrics.jsonl").write_text("")  # a run that ended before its first step: nothing to keep
    assert refused(tmp_path, monkeypatch, TINY) == ""
    (tmp_path / "run/metrics.jsonl").write_text('{"step": 1}\n')
    assert "holds an earlier run's metrics.jsonl" in refused(tmp_path, monkeypatch, TINY)
    assert (tmp_path / "run/metrics.jsonl").read_text() == '{"step": 1}\n'


def test_without_a_gpu_the_host_pool_counts_with_the_devices_peaks(tmp_path, monkeypatch):
    """On the CPU the pinned pool is the same memory as the 'device's: the check needs both."""
    text = TINY.replace(
        "memory: {runtime_reserve_gib: 0.1}", "memory: {runtime_reserve_gib: 0.1, optimizer_state: host}"
    )
    r = compile_plan(parse_spec(text)).residency
    assert r.host.needed_bytes_per_node > 0
    need = r.peak_bytes + r.host.needed_bytes_per_node
    monkeypatch.setattr("rollplex.executors.preflight.torch.cuda.is_available", lambda: False)
    for have, says in ((need - 1, "run.device: auto found no GPU"), (need, "")):
        monkeypatch.setattr(
            "rollplex.executors.preflight.os.sysconf", lambda n, h=have: 1 if n == "SC_PAGE_SIZE" else h
        )
        line = refused(tmp_path, monkeypatch, text)
        assert says in line if says else line == ""
