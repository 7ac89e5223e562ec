"""`rollplex compile --check-data`: the spec's budgets against its rendered data, on the CPU."""

from __future__ import annotations

from pathlib import Path

from rollplex.executors.datacheck import check_data
from rollplex.graph.load import load_spec

ROOT = Path(__file__).resolve().parents[2]


def test_the_tiny_spec_fits_its_budgets_and_the_plan_counts_its_visual_tokens():
    found = check_data(load_spec(ROOT / "specs/tiny_cpu.yaml"))
    assert found.num_prompts == 8 and 0 < found.shortest <= found.longest <= found.budget == 384
    assert found.visual_median == found.visual_planned  # 4 frames of 56 x 56: 2 x 2 x 2 tokens, as the plan says
    assert "budget 384" in found.line()


def test_a_prompt_over_the_budget_is_a_one_line_error_before_any_model_is_built(tmp_path, capsys):
    spec = tmp_path / "small.yaml"
    spec.write_text((ROOT / "specs/tiny_cpu.yaml").read_text().replace("prompt_tokens: 384", "prompt_tokens: 100"))
    from rollplex.cli import main

    code, err = main(["compile", str(spec), "--dry-run", "--check-data"]), capsys.readouterr().err
    assert code == 2 and "workload.prompt_tokens" in err and "over the budget 100" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
