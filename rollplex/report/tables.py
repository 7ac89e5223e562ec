"""The dry-run report: readable text tables of a compiled plan."""

from __future__ import annotations

import shlex

from rollplex.graph.cost import reference_page_ins
from rollplex.graph.ir import op, ops, prefilled_decodes, steps
from rollplex.graph.levers import faster_recompute, faster_residencies
from rollplex.graph.memobject import GIB, Component, MemObject, Residency, held
from rollplex.graph.modelcost import KNOWN_PEAKS
from rollplex.graph.plan import Plan
from rollplex.graph.refusals import run_refusals
from rollplex.graph.spec import Spec
from rollplex.graph.spec_files import initial_weights, missing_files, model_dir
from rollplex.graph.spec_runtime import RunSpec, scoring_choice
from rollplex.graph.timeplan import (
    PREFIX_BACKWARD,
    overlapped_timers,
    predicted_step_s,
    prefix_backward_plan,
    step_bound_s,
    time_plan,
)


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: list[str]) -> str:
        out = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(out).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def gib(b: int) -> str:
    return f"{b / GIB:.2f}"


def _first_weights(plan: Plan) -> str:
    """Where the run's first weights come from (`run.init`, resolved)."""
    if initial_weights(plan.loaded) == "checkpoint":
        return f"weights from {model_dir(plan.loaded)}"
    return f"random weights (seed {plan.loaded.spec.run.seed})"


def header(plan: Plan) -> str:
    s, g = plan.loaded.spec, plan.context.gpu
    return (
        f"{plan.loaded.model.name}: {s.cluster.nodes} x {s.cluster.gpus_per_node} GPUs of {s.cluster.hbm_gib:g} GiB, "
        f"train TP {g.train_tp} (DP {g.train_dp}), rollout TP {g.rollout_tp} ({g.num_rollout_replicas} replicas), "
        f"schedule {plan.schedule.value}, {_first_weights(plan)}\n"
        f"per training rank: {g.prompts_per_rank} prompts x {g.group_size} responses, {g.prompt_tokens} prompt "
        f"tokens ({g.visual_tokens} visual), {g.response_tokens} response tokens\n"
        f"rollout: {rollout_line(plan)}\n"
        + evaluation_line(s)
        + f"scoring attention on a GPU: {scoring_line(s.run)}"
        + _dtype_note(s.run.dtype)
    )


def evaluation_line(spec: Spec) -> str:
    """The spec's held-out evaluation, a line ending in a newline ("" without one)."""
    ev, w = spec.evaluation, spec.workload
    if ev is None:
        return ""
    prompts = ev.prompts or w.prompts_per_step
    batches = prompts // w.prompts_per_step
    source = ev.dataset or f"{w.dataset}'s held-out examples"
    return (
        f"evaluation: {'before step 1, ' if ev.at_start else ''}every {ev.every} step{'s' if ev.every > 1 else ''} "
        f"and after the last, {prompts} prompts of {source}, in {batches} rollout{'s' if batches > 1 else ''} of a "
        f"step's {w.prompts_per_step} prompts x {w.group_size} samples (not in the time plan)\n"
    )


def scoring_line(run: RunSpec) -> str:
    """What the packed suffix's attention runs on a GPU (`run.suffix_attention`, as the runtime resolves it; the
    CPU scores with SDPA and a dense mask)."""
    choice = scoring_choice(run)
    if choice == "flex":
        return f"FlexAttention (run.suffix_attention {run.suffix_attention})"
    backward = ""
    if run.deterministic:  # whether its workspace fits is known once cuDNN builds the graphs, on the GPU
        otherwise = "FlexAttention" if choice == "auto" else "a spec error"
        backward = "; run.deterministic: cuDNN's deterministic backward where its workspace fits "
        backward += f"memory.runtime_reserve_gib, else {otherwise}"
    if choice == "cudnn":
        return "cuDNN's ragged calls (run.suffix_attention cudnn; needs cudnn-frontend)" + backward
    return "auto (cuDNN's ragged calls where cudnn-frontend is installed, else FlexAttention)" + backward


