"""`run.init` resolved (`spec_files.initial_weights`): auto loads the weights of a model folder that holds them and
starts a shipped config from random weights; an explicit setting is kept; the dry-run's first line says which."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.graph.spec_files import INDEX_FILE, SINGLE_FILE, initial_weights
from rollplex.models.config import CONFIG_DIR
from rollplex.report.tables import header

SPEC = (Path(__file__).resolve().parents[2] / "specs" / "tiny_cpu.yaml").read_text()


def spec_in(folder: Path, model: str, init: str | None = None):
    text = SPEC.replace("model: tiny", f"model: {model}")
    if init is not None:
        text = text.replace("run: {", f"run: {{init: {init}, ")
    assert text != SPEC or model == "tiny"
    path = folder / "spec.yaml"
    path.write_text(text)
    return parse_spec(text, str(path), folder)


@pytest.mark.parametrize("weights", [SINGLE_FILE, INDEX_FILE, None])
def test_auto_loads_a_folder_that_holds_weights_and_starts_random_otherwise(tmp_path, weights):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((CONFIG_DIR / "tiny.json").read_text())
    if weights is not None:
        (model / weights).write_text(json.dumps({"weight_map": {}}))
    expected = "random" if weights is None else "checkpoint"
    assert initial_weights(spec_in(tmp_path, "model")) == expected
    assert initial_weights(spec_in(tmp_path, "model", "auto")) == expected
    assert initial_weights(spec_in(tmp_path, "model", "random")) == "random"  # asked for: kept
    line = header(compile_plan(spec_in(tmp_path, "model"))).splitlines()[0]
    assert line.endswith(f"weights from {model}" if weights else "random weights (seed 0)")


def test_a_shipped_config_starts_from_random_weights(tmp_path):
    assert initial_weights(spec_in(tmp_path, "tiny")) == "random"
    assert initial_weights(spec_in(tmp_path, "tiny", "checkpoint")) == "checkpoint"  # the preflight refuses it
