"""Where a time plan's efficiencies (each phase's bound over its measured seconds) come from.

`rollplex compile --dry-run --efficiency SOURCE` predicts each phase's seconds at them (`graph.timeplan.time_plan`).
SOURCE is one of:
- `PHASE=E[,PHASE=E...]`: set by hand, each E in (0, 1], phases by their timer names (`TIMERS`),
  `prefix_backward` (the backward through the prefix, within `actor_suffix_backward`) or
  `actor_prefix_beside_update` (the actor prefix with the step before's update running on into it; without it a
  plan that runs them so prices each at its own efficiency, `graph.timeplan`) or `update_deferred` (the update's
  phase of a step whose update ran on into the next prefix: the wait for the gradient norm);
- a `rollplex run`'s `metrics.jsonl`: per phase, the median over its steps of `device_bound_s` / `time_s`, the
  first step left out when there are more (it compiles and plans; `run_efficiencies`), the steps that ran the
  update beside the actor prefix under the two keys above;
- a `rollplex bench` result (JSON): its `device_efficiency` for the plan's schedule, serial's for a phase it has
  none for (rollplex runs its prefixes beside decode; a prefix decode reads runs alone, as in serial), and its
  `prefix_backward_efficiency` likewise.
A run and a bench give `prefix_backward` where they timed it apart: an efficiency of its whole bound (the
saved tensors' way back from the host in it), which the plan's prefix backward is predicted at.
The time plan divides a phase's device bound (FLOPs and HBM bytes) by its efficiency and prices its host-link
traffic on its own, so a source's efficiency is of its device bound too; a source older than that field gives
its `bound_s` / `efficiency` (the link's time in it). What `rollplex run` prints at its end (`run_summary`) and a
bench's `efficiency` are of the whole bound.
A phase a source does not price stays unpredicted. A bad source is one `SpecError` line.
Without `--efficiency` the dry-run predicts at the efficiencies rollplex ships for the spec's model on its GPU under
its schedule (`recorded_efficiencies`, `recorded_efficiencies.json`: each entry what `read_efficiencies` gives for a
run's metrics or a bench result under `bench/results/`, named with its commit and command), where there are some.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from rollplex.errors import SpecError
from rollplex.graph.cost import TIMERS
from rollplex.graph.timeplan import PREFIX_BACKWARD, UPDATE_BESIDE, UPDATE_DEFERRED

RECORDED = Path(__file__).with_name("recorded_efficiencies.json")


@dataclass(frozen=True)
class Recorded:
    """Efficiencies measured for a model on a GPU under a schedule: `read_efficiencies` of `source`."""

    gpu: str
    model: str
    schedule: str
    source: str  # a run's metrics.jsonl or a bench's JSON, under the repository's bench/results/
    commit: str
    command: str
    efficiencies: dict[str, float]

    @property
    def line(self) -> str:
        return (
            f"predicted at the efficiencies measured for this model on this GPU ({self.source}, commit {self.commit})"
        )


def recorded_efficiencies(gpu: str, model: str, schedule: str) -> Recorded | None:
    """The efficiencies rollplex ships for `model` (a shipped config's name) on `gpu` under `schedule`, or None."""
    for entry in json.loads(RECORDED.read_text()):
        if (entry["gpu"], entry["model"], entry["schedule"]) == (gpu, model, schedule):
            return Recorded(**entry)
    return None


def read_efficiencies(source: str, schedule: str) -> dict[str, float]:
    """The efficiencies `source` gives (see the module), checked: known phases, finite values in (0, 1]."""
    path = Path(source)
    if "=" in source and not path.exists():
        found = _by_hand(source)
    elif path.suffix == ".jsonl":
        found = _of_run(path)
    else:
        found = _of_bench(path, schedule)
    for phase, e in found.items():
        if phase not in (*TIMERS, PREFIX_BACKWARD, UPDATE_BESIDE, UPDATE_DEFERRED):
            names = ", ".join((*TIMERS, PREFIX_BACKWARD, UPDATE_BESIDE, UPDATE_DEFERRED))
            raise SpecError("", f"--efficiency {source}: no phase {phase!r}", f"name one of {names}")
        if not (math.isfinite(e) and 0 < e <= 1):
            raise SpecError("", f"--efficiency {source}: {phase} {e:g} is not in (0, 1]")
    return found


def _by_hand(source: str) -> dict[str, float]:
    found = {}
    for item in source.split(","):
        phase, _, value = item.partition("=")
        try:
            found[phase.strip()] = float(value)
        except ValueError:
            raise SpecError("", f"--efficiency {source}: {item!r} is not PHASE=NUMBER") from None
    return found


def _of_run(path: Path) -> dict[str, float]:
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        found = run_efficiencies(records, device=True, split_beside=True)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecError("", f"--efficiency {path}: not a run's metrics with bounds ({e})") from None
    if not found:
        raise SpecError("", f"--efficiency {path}: no step with a phase's bound and seconds")
    return found


def _warm(records: list[dict]) -> list[dict]:
    """The steps after the first (it compiles and plans), or the one step there is."""
    return records[1:] if len(records) > 1 else records


def run_efficiencies(records: list[dict], device: bool = False, split_beside: bool = False) -> dict[str, float]:
    """Per phase of a run's metrics records, the median over its warm steps of `bound_s` (`device`: of
    `device_bound_s`, where a record has it: a run resumed across its introduction has both kinds) over `time_s`; a
    phase run beside another (no seconds of its own) or with no bound is left out. With them, `prefix_backward`
    where the steps timed it apart. `split_beside`: a step whose actor prefix ran with the step before's update in it
    (`update_beside_prefix` in its record) gives that prefix's efficiency as UPDATE_BESIDE, and one whose own update
    ran on past it (`update_deferred`) its update's as UPDATE_DEFERRED, so that a plan that runs the two apart is
    not priced at them (records older than those keys count as apart)."""
    ratios: dict[str, list[float]] = {}
    for record in _warm(records):
        bounds = record.get("device_bound_s", record["bound_s"]) if device else record["bound_s"]
        times = record["time_s"]
        if record.get("prefix_backward_bound_s"):
            bounds = {**bounds, PREFIX_BACKWARD: record["prefix_backward_bound_s"]}
            times = {**times, PREFIX_BACKWARD: record["prefix_backward_s"]}
        if split_beside:
            keys = {"actor_prefix": UPDATE_BESIDE if record.get("update_beside_prefix") else "actor_prefix",
                    "update": UPDATE_DEFERRED if record.get("update_deferred") else "update"}  # fmt: skip
            bounds = {keys.get(k, k): v for k, v in bounds.items()}
            times = {keys.get(k, k): v for k, v in times.items()}
        for phase, bound in bounds.items():
            seconds = times.get(phase, 0.0)
            if bound > 0 and seconds > 0:
                ratios.setdefault(phase, []).append(bound / seconds)
    return {phase: statistics.median(r) for phase, r in ratios.items()}


def run_summary(records: list[dict]) -> str:
    """One line of a run's phases over its warm steps: the median seconds of each phase that has seconds of its own,
    slowest first, with its median bound and its efficiency where it has a bound (the median of the steps'
    bound / seconds, as `--efficiency` reads it: not always the ratio of the two medians); then the step's."""
    warm = _warm(records)
    efficiency = run_efficiencies(records)
    median = lambda key, phase: statistics.median(r[key].get(phase, 0.0) for r in warm)  # noqa: E731
    timed = [phase for phase in warm[0]["time_s"] if phase != "step" and median("time_s", phase) > 0]
    cells = [
        f"{phase} {median('time_s', phase):.2f} s"
        + (f" (bound {median('bound_s', phase):.2f}, {efficiency[phase]:.2f})" if phase in efficiency else "")
        + (_prefix_backward(warm) if phase == "actor_suffix_backward" else "")
        for phase in sorted(timed, key=lambda phase: -median("time_s", phase))
    ]
    first, last = warm[0]["step"], warm[-1]["step"]
    steps = f"step {first}" if first == last else f"steps {first}-{last}"
    return f"phases, medians of {steps} (seconds, bound, efficiency): " + "; ".join(
        [*cells, f"step {statistics.median(r['time_s']['step'] for r in warm):.2f} s"]
    )


def _prefix_backward(warm: list[dict]) -> str:
    """The backward through the prefix within the actor's suffix + backward, where the steps timed it apart."""
    parts = [(r["prefix_backward_s"], r["prefix_backward_bound_s"]) for r in warm if r.get("prefix_backward_bound_s")]
    if len(parts) < len(warm) or not all(seconds > 0 for seconds, _ in parts):
        return ""
    seconds, bound = (statistics.median(x) for x in zip(*parts, strict=True))
    ratio = statistics.median(b / s for s, b in parts)
    return f", of it the backward through the prefix {seconds:.2f} s (bound {bound:.2f}, {ratio:.2f})"


def _of_bench(path: Path, schedule: str) -> dict[str, float]:
    try:
        result = json.loads(path.read_text())
        device, whole = result.get("device_efficiency", {}), result["efficiency"]
        of = lambda s: device.get(s) or whole.get(s, {})  # noqa: E731  (an older bench or baseline: the whole's)
        found = {k: float(v) for k, v in {**of("serial"), **of(schedule)}.items()}  # serial's for a phase run alone
        prefix = result.get("prefix_backward_efficiency") or {}
        if (e := prefix.get(schedule) or prefix.get("serial")) is not None:
            found[PREFIX_BACKWARD] = float(e)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecError("", f"--efficiency {path}: not a bench result with efficiencies ({e})") from None
    if not found:  # a CPU bench: no bounds there
        raise SpecError("", f"--efficiency {path}: a bench result without efficiencies (run on a CPU?)",
                        "give a GPU bench's")  # fmt: skip
    return found