def _dtype_note(dtype: str) -> str:
    """The plan prices the GPU's BF16 weights and activations; a float32 run (the CPU's tests) holds about twice."""
    if dtype != "float32":
        return ""
    return "\nrun.dtype float32: the plan prices weights and activations in BF16; this run holds about twice them"


def rollout_line(plan: Plan) -> str:
    """Where the rollout's prefill comes from (`run.rollout_prefill`, as the graph reads it) and its decode kernels."""
    run = plan.loaded.spec.run
    from_actor = bool(prefilled_decodes(ops(plan.graph)))
    prefill = "decodes from the actor prefix's boundary, no prefill" if from_actor else "the engine prefills"
    missing = plan.loaded.spec.actor_prefill_missing()
    why = f": actor_prefix needs {missing[0]}" if missing and run.rollout_prefill == "auto" else ""
    kernels = run.decode_kernels
    if kernels == "auto":
        kernels = "auto (rollplex_fused on Hopper or newer, else cublas)"
    return f"{prefill} (run.rollout_prefill {run.rollout_prefill}{why}); decode kernels {kernels}"


def launch_command(nodes: int, gpus_per_node: int, spec: str = "SPEC", command: str = "run") -> str:
    """The command that starts one process per GPU of a cluster of `nodes` x `gpus_per_node` (the spec's path
    quoted for a shell): `rollplex run` starts one node's processes itself (`executors.launch`), `rollplex bench`
    and several nodes go through torchrun."""
    spec = shlex.quote(spec)
    if nodes * gpus_per_node == 1 or (nodes == 1 and command == "run"):
        return f"rollplex {command} {spec}"
    if nodes == 1:
        return f"torchrun --nproc-per-node {gpus_per_node} -m rollplex {command} {spec}"
    return (f"torchrun --nnodes {nodes} --nproc-per-node {gpus_per_node} --node-rank R --rdzv-backend c10d "
            f"--rdzv-endpoint HOST:PORT -m rollplex {command} {spec}   (on each node R)")  # fmt: skip


def launch_lines(plan: Plan) -> str:
    """How many processes the spec needs, the command that starts them, and which ranks form each group: TP
    groups of consecutive ranks, DP groups of the same TP position, rollout replicas of one rank per q-rank
    exchange group (q = train_tp / rollout_tp) within each TP group."""
    s = plan.loaded.spec
    nodes, per_node, t, r = s.cluster.nodes, s.cluster.gpus_per_node, s.parallel.train_tp, s.parallel.rollout_tp
    world, q = nodes * per_node, t // r
    command = launch_command(nodes, per_node, str(plan.loaded.path))
    tp = [list(range(first, first + t)) for first in range(0, world, t)]
    dp = [list(range(j, world, t)) for j in range(t)]
    replicas = [group[j::q] for group in tp for j in range(q)]
    lines = [f"processes: {world} ({nodes} node(s) x {per_node}); launch: {command}"]
    for name, groups in (("TP groups", tp), ("DP groups", dp), ("rollout replicas", replicas)):
        if max(len(g) for g in groups) > 1:
            shown = " ".join("[" + ",".join(map(str, g)) + "]" for g in groups[:8])
            lines.append(f"{name}: {shown}{' ...' if len(groups) > 8 else ''}")
    where = {"any": "", "cuda": "; on a GPU", "cpu": "; on the CPU"}
    refused = [f"{r.key} ({r.problem}{where[r.on]})" for r in run_refusals(s)]
    refused += [f"{key} ({problem})" for key, problem in missing_files(plan.loaded)]
    if refused:
        lines.append("rollplex run refuses, as the spec stands: " + "; ".join(refused))
    return "\n".join(lines)


def graph_table(plan: Plan) -> str:
    rows = []
    for s in steps(plan.graph):
        for i, n in enumerate(s.ops):
            o = op(plan.graph, n)
            phase = (
                s.phase.title if i == 0 and (s.index == 0 or steps(plan.graph)[s.index - 1].phase != s.phase) else ""
            )
            role = o.role.value if o.role else "-"
            rows.append([phase, str(s.index) if i == 0 else "", n, o.kind.value, role, o.executor.value])
    return "Graph by phase and executor\n" + table(["phase", "step", "op", "kind", "role", "executor"], rows)


