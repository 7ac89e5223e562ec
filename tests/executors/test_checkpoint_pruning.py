"""`run.keep_checkpoints`: after each save only the newest K complete checkpoints stay, never the one just written; a
resume goes on from them to an uninterrupted run's weights; one that cannot be removed stays with a line said."""

from run_testkit import run


def test_keep_checkpoints_leaves_the_newest_and_a_resume_goes_on_from_them(tmp_path):
    """`run.keep_checkpoints: 2` with a save every step: after 4 steps, steps 3 and 4 stay; resumed to 5, steps 4
    and 5; the resumed run's weights are those of an uninterrupted one."""
    kept = run(tmp_path, "rollplex", 4, name="kept", checkpoint_every=1, keep_checkpoints=2)
    names = lambda: sorted(p.name for p in (tmp_path / "kept" / "checkpoints").iterdir())  # noqa: E731
    assert names() == ["step-000003", "step-000004"]
    rest = run(tmp_path, "rollplex", 5, name="kept", resume=True, checkpoint_every=1, keep_checkpoints=2)
    assert names() == ["step-000004", "step-000005"]
    whole = run(tmp_path, "rollplex", 5, name="whole", checkpoint_every=100)
    assert [r["param_digest"] for r in kept + rest] == [r["param_digest"] for r in whole]


def test_pruning_never_removes_the_checkpoint_just_written_and_reports_one_it_cannot_remove(tmp_path, capsys,
                                                                                             monkeypatch):  # fmt: skip
    from rollplex.executors.checkpointing import prune

    for step in (1, 2, 3, 9):  # step 9: a later run's, left in the folder
        (tmp_path / "checkpoints" / f"step-{step:06d}").mkdir(parents=True)
    written = tmp_path / "checkpoints" / "step-000003"
    assert [p.name for p in prune(tmp_path, 2, written)] == ["step-000001", "step-000002"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003", "step-000009"]

    def refuse(path):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("rollplex.executors.checkpointing.shutil.rmtree", refuse)
    assert prune(tmp_path, 1, written) == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line == f"rollplex: run.keep_checkpoints: {tmp_path / 'checkpoints' / 'step-000009'} stays (Permission denied)"
    )
