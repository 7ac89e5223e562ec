"""Training checkpoints: weights (HF safetensors), optimizer state, RNG states and the data position.

Lifecycle of a checkpoint directory:

    step-000004.tmp (being written) --os.replace--> step-000004 (complete)

A crash or Ctrl-C while writing leaves only a `.tmp` directory, which loading ignores and the next save
removes; a complete directory is never half-written.
"""

from __future__ import annotations

import json
import pickle
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError

from rollplex.errors import RunFailed
from rollplex.executors.engines import Engines
from rollplex.graph.load import LoadedSpec
from rollplex.graph.spec_files import checkpoint_files, dataset_file, initial_weights
from rollplex.models.checkpoint import load_checkpoint, save_checkpoint, save_state
from rollplex.models.config import CONFIG_DIR, resolve_config_path
from rollplex.models.vision import hf_padded, hf_view
from rollplex.parallel.model import full_state, load_sharded


@dataclass(frozen=True)
class Snapshot:
    """What a checkpoint needs beyond weights and optimizer state, taken when a step completes."""

    step: int
    data_position: int
    torch_rng: torch.Tensor
    sampling_rng: torch.Tensor
    run: dict = field(default_factory=dict)  # `identity` of the spec that wrote it

    @staticmethod
    def of(step: int, data_position: int, engines: Engines, run: dict | None = None) -> Snapshot:
        return Snapshot(step, data_position, torch.get_rng_state(), engines.generator.get_state(), run or {})


def identity(loaded: LoadedSpec) -> dict:
    """The spec's settings that make a run the run it is, which a resume must keep: the model and its first weights,
    the data, the seed (of sampling, data order and random weights), the dtype and the algorithm; a model or dataset
    given by path as the file it names (however the path is written). The rest (the optimizer's settings, the
    memory plan, the schedule) a resumed run may change."""
    spec, base = loaded.spec, loaded.path.parent
    return {
        "model.name": _named(spec.model.name, lambda n: resolve_config_path(n, base), CONFIG_DIR),
        "run.init": initial_weights(loaded),  # resolved: auto resumes a run it started as either
        "workload.dataset": _named(spec.workload.dataset, lambda n: dataset_file(n, base)),
        "run.seed": spec.run.seed,
        "run.dtype": spec.run.dtype,
        "algorithm.name": spec.algorithm.name,
    }


def _named(name: str, resolve, shipped: Path | None = None) -> str:
    """A model or dataset as `identity` records it: a shipped config's or a synthetic preset's name, else the
    absolute path of the file it names (the name itself where it names none: the run's checks say so)."""
    if name.startswith("synthetic:"):
        return name
    try:
        path = resolve(name)
    except (OSError, ValueError):
        return name
    return name if shipped is not None and path.parent == shipped else str(path.resolve())


def identity_mismatch(path: Path, loaded: LoadedSpec) -> str | None:
    """The first setting of `identity` whose value in the spec differs from that of the run that wrote checkpoint
    `path` (as `KEY: WAS, the spec has NOW`), or None (also for a checkpoint older than the record)."""
    written = json.loads((path / "state.json").read_text()).get("run", {})
    for key, now in identity(loaded).items():
        if key in written and written[key] != now:
            auto = " (run.init auto, as resolved now: set run.init to what the run started with)"
            return f"{key}: {written[key]!r}, the spec has {now!r}" + (
                auto if key == "run.init" and loaded.spec.run.init == "auto" else ""
            )
    return None


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return out_dir / "checkpoints" / f"step-{step:06d}"


FULL_DISK_BYTES = 256 * 2**20  # free space under which a writer's failure is told as a full disk