def memory_table(plan: Plan) -> str:
    r = plan.residency
    rows = []
    at_peak = [held(r.objects, p.peak_step) for p in r.phases]
    for vision in (False, True):
        for o in (o for o in r.objects if o.vision is vision):
            cells = [_cell(o, top, p.peak_step, p.steps) for p, top in zip(r.phases, at_peak, strict=True)]
            if any(c != "-" for c in cells):
                rows.append([o.role, ("vision " if vision else "") + o.label, o.cls.value, *cells])
    rows.append(["", "peak", "", *[gib(p.peak_bytes) for p in r.phases]])
    heads = ["role", "object", "class", *[f"P{int(p.phase)} GiB" for p in r.phases]]
    note = "HBM GiB at each phase's peak step; host = pinned pool, dropped = rebuilt when needed"
    lines = [f"Memory per GPU by phase and role ({note})", table(heads, rows, right={3, 4, 5})]
    if any(o.turn for o in r.objects):
        lines.append(
            "(GiB) = in HBM elsewhere in the phase: in another step, or in the other turn of a backward step (a suffix"
            " microbatch's activations are freed before the backward through the prefix holds its layer in flight)"
        )
    return "\n".join(lines)


def _cell(o: MemObject, at_peak: list[MemObject], peak_step: int, idx: tuple[int, ...]) -> str:
    if o in at_peak:
        return gib(o.bytes)
    if any(i in o.live for i in idx):
        return f"({gib(o.bytes)})"  # in HBM in another step of the phase, or another turn of its peak step
    where = o.residency(peak_step)
    if where is Residency.HOST and o.host_bytes:
        return f"host {gib(o.host_bytes)}"
    return where.value


def peak_table(plan: Plan) -> str:
    r = plan.residency
    rows = [
        [
            p.phase.title,
            gib(p.peak_bytes),
            gib(r.capacity_bytes),
            gib(r.capacity_bytes - p.peak_bytes),
            "yes" if p.peak_bytes <= r.capacity_bytes else "NO",
        ]
        for p in r.phases
    ]
    h = r.host
    lines = [
        "Peak vs capacity per GPU",
        table(["phase", "peak GiB", "capacity", "headroom", "fits"], rows, right={1, 2, 3}),
        f"pinned host pool per node: {gib(h.pinned_bytes_per_node)} GiB of {gib(h.capacity_bytes_per_node)} GiB"
        + ("" if h.fits else "  (DOES NOT FIT)"),
    ]
    if r.optimizer:
        o = r.optimizer
        how = f"streamed, {o.pipeline_depth} in flight" if o.pipeline_depth else "updated in HBM"
        lines.append(
            f"optimizer: {gib(o.state_bytes)} GiB FP32 state in {o.num_chunks} chunks of "
            f"{o.chunk_bytes / 2**20:.0f} MiB, {how} ({gib(o.workspace_bytes)} GiB workspace)"
        )
    return "\n".join(lines)


def sharing_table(plan: Plan) -> str:
    sh = plan.sharing
    rows = [
        [e.family.name, str(e.family.count), f"{e.family.params / 1e9:.3f}", str(int(e.case)), e.reason]
        for e in sh.entries
    ]
    summary = ", ".join(f"Case {c}: {sh.case_params[c] / 1e9:.2f} B ({sh.percent(c):.1f} %)" for c in (1, 2, 3))
    return (
        f"Actor weight sharing, train TP {sh.train_tp} -> rollout TP {sh.rollout_tp} (LLM parameters)\n"
        + table(["tensor", "count", "params (B)", "case", "why"], rows, right={1, 2})
        + f"\n{summary}; "
        + (
            "Case 3 read in place, no copy"
            if sh.in_place
            else f"Case-3 buffer {gib(sh.case3_buffer_bytes_per_gpu)} GiB per GPU"
        )
        + f"\npublishing an update: each GPU receives {gib(sh.exchange_bytes_per_gpu)} GiB from its "
        + f"{sh.train_tp // sh.rollout_tp - 1} peer(s) (no copy of its own part)"
    )


