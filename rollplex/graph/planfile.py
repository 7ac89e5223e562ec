"""`plan.json`: a compiled plan, complete and versioned, that `rollplex run plan.json` executes.

The file holds what the runtime reads: the validated spec, the model config, the schedule, the graph (ops,
tensors, steps, lifetimes) and the decisions; beside them the memory report of `report.jsonout` for people
and tools. Reading it rebuilds the plan from the file's graph and decisions alone (the memory report is
priced again from them), so an edited decision is the one that runs. A file of another version is refused in
one line.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import networkx as nx
from pydantic import ValidationError

from rollplex.errors import SpecError
from rollplex.graph.decisions import Decisions
from rollplex.graph.ir import (
    Executor,
    Lifetime,
    MiniBatch,
    NodeKind,
    Op,
    Part,
    Phase,
    Role,
    Schedule,
    Step,
    TensorClass,
    TensorInfo,
    lifetimes,
    make_graph,
    ops,
    steps,
    tensors,
)
from rollplex.graph.load import LoadedSpec, check_model_fits_parallel
from rollplex.graph.plan import RECOMPUTE_SETTINGS, Plan, plan_of
from rollplex.graph.spec import Spec
from rollplex.graph.verify import VerifyError, verify
from rollplex.models.config import ModelConfig

PLAN_VERSION = 7


def plan_dict(plan: Plan) -> dict:
    """What `plan.json` holds (the runtime's part; `report.jsonout.plan_to_json` adds the memory report)."""
    loaded = plan.loaded
    return {
        "rollplex_plan_version": PLAN_VERSION,
        "spec_path": str(loaded.path.resolve()),
        "spec": loaded.spec.model_dump(mode="json", by_alias=True),
        "model_config": asdict(loaded.model),
        "schedule": plan.schedule.value,
        "ops": [_op_dict(o) for o in ops(plan.graph)],
        "tensors": [_tensor_dict(t) for t in tensors(plan.graph).values()],
        "steps": [{"index": s.index, "phase": int(s.phase), "ops": list(s.ops)} for s in steps(plan.graph)],
        "lifetimes": {name: [life.first, life.last] for name, life in lifetimes(plan.graph).items()},
        "decisions": plan.decisions.as_dict(),
    }


def is_plan_file(path: str | Path) -> bool:
    """Whether `path` is a plan file (a `.json` holding `rollplex_plan_version`); a spec may be written in JSON too."""
    path = Path(path)
    if path.suffix != ".json":
        return False
    try:
        text = path.read_text()
        data = json.loads(text)
    except (OSError, UnicodeDecodeError):
        return False  # a spec's reader says what is wrong with it, line by line
    except json.JSONDecodeError:
        return "rollplex_plan_version" in text  # a plan cut short (`read_plan` says where), else a spec's error
    return isinstance(data, dict) and "rollplex_plan_version" in data


def read_plan(path: str | Path) -> Plan:
    """The plan a `plan.json` holds; any problem with the file is one `SpecError` naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpecError("", f"cannot read the plan: {e}", "write it again with `rollplex compile SPEC -o FILE`",
                        file=str(path)) from None  # fmt: skip
    version = data.get("rollplex_plan_version") if isinstance(data, dict) else None
    if version != PLAN_VERSION:
        raise SpecError("", f"plan version {version!r}, this rollplex reads version {PLAN_VERSION}",
                        "compile the spec again with this rollplex", file=str(path))  # fmt: skip
    try:
        spec = Spec.model_validate(data["spec"])
        unsettled = [key for key in RECOMPUTE_SETTINGS if getattr(spec.memory, key) == "auto"]
        if unsettled:  # a plan holds what the compiler chose, never auto
            raise ValueError(f"its spec has memory.{unsettled[0]} auto")
        model = ModelConfig.from_dict(data["model_config"])
        check_model_fits_parallel(spec, model)
        loaded = LoadedSpec(spec, model, Path(data["spec_path"]))
        return plan_of(loaded, Schedule(data["schedule"]), _graph(data), Decisions.from_dict(data["decisions"]))
    except (KeyError, TypeError, ValueError, ValidationError, SpecError) as e:
        what = f"missing key {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        if isinstance(e, ValidationError):
            first = e.errors()[0]
            what = f"spec.{'.'.join(str(x) for x in first['loc'])}: {first['msg']}"
        raise SpecError("", f"malformed plan ({what})", "write it again with `rollplex compile SPEC -o FILE`",
                        file=str(path)) from None  # fmt: skip


def _tensor_dict(t: TensorInfo) -> dict:
    return {"name": t.name, "class": t.cls.value, "response_dependent": t.response_dependent}


def _op_dict(o: Op) -> dict:
    return {
        "id": o.id,
        "kind": o.kind.value,
        "role": o.role.value if o.role else None,
        "inputs": list(o.inputs),
        "outputs": list(o.outputs),
        "part": o.part.value,
        "source": o.source,
        "index": o.index,
        "phase": int(o.phase),
        "executor": o.executor.value,
        "minibatch": [o.minibatch.index, o.minibatch.count] if o.minibatch else None,
        "fused_into": o.fused_into,
        "fuses": list(o.fuses),
    }


def _op(d: dict) -> Op:
    return Op(
        id=d["id"],
        kind=NodeKind(d["kind"]),
        role=Role(d["role"]) if d["role"] else None,
        inputs=tuple(d["inputs"]),
        outputs=tuple(d["outputs"]),
        part=Part(d["part"]),
        source=d["source"],
        index=d["index"],
        phase=Phase(d["phase"]),
        executor=Executor(d["executor"]),
        minibatch=MiniBatch(*d["minibatch"]) if d["minibatch"] else None,
        fused_into=d["fused_into"],
        fuses=tuple(d["fuses"]),
    )


def _graph(data: dict) -> nx.DiGraph:
    infos = {t["name"]: TensorInfo(t["name"], TensorClass(t["class"]), t["response_dependent"])
             for t in data["tensors"]}  # fmt: skip
    g = make_graph([_op(d) for d in data["ops"]], infos)
    g.graph["steps"] = tuple(Step(s["index"], Phase(s["phase"]), tuple(s["ops"])) for s in data["steps"])
    g.graph["lifetimes"] = {name: Lifetime(first, last) for name, (first, last) in data["lifetimes"].items()}
    if not data["ops"]:
        raise ValueError("its graph has no ops")
    try:
        verify(g)  # an edited graph holds the compiler's invariants, or is refused here rather than mid-run
    except VerifyError as e:
        raise ValueError(f"its graph: {e}") from None
    return g
