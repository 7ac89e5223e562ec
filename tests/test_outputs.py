"""`check_output`: a command's output path is refused in one line before the work when its folder is missing (or
cannot be made), the path is a folder, or this user cannot write there; `rollplex bench` and `rollplex compile` check
every output flag before a step runs or a plot is drawn."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from rollplex.cli import main
from rollplex.errors import SpecError
from rollplex.outputs import check_output

SPECS = Path(__file__).resolve().parents[1] / "specs"


def test_a_missing_folder_is_refused_unless_made_and_a_folder_is_no_file(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        check_output("--out", tmp_path / "a" / "r.json")
    assert check_output("--out", tmp_path / "a" / "r.json", create=True) == tmp_path / "a" / "r.json"
    assert (tmp_path / "a").is_dir()
    with pytest.raises(SpecError, match="is a folder"):
        check_output("--out", tmp_path / "a")
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecError, match="cannot create"):
        check_output("--out", tmp_path / "file" / "sub" / "r.json", create=True)


def unwritable(monkeypatch, folder: Path) -> None:
    """`folder` as a read-only mount shows it, whoever runs the tests (root writes anywhere else)."""
    access = os.access
    monkeypatch.setattr("rollplex.outputs.os.access", lambda p, mode: Path(p) != folder and access(p, mode))


def test_a_folder_this_user_cannot_write_is_refused(tmp_path, monkeypatch):
    unwritable(monkeypatch, tmp_path)
    with pytest.raises(SpecError, match="this user cannot write there") as error:
        check_output("--plot", tmp_path / "m.png")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("flag", ["--out", "--save-serial", "--save-unsplit"])
def test_bench_refuses_an_unwritable_output_before_any_step(tmp_path, monkeypatch, capsys, flag):
    monkeypatch.chdir(tmp_path)  # the default result folder is made here, not in the checkout
    unwritable(monkeypatch, tmp_path / "ro")
    (tmp_path / "ro").mkdir()
    monkeypatch.setattr("rollplex.bench.command.run_schedule", lambda *a, **k: pytest.fail("a step ran"))
    args = [flag, str(tmp_path / "ro" / "x.json")] + (["--serial-only"] if flag == "--save-serial" else [])
    assert main(["bench", str(SPECS / "tiny_cpu.yaml"), *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"rollplex: {flag} ") and "cannot write there" in line


def test_compile_refuses_an_unwritable_plot_or_plan_before_the_work(tmp_path, monkeypatch, capsys):
    unwritable(monkeypatch, tmp_path)
    monkeypatch.setattr("rollplex.graph.load.load_spec", lambda *a: pytest.fail("the spec was loaded"))
    for args in (["--dry-run", "--plot", str(tmp_path / "m.png")], ["-o", str(tmp_path / "plan.json")]):
        assert main(["compile", str(SPECS / "tiny_cpu.yaml"), *args]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "cannot write there" in line


@pytest.mark.parametrize(
    ("command", "absent"),
    [(["run"], "PIL"), (["run"], "torch"), (["bench"], "matplotlib"), (["compile", "--dry-run", "--plot", "m.png"],
                                                                        "matplotlib")],
)  # fmt: skip
def test_a_command_whose_packages_are_not_installed_says_which_and_how_in_one_line(monkeypatch, capsys, command,
                                                                                     absent):  # fmt: skip
    """The base install plans only: `run`, `bench` and `--plot` name what they miss before any work."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == absent else find_spec(name, *a))
    monkeypatch.setattr("rollplex.bench.command.bench", lambda args: pytest.fail("the bench ran"))
    monkeypatch.setattr("rollplex.executors.loop.train", lambda *a: pytest.fail("the run started"))
    assert main([command[0], str(SPECS / "tiny_cpu.yaml"), *command[1:]]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"needs {absent}, not installed" in line and "pip install 'rollplex[train]'" in line
    assert ("pip install torch" in line) == (absent == "torch")


def test_bench_refuses_a_result_path_of_another_suffix_or_a_folder(tmp_path, capsys):
    for out in (tmp_path / "b.txt", tmp_path):
        assert main(["bench", str(SPECS / "tiny_cpu.yaml"), "--out", str(out)]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert "the result is a JSON file" in line and "end it in .json" in line


def test_a_bench_that_saves_a_run_only_neither_checks_nor_makes_the_result_folder(tmp_path, monkeypatch):
    """--save-unsplit writes its run, not a result: an --out it never writes is not made (nor refused)."""
    from rollplex.bench import command

    monkeypatch.setattr(command, "_save_unsplit", lambda *a: 0)
    out = tmp_path / "never" / "r.json"
    args = ["--save-unsplit", str(tmp_path / "u.pt"), "--out", str(out)]
    assert main(["bench", str(SPECS / "tiny_cpu.yaml"), *args]) == 0
    assert not out.parent.exists()