def naive_table(plan: Plan) -> str:
    rows = [[x.role, ("vision " if x.vision else "") + x.component, gib(x.bytes)] for x in plan.naive]
    llm = sum(x.bytes for x in plan.naive if not x.vision)
    vision = sum(x.bytes for x in plan.naive if x.vision)
    cap = plan.residency.capacity_bytes
    verdict = "fits" if llm + vision <= cap else "does NOT fit"
    return (
        "Naive colocation: everything resident at once, per GPU\n"
        + table(["role", "component", "GiB"], rows, right={2})
        + f"\ntotal {gib(llm)} GiB (language model and runtime) + {gib(vision)} GiB vision encoder = "
        f"{gib(llm + vision)} GiB vs {gib(cap)} GiB: {verdict}"
    )


def time_table(plan: Plan, efficiencies: dict[str, float] | None = None, source: str | None = None) -> str:
    """Each phase's work for the planned step, its bound on the spec's GPU, and (given efficiencies, from `source`)
    the predicted seconds; then what each residency choice costs on the host link."""
    peaks = KNOWN_PEAKS[plan.loaded.spec.cluster.gpu]
    rows, times = [], time_plan(plan, efficiencies)
    prefix_backward = prefix_backward_plan(plan, efficiency=(efficiencies or {}).get(PREFIX_BACKWARD))
    for r in times:
        if not (r.cost.flops or r.cost.hbm_bytes or r.cost.host_bytes):
            continue
        rows += _time_row(r)
        if r.timer == "actor_suffix_backward" and prefix_backward is not None:
            rows += _time_row(prefix_backward, "  of it, through the prefix")
    bound, predicted = step_bound_s(plan, times), predicted_step_s(plan, times)
    rows.append(["step", "", "", "", _fixed(bound, 3), "", "-" if predicted is None else f"{predicted:.2f}"])
    heads = ["phase", "TFLOP", "HBM GB", "host GB", "bound s", "efficiency", "predicted s"]
    title = (
        f"Time per step on one {peaks.name} (bound: {peaks.flops / 1e12:.0f} TFLOP/s, {peaks.hbm_bytes_s / 1e12:.2f} "
        f"TB/s HBM, {peaks.host_bytes_s / 1e9:.0f} GB/s host link each way; phases one after another)"
    )
    if beside := sorted(overlapped_timers(plan.graph)):
        title += f"\n({', '.join(beside)} beside decode: in the rollout's seconds; the step bound prices them together)"
    if "gpu" not in plan.loaded.spec.cluster.model_fields_set:
        title += f"\n(cluster.gpu is not set: priced on its default, the {plan.loaded.spec.cluster.gpu})"
    if efficiencies is None:
        title += (
            f"\n(rollplex ships no run of this model on this GPU under the {plan.schedule.value} schedule: "
            "--efficiency SOURCE predicts seconds)"
        )
    elif source is not None:
        title += f"\n(the workload's mean step, {source})"
    out = f"{title}\n" + table(heads, rows, right={1, 2, 3, 4, 5, 6}) + "\n" + residency_choices(plan, peaks)
    for f in [*faster_residencies(plan, efficiencies), *faster_recompute(plan, efficiencies)]:
        out += f"\nalso fits, and faster by the bound: {f.lever.text} (step bound {f.bound_s:.2f} s against {bound:.2f}"
        if f.predicted_s is not None and predicted is not None:
            out += f"; predicted {f.predicted_s:.2f} s against {predicted:.2f}"
        out += ")"
    return out


def _fixed(x: float, places: int) -> str:
    """`x` to `places` decimals, or in two significant digits where it is above 0 and those decimals would show 0 (a
    tiny model's work)."""
    return f"{x:.1e}" if 0 < x < 0.5 * 10**-places else f"{x:.{places}f}"


