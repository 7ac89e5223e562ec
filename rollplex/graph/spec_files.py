"""The files a spec names, found without reading them: the dataset files of a non-synthetic `workload.dataset` and
`evaluation.dataset`, under `run.init: checkpoint` the model folder's weights, and the top-level package of each
reward given by import path (found, not imported: its code runs only in `rollplex run`). `rollplex run` refuses a
spec whose files are missing before it builds anything (`executors.preflight`), and the dry-run lists the same
(`report.tables`). No torch.
"""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from rollplex.graph.load import LoadedSpec
from rollplex.models.config import resolve_config_path

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def dataset_file(name: str, base: Path | None = None) -> Path:
    """The file a non-synthetic `workload.dataset` names (relative to `base`, the spec's folder); ValueError where
    there is none."""
    path = Path(name).expanduser()
    if not path.is_absolute() and base is not None:
        path = base / path
    if not path.is_file():
        raise ValueError(f"dataset '{name}' is neither 'synthetic:<preset>' nor an existing JSON/JSONL file")
    return path


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint folder: those its index names, or its one file."""
    if (directory / INDEX_FILE).is_file():
        weight_map = json.loads((directory / INDEX_FILE).read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / SINGLE_FILE).is_file():
        return [directory / SINGLE_FILE]
    raise FileNotFoundError(f"{directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")


def model_dir(loaded: LoadedSpec) -> Path:
    """The folder of the spec's model: its config, and its weights where `run.init` is checkpoint."""
    return resolve_config_path(loaded.spec.model.name, loaded.path.parent).parent


def initial_weights(loaded: LoadedSpec) -> str:
    """`run.init` resolved: "checkpoint" or "random" (auto: checkpoint where the model's folder holds weights; a
    shipped config's folder holds none)."""
    init = loaded.spec.run.init
    if init != "auto":
        return init
    try:
        folder = model_dir(loaded)
    except (FileNotFoundError, ValueError):
        return "random"  # no such model: the spec's check of `model` says so
    holds = (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()
    return "checkpoint" if holds else "random"


def missing_files(loaded: LoadedSpec) -> list[tuple[str, str]]:
    """(spec key, problem) for each file or reward module the spec names that is not there."""
    spec, found = loaded.spec, []
    if spec.run.init == "checkpoint":
        try:
            checkpoint_files(model_dir(loaded))
        except (FileNotFoundError, ValueError) as e:
            found.append(("run.init", f"checkpoint: {e}; or set run.init: random"))
    for reward in spec.algorithm.rewards:
        module = reward.name.partition(":")[0]
        top = module.split(".")[0]
        if ":" in reward.name and top and find_spec(top) is None:
            found.append(("algorithm.rewards", f"reward '{reward.name}': cannot import module '{module}' (no module "
                          f"named '{top}')"))  # fmt: skip
    datasets = {"workload.dataset": spec.workload.dataset}
    if spec.evaluation is not None and spec.evaluation.dataset is not None:
        datasets["evaluation.dataset"] = spec.evaluation.dataset
    for key, name in datasets.items():
        if not name.startswith("synthetic:"):
            try:
                dataset_file(name, loaded.path.parent)
            except ValueError as e:
                found.append((key, str(e)))
    return found