def save(out_dir: Path, snap: Snapshot, engines: Engines, keep: int | None = None) -> Path:
    """Weights and optimizer state as they are now (they must be those of `snap.step`), written into a `.tmp`
    directory that becomes the checkpoint only when complete; a failed write on the way (a full disk) removes it
    and is a `RunFailed` that says the previous checkpoint is kept. `keep`: then only the newest `keep` complete
    checkpoints stay (`run.keep_checkpoints`).

    Under tensor parallelism every rank calls it: the weights are gathered into full HF tensors that rank 0
    writes, each rank writes its own optimizer state (`optimizer-rank{r}/part-*.pt`). Under data parallelism
    replica 0 writes, and with a sharded optimizer (ZeRO-1) every replica writes its share
    (`optimizer[-rank{r}]-dp{d}/`, flat pieces in the runtime's stored shapes: resume on the same layout)."""
    final = checkpoint_dir(out_dir, snap.step)
    tmp = final.with_name(final.name + ".tmp")
    if engines.update_beside_prefix:
        engines.optimizer.finish()  # a deferred update's weights and state complete
    try:
        saved = _save(final, tmp, snap, engines)
    except (OSError, RuntimeError, SafetensorError) as e:  # torch's and safetensors' writers raise their own
        why = getattr(e, "strerror", None) or (str(e).splitlines() or [type(e).__name__])[0][:200]
        free = shutil.disk_usage(tmp.parent).free if tmp.parent.exists() else None
        if isinstance(e, dist.DistError):  # a collective of the save, a peer rank gone (the launcher names it)
            why = f"another rank stopped answering ({type(e).__name__})"
        elif not getattr(e, "strerror", None) and free is not None and free < FULL_DISK_BYTES:  # a writer's own words
            why = f"the disk is full, {free / 2**20:.0f} MiB free: {why}"
        shutil.rmtree(tmp, ignore_errors=True)
        kept = latest(out_dir)
        raise RunFailed(f"checkpoint of step {snap.step} not written ({why}); "
                        f"{'kept ' + str(kept) if kept else 'no earlier checkpoint'}") from None  # fmt: skip
    if keep is not None and engines.is_main:
        prune(out_dir, keep, saved)
    return saved


def prune(out_dir: Path, keep: int, written: Path) -> list[Path]:
    """Removes all but the newest `keep` complete checkpoints of `out_dir`, never `written` (the one just saved);
    those removed. One that cannot be removed stays, with a line on stderr: the save itself succeeded."""
    others = sorted((p for p in complete(out_dir) if p != written), key=step_of)
    old, removed = others[: max(len(others) - (keep - 1), 0)], []
    for path in old:
        try:
            shutil.rmtree(path)
            removed.append(path)
        except OSError as e:
            print(f"rollplex: run.keep_checkpoints: {path} stays ({e.strerror or e})", file=sys.stderr, flush=True)
    return removed


def _save(final: Path, tmp: Path, snap: Snapshot, engines: Engines) -> Path:
    if engines.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    _barrier(engines)
    replica = engines.dp is not None and engines.dp.rank > 0  # a replica of replica 0's weights
    if replica and engines.optimizer.shard is None:  # and of its optimizer state
        return _finish(final, tmp, engines)
    if not replica:  # (a ZeRO-1 replica writes its share of the optimizer state only)
        _save_weights(tmp / "model", engines)
    parts = tmp / _optimizer_dir(engines)  # in parts: the whole state at once would double its host memory
    parts.mkdir()
    names = _optimizer_names(engines)
    for k, part in enumerate(engines.optimizer.state_parts()):
        torch.save(_in_hf_shapes(part, names, engines.actor.config.vision), parts / f"part-{k:05d}.pt")
        del part  # else it stays alive while the next part is gathered
    if engines.critic is not None and not replica:  # PPO's critic: its weights and its optimizer's parts
        torch.save(engines.critic.state_dict(), tmp / "critic.pt")
        (tmp / "critic-optimizer").mkdir()
        for k, part in enumerate(engines.critic_optimizer.state_parts()):
            torch.save(part, tmp / "critic-optimizer" / f"part-{k:05d}.pt")
    if engines.is_main:
        torch.save({"torch": snap.torch_rng, "sampling": snap.sampling_rng}, tmp / "rng.pt")
        state = {"step": snap.step, "data_position": snap.data_position, "run": snap.run}
        (tmp / "state.json").write_text(json.dumps(state))
    return _finish(final, tmp, engines)


def _save_weights(directory: Path, engines: Engines) -> None:
    """The actor as one HF model; under tensor parallelism gathered from every rank, written by rank 0."""
    if engines.tp is None:
        save_checkpoint(engines.actor, directory)
        return
    state = full_state(engines.actor, engines.tp.train, dst=0, to_host=True)  # every rank sends, rank 0 keeps
    if engines.is_main:
        save_state(state, engines.actor.config, directory)