def _time_row(r, label: str = "") -> list[list[str]]:
    """A time table's row of a `PhaseTime`, under `label` (default: its timer)."""
    c = r.cost
    cells = [label or r.timer, _fixed(c.flops / 1e12, 1), _fixed(c.hbm_bytes / 1e9, 1), _fixed(c.host_bytes / 1e9, 1)]
    cells += [_fixed(r.bound_s, 3), "-" if r.efficiency is None else f"{r.efficiency:.2f}"]
    return [[*cells, "-" if r.predicted_s is None else f"{r.predicted_s:.2f}"]]


def residency_choices(plan: Plan, peaks) -> str:
    """Where the objects that could cross the host link every step were put, and what that costs per step."""
    d = plan.decisions
    lines = []
    for label, component, where in (
        ("prefix saved tensors", Component.PREFIX_SAVED, d.prefix_saved),
        ("FP32 optimizer state", (Component.MASTER, Component.MOMENTS), d.optimizer_state),
        ("reference weights", Component.WEIGHTS, d.reference_weights),
    ):
        members = component if isinstance(component, tuple) else (component,)
        roles = ("reference",) if component is Component.WEIGHTS else ("actor", "critic")  # each trained role's
        held = [o for o in plan.residency.objects if o.role in roles and o.component in members]
        size = sum(o.bytes for o in held)
        moved = sum(o.host_bytes for o in held) if where is Residency.HOST else 0  # out and back, each way on its own
        if component is Component.WEIGHTS:
            moved = sum(n for _, n in reference_page_ins(plan))  # in, once a window of steps; out without a copy
        kept = f" ({gib(size - moved)} GiB of it kept in HBM)" if 0 < moved < size else ""  # copy engine
        budget = " at the workload's budget" if component is Component.PREFIX_SAVED else ""  # the table: the mean
        lines.append(
            f"{label}: {gib(size)} GiB in {where.value.upper()}{kept}"
            + (
                f", {moved / 1e9:.1f} GB over the host link per step{budget} ({moved / peaks.host_bytes_s:.2f} s)"
                if moved
                else ""
            )
        )
    if d.recompute.reruns:
        layers = plan.loaded.model.text.num_hidden_layers
        kept = f", the last {d.layers_kept} of {layers} decoder layers kept whole" if d.layers_kept else ""
        lines.append(f"training microbatch: recompute {d.recompute.value}{kept}")
    out = "residency choices: " + "; ".join(lines)
    if plan.chosen:
        out += f"\n{plan.chosen}"
    if d.update_beside_prefix:
        out += "\nthe actor's update runs on into the next step's actor prefix (sharing.update_beside_prefix), priced "
        out += "beside it; its own step waits for the gradient norm only"
    elif plan.loaded.spec.sharing.update_beside_prefix is True:
        out += (
            "\nsharing.update_beside_prefix has no effect: decode does not read the actor prefix (run.rollout_prefill)"
        )
    if d.freeze_vision:
        out += "\nvision tower frozen (model.freeze_vision): held once, run once per step for both prefixes, "
        out += "no gradients"
    return out


def report(
    plan: Plan, *, naive: bool, efficiencies: dict[str, float] | None = None, efficiency_source: str | None = None
) -> str:
    parts = [header(plan) + "\n" + launch_lines(plan), graph_table(plan), memory_table(plan), peak_table(plan),
             time_table(plan, efficiencies, efficiency_source)]  # fmt: skip
    parts.append(sharing_table(plan))
    if naive:
        parts.append(naive_table(plan))
    r = plan.residency
    verdict = "FITS" if r.fits else "DOES NOT FIT"
    line = f"plan {verdict}: peak {gib(r.peak_bytes)} GiB of {gib(r.capacity_bytes)} GiB"
    if not r.host.fits:
        line += f"; pinned host {gib(r.host.needed_bytes_per_node)} GiB of {gib(r.host.capacity_bytes_per_node)} GiB"
    parts.append(line)
    return "\n\n".join(parts)
