"""`workload.dataset` -> a dataset: an unusable dataset is one clear line from the CLI, never a traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollplex.data.source import open_dataset
from rollplex.data.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[2]


def test_an_empty_dataset_file_is_a_value_error_saying_it_has_no_rows(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl has no rows"):
        open_dataset("empty.jsonl", CharTokenizer(), seed=0, base=tmp_path)


def test_checking_a_spec_over_an_empty_dataset_file_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    spec = tmp_path / "empty.yaml"
    spec.write_text((ROOT / "specs/tiny_cpu.yaml").read_text().replace("synthetic:colour@tiny", "empty.jsonl"))
    from rollplex.cli import main

    code, err = main(["compile", str(spec), "--dry-run", "--check-data"]), capsys.readouterr().err
    assert code != 0 and "workload.dataset" in err and "has no rows" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
