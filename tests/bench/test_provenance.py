"""A result's commit: the environment's when it names one, else git's HEAD (dirty or not), else None."""

from __future__ import annotations

import subprocess

from rollplex.bench import provenance
from rollplex.bench.provenance import source_commit


def test_the_commit_is_the_environments_then_gits_head_marked_dirty_then_none(tmp_path, monkeypatch):
    monkeypatch.setenv("ROLLPLEX_COMMIT", "0" * 40)
    assert source_commit() == "0" * 40  # a copied tree names the code it holds
    monkeypatch.delenv("ROLLPLEX_COMMIT")
    git = lambda *a: subprocess.run(["git", "-C", str(tmp_path), *a], check=True, capture_output=True)  # noqa: E731
    git("init", "-q")
    (tmp_path / "f").write_text("one")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True).stdout
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    assert source_commit() == head.strip()
    (tmp_path / "f").write_text("two")  # a tracked file changed since
    assert source_commit() == head.strip() + "-dirty"
    monkeypatch.setattr(provenance, "ROOT", tmp_path / "f")  # no checkout there (not a directory)
    assert source_commit() is None