def _finish(final: Path, tmp: Path, engines: Engines) -> Path:
    """Once every rank wrote its part: the complete `.tmp` directory becomes the checkpoint, and any other `.tmp`
    (a save killed midway, of another step) goes."""
    _barrier(engines)
    if engines.is_main:
        files = {str(f.relative_to(tmp)): f.stat().st_size for f in sorted(tmp.rglob("*")) if f.is_file()}
        (tmp / MANIFEST).write_text(json.dumps(files, indent=0))  # what `damage` finds missing or cut short
        if final.exists():
            shutil.rmtree(final)
        tmp.replace(final)
        for left in final.parent.glob("step-*.tmp"):
            shutil.rmtree(left, ignore_errors=True)
    _barrier(engines)
    return final


STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


def _optimizer_names(engines: Engines) -> list[str | None]:
    """The actor's name of each optimizer parameter (None for one the actor does not name)."""
    names = {id(p): n for n, p in engines.actor.named_parameters()}
    return [names.get(id(p)) for p in engines.optimizer.params]


def _in_hf_shapes(part: dict, names: list[str | None], vision) -> dict:
    """Optimizer state as transformers' shapes hold it: the vision MLPs' padding (`VisionMLP`) left out, as in
    the weights, so a checkpoint does not depend on how the runtime pads."""
    for i, entry in part["state"].items():
        if names[i] is not None and "range" not in entry:  # a ZeRO-1 share's flat piece stays as stored
            for key in STATE_KEYS:
                entry[key] = hf_view(names[i], entry[key], vision).contiguous()
    return part


def _in_stored_shapes(part: dict, engines: Engines, names: list[str | None]) -> dict:
    """The inverse of `_in_hf_shapes`: transformers-shaped state zero-padded to the parameters' stored shapes."""
    params, vision = engines.optimizer.params, engines.actor.config.vision
    for i, entry in part["state"].items():
        for key in STATE_KEYS:
            if entry.get(key) is not None and names[i] is not None and "range" not in entry:
                entry[key] = hf_padded(names[i], entry[key], params[i].shape, vision)  # another shape fails here
    return part


def _optimizer_dir(engines: Engines) -> str:
    name = "optimizer" if engines.tp is None else f"optimizer-rank{engines.tp.train.rank}"
    return name if engines.optimizer.shard is None else f"{name}-dp{engines.dp.rank}"


def _barrier(engines: Engines) -> None:
    if engines.tp is not None:
        engines.tp.barrier()
    if engines.dp is not None:
        dist.barrier()


def _load(file: Path):
    """A checkpoint file's tensors and plain values; anything else in it (a pickled object) is refused unread."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{file}: holds more than tensors and plain values, not loaded ({str(e)[:80]})") from None


_COMPLETE = re.compile(r"step-\d+")  # not `.tmp` (being written), nor a copy a user left beside (`.bak`)


def complete(out_dir: Path) -> list[Path]:
    """The complete checkpoints of run directory `out_dir`, in no order."""
    return [p for p in (out_dir / "checkpoints").glob("step-*") if _COMPLETE.fullmatch(p.name)]


def latest(out_dir: Path) -> Path | None:
    """The complete checkpoint of the highest step (by number: step-1000000 is after step-999999)."""
    found = complete(out_dir)
    return max(found, key=step_of) if found else None


MANIFEST = "files.json"  # each file of a checkpoint and its size, written last


def damage(path: Path) -> str | None:
    """What makes complete checkpoint `path` unreadable, found without reading its tensors (a file removed,
    truncated or overwritten since it was written), or None: each file of its manifest there at its size (a
    checkpoint written before manifests: the files a resume reads), each `.pt` file a zip (whose directory sits at
    its end), each safetensors file as long as its header says."""
    try:
        if (path / MANIFEST).is_file():
            for name, size in json.loads((path / MANIFEST).read_text()).items():
                if not (path / name).is_file():
                    return f"{name} is missing"
                if (path / name).stat().st_size != size:
                    return f"{name} holds {(path / name).stat().st_size} bytes, {size} when written"
        state = json.loads((path / "state.json").read_text())
        if not (isinstance(state, dict) and isinstance(state.get("step"), int) and "data_position" in state):
            return "state.json has no step and data position"
        files = checkpoint_files(path / "model")
        parts = sorted(path.glob("optimizer*/part-*.pt")) + sorted(path.glob("optimizer*.pt"))
        if not parts:
            return "no optimizer state"
        for file in files:
            _check_safetensors(file)
        for file in [path / "rng.pt", *parts, *path.glob("critic*.pt"), *path.glob("critic-optimizer/part-*.pt")]:
            zipfile.ZipFile(file).close()
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError, zipfile.BadZipFile) as e:
        return f"{type(e).__name__}: {e}"  # JSON's errors are ValueErrors; the rest, a file of another shape
    return None


def _check_safetensors(file: Path) -> None:
    with open(file, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size)) if 0 < size <= file.stat().st_size else None
    if not isinstance(header, dict):
        raise ValueError(f"{file.name} has no safetensors header")
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if file.stat().st_size != 8 + size + end:
        raise ValueError(f"{file.name} holds {file.stat().st_size} bytes, its header {8 + size + end}")


def step_of(path: Path) -> int:
    """The step a complete checkpoint (`step-NNNNNN`) holds."""
    return int(path.name.removeprefix("step-"))


def load(path: Path, engines: Engines) -> Snapshot:
    if engines.critic is None and (path / "critic.pt").is_file():
        raise ValueError(f"{path} holds a critic: it was written by a PPO run; resume it with its spec")
    if engines.tp is None:
        load_checkpoint(engines.actor, path / "model")
    else:
        load_sharded(engines.actor, path / "model", engines.tp.train)
    engines.publish()
    parts = sorted((path / _optimizer_dir(engines)).glob("part-*.pt"))
    legacy = path / f"{_optimizer_dir(engines)}.pt"  # the older layout: the whole state in one file
    if not parts and legacy.is_file():
        parts = [legacy]
    if not parts:
        raise ValueError(f"{path} has no {_optimizer_dir(engines)}/: resume with the train_tp that wrote it")
    covered: set[int] = set()
    names = _optimizer_names(engines)
    settings = engines.optimizer.config  # the spec's: a resumed run takes an edited lr, betas, ... from it
    for file in parts:  # one part in memory at a time
        part = _load(file)
        held = len(part["param_groups"][0]["params"])
        if held != len(engines.optimizer.params):  # before any reshaping: a toggled model.freeze_vision, say
            raise ValueError(f"{file} holds the state of {held} parameters, this run trains "
                             f"{len(engines.optimizer.params)}: resume with the spec that wrote it")  # fmt: skip
        engines.optimizer.load_state_dict(_in_stored_shapes(part, engines, names))
        covered |= set(part["state"])
        del part
    engines.optimizer.config = settings
    if covered != set(engines.optimizer.owned):
        raise ValueError(f"{path / _optimizer_dir(engines)} covers {len(covered)} of the optimizer's "
                         f"{len(engines.optimizer.owned)} parameters: an incomplete checkpoint")  # fmt: skip
    if engines.critic is not None:
        if not (path / "critic.pt").is_file():
            raise ValueError(f"{path} has no critic.pt: it was not written by a run with a critic")
        engines.critic.load_state_dict(_load(path / "critic.pt"))
        settings, covered = engines.critic_optimizer.config, set()
        for file in sorted((path / "critic-optimizer").glob("part-*.pt")):
            part = _load(file)
            engines.critic_optimizer.load_state_dict(part)
            covered |= set(part["state"])
        engines.critic_optimizer.config = settings
        if covered != set(engines.critic_optimizer.owned):
            raise ValueError(f"{path / 'critic-optimizer'} covers {len(covered)} of the critic optimizer's "
                             f"{len(engines.critic_optimizer.owned)} parameters: an incomplete checkpoint")  # fmt: skip
    rng = _load(path / "rng.pt")
    torch.set_rng_state(rng["torch"])
    engines.generator.set_state(rng["sampling"])
    state = json.loads((path / "state.json").read_text())
    return Snapshot(state["step"], state["data_position"], rng["torch"], rng["sampling"], state.get("run", {}))
