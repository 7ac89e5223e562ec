"""The result document of `rollplex bench`: serial against rollplex (and unsplit) on the same seeds.

From the serial steps: T_D (rollout), T_P (the prefixes rollplex runs beside decode), T_post (the rest); the
paper's Eq. 1 ideal is (T_D + T_P + T_post) / (max(T_D, T_P) + T_post). From rollplex: the step time, the
decode slowdown (the decode loop's wall seconds over serial's, GPU only: it counts the host's time launching
prefix chunks between decode steps too), its part on the device (`rollout.slowdown`: decode steps beside a
chunk against steps alone, timed with CUDA events) and where the prefix chunks ran. The step balance says where
rollplex's step gained and lost against serial's: the prefixes no longer in the step (-T_P), the rollout's extra
seconds (decode beside them), and the extra seconds after the rollout; the three
add up to the difference of the two (median) step times.

The updates match when, at the first step (the only one both schedules start from the same weights), the two
rollouts are the same tokens and the two gradients agree within the rounding of the model dtype (a strided
sample of every parameter's gradient, taken just before the update). With `--noise-floor`, "within the
rounding" is measured rather than assumed: serial's first step runs once more with rollplex's prefix grouping,
and rollplex's gradient may differ from serial's by up to `agreement.FLOOR_MARGIN` times what serial's own
differs by (the grouping changes GEMM shapes and so bf16 rounding; atomics in some backward kernels change it
run to run).
Parameters after several steps are reported too but decide nothing in bf16: AdamW's first steps move every
element by about lr x sign(grad), so a rounding-level difference in a near-zero gradient becomes a full step,
and the next rollout samples from slightly different weights.
Each schedule's device memory per phase is reported beside the compiled plan's peak of that phase. Not here:
running a schedule (`harness.py`).
"""

from __future__ import annotations

import statistics

import torch

from rollplex.bench.agreement import max_relative_difference, relative_difference, same_rollout, updates_match
from rollplex.bench.harness import ScheduleRun, gpu_name
from rollplex.bench.variants import policy_label
from rollplex.executors.memprobe import allocator_gib_by_phase, gib_by_phase
from rollplex.executors.policies import decode_kernels_for
from rollplex.graph.ir import Schedule
from rollplex.graph.load import LoadedSpec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan
from rollplex.graph.timeplan import overlapped_timers

BEYOND_IDEAL = 1.02  # a speedup this far above Eq. 1's ideal is more than hiding the prefixes can give


def beyond_ideal(result: dict) -> str | None:
    """What a result whose speedup exceeds Eq. 1's ideal by more than BEYOND_IDEAL owes its excess to (the work after
    the rollout, which the two schedules share, or the runs' spread); None within it."""
    speedup, ideal = result["speedup"], result["ideal_speedup"]
    if speedup <= BEYOND_IDEAL * ideal:
        return None
    after = result["step_balance_s"]["after_rollout_longer"]
    than = f"{abs(after):.2f} s {'less' if after < 0 else 'more'} under rollplex than under serial"
    return (
        f"the speedup {speedup:.3f}x is above Eq. 1's ideal {ideal:.3f}x, which hiding the prefixes cannot give: the "
        f"work after the rollout, the same in both schedules, took {than}, or the steps' spread is larger than the "
        "gain; bench more steps on an idle machine"
    )


def compare(
    loaded: LoadedSpec,
    serial: ScheduleRun,
    rollplex: ScheduleRun,
    command: str,
    serial_loaded: LoadedSpec | None = None,
    floor_grads: torch.Tensor | None = None,
) -> dict:
    """The result document: the keys of issue 5's `bench/results/<name>.json`, and the phase times.
    `serial_loaded`: the spec serial ran under when it differs from rollplex's (`variants.with_prompts_per_chunk`);
    `floor_grads`: the first-step gradient sketch of serial rerun with rollplex's grouping (`--noise-floor`)."""
    spec = loaded.spec
    serial_loaded = serial_loaded or loaded
    med = statistics.median
    t_d = med(t["rollout"] for t in serial.times)
    beside = overlapped_timers(compile_graph(loaded.spec, schedule=Schedule.ROLLPLEX))  # not a prefix decode reads
    t_p = med(sum(t[k] for k in beside) for t in serial.times)
    step_serial, step_rollplex = med(serial.step_s), med(rollplex.step_s)
    t_post = max(step_serial - t_d - t_p, 0.0)
    rollout_rollplex = med(t["rollout"] for t in rollplex.times)
    t_post_rollplex = max(step_rollplex - rollout_rollplex, 0.0)
    diff = max_relative_difference(serial.params, rollplex.params) if serial.params else None  # none saved
    rollouts_match = same_rollout(serial.first_rollout, rollplex.first_rollout)
    grad_diff = relative_difference(serial.first_grads, rollplex.first_grads)
    floor = relative_difference(serial.first_grads, floor_grads) if floor_grads is not None else None
    decode = med(rollplex.decode_s) / med(serial.decode_s) if serial.decode_s and rollplex.decode_s else None
    on_gpu = spec.run.device != "cpu" and torch.cuda.is_available()
    return {
        "gpu": gpu_name(),
        "model": spec.model.name,
        "workload": spec.workload.model_dump(),
        "memory": spec.memory.model_dump(),  # the settings a result depends on, beside the command
        "sharing": spec.sharing.model_dump(),
        "run": spec.run.model_dump(),
        "prefills_from_actor": spec.prefills_from_actor,  # run.rollout_prefill as it resolved
        "decode_kernels": decode_kernels_for(spec.run.decode_kernels, torch.device("cuda")) if on_gpu else "plain loop",
        "policy": policy_label(spec) if torch.cuda.is_available() else "inline",
        "scoring_attention": rollplex.scoring_attention or serial.scoring_attention,  # "" from a run saved before
        "command": command,
        "step_s": {"serial": round(step_serial, 4), "rollplex": round(step_rollplex, 4)},
        "speedup": round(step_serial / step_rollplex, 4),
        "ideal_speedup": round((t_d + t_p + t_post) / (max(t_d, t_p) + t_post), 4),
        # the speedup with the work after the rollout at serial's time: what hiding the prefixes beside decode
        # gave, apart from the suffix phases, which the overlap does not touch (Eq. 1 assumes them equal)
        "overlap_speedup": round(step_serial / (step_serial - t_p + rollout_rollplex - t_d), 4),
        "decode_slowdown": round(decode, 4) if decode is not None else None,
        # the GPU's part of it: decode steps beside a chunk against steps of their batch size alone, timed with
        # CUDA events (`rollout.slowdown`); decode_slowdown is host wall time and also counts launching the chunks
        "decode_slowdown_on_device": round(med(rollplex.device_slowdown), 4) if rollplex.device_slowdown else None,
        "updates_match": updates_match(rollouts_match, grad_diff, spec.run.dtype, floor),
        "first_step_rollouts_match": rollouts_match,
        "first_step_grad_relative_difference": grad_diff,
        "grad_noise_floor": floor,  # serial against serial with rollplex's grouping; None without --noise-floor
        "max_param_relative_difference": diff,
        "T_D_s": round(t_d, 4),
        "T_P_s": round(t_p, 4),
        "T_post_s": round(t_post, 4),
        # rollplex's own seconds outside the rollout (a prefix decode reads included, which runs alone before it):
        # were they T_post_s, the measured speedup could not pass the ideal
        "T_post_rollplex_s": round(t_post_rollplex, 4),
        "step_balance_s": {  # rollplex's step minus serial's, in three parts
            "prefixes_hidden": round(-t_p, 4),
            "rollout_longer": round(rollout_rollplex - t_d, 4),
            # unclamped (T_post is clamped at 0 for Eq. 1), so that the three parts add up exactly
            "after_rollout_longer": round((step_rollplex - rollout_rollplex) - (step_serial - t_d - t_p), 4),
        },
        "prefix_beside_decode": round(med(rollplex.beside_fraction), 4),
        # rollplex's prefix ran beside decode: its reruns move to the trainer's stream, what is outside them does not
        "prefix_backward_s": {
            "serial": _median_or_none(serial.prefix_backward_s),
            "rollplex": _median_or_none(rollplex.prefix_backward_s),
        },
        # its bound (`modelcost.prefix_backward`) and efficiency; none for a serial run saved before it was bounded
        "prefix_backward_bound_s": {
            "serial": _median_or_none(serial.prefix_backward_bounds),
            "rollplex": _median_or_none(rollplex.prefix_backward_bounds),
        },
        "prefix_backward_efficiency": {
            "serial": _ratio_of_medians(serial.prefix_backward_bounds, serial.prefix_backward_s),
            "rollplex": _ratio_of_medians(rollplex.prefix_backward_bounds, rollplex.prefix_backward_s),
        },
        "phase_s": {"serial": _phase_medians(serial), "rollplex": _phase_medians(rollplex)},
        # the cost model's bound of each phase on the spec's GPU, from the steps' real token counts, and the
        # efficiency each phase reached (bound over measured), and that of its device work alone (the host link
        # left out of the bound): `rollplex compile --efficiency` predicts with the latter
        "bound_s": {"serial": _bound_medians(serial.bounds), "rollplex": _bound_medians(rollplex.bounds)},
        "efficiency": {"serial": _efficiency(serial), "rollplex": _efficiency(rollplex)},
        "device_efficiency": {  # a serial baseline saved before the device bound has none: left out
            name: _efficiency(run, device=True)
            for name, run in (("serial", serial), ("rollplex", rollplex))
            if run.device_bounds
        },
        # the measured steps one by one (medians hide a slow step), and the last step's timeline (the PNG's spans)
        "per_step": {"serial": _per_step(serial), "rollplex": _per_step(rollplex)},
        # a step's seconds outside its ops (phase switches, paging, host work between ops): serial's should be
        # near 0, or the baseline pays for more than its phases
        "unaccounted_s": {"serial": _unaccounted(serial), "rollplex": _unaccounted(rollplex)},
        "timeline_s": {"serial": _timeline(serial), "rollplex": _timeline(rollplex)},
        "peak_gib": {"serial": gib_by_phase(serial.peak_bytes), "rollplex": gib_by_phase(rollplex.peak_bytes)},
        "allocator_peak_gib": {  # the caching allocator's share of peak_gib: live tensors, and reserved
            "serial": allocator_gib_by_phase(serial.allocator_bytes),
            "rollplex": allocator_gib_by_phase(rollplex.allocator_bytes),
        },
        "plan_peak_gib": {
            "serial": plan_peaks_gib(serial_loaded, Schedule.SERIAL),
            "rollplex": plan_peaks_gib(loaded, Schedule.ROLLPLEX),
        },
        "prompts_per_chunk": {
            "serial": serial_loaded.spec.sharing.prompts_per_chunk or "all",
            "rollplex": spec.sharing.prompts_per_chunk or "all",
        },
        "steps": len(serial.step_s),
    }


def _bound_medians(bounds: list[dict[str, float]]) -> dict[str, float]:
    keys = bounds[0] if bounds else {}
    return {k: round(statistics.median(b[k] for b in bounds), 4) for k in keys}


def _efficiency(run: ScheduleRun, device: bool = False) -> dict[str, float]:
    """Bound (`device`: its device bound) over measured seconds per phase (phases the schedule spent no time in are
    left out)."""
    bounds, measured = _bound_medians(run.device_bounds if device else run.bounds), _phase_medians(run)
    return {k: round(b / measured[k], 4) for k, b in bounds.items() if measured.get(k) and b > 0}


def _median_or_none(values: list[float]) -> float | None:
    return round(statistics.median(values), 4) if values else None


def _ratio_of_medians(bounds: list[float], measured: list[float]) -> float | None:
    """A sub-phase's efficiency: its median bound over its median measured seconds (None if either is missing)."""
    if not bounds or not measured or statistics.median(measured) <= 0:
        return None
    return round(statistics.median(bounds) / statistics.median(measured), 4)


def plan_peaks_gib(loaded: LoadedSpec, schedule: Schedule) -> dict[str, float]:
    """The compiled plan's peak HBM per phase ("1", "2", "3"), GiB per GPU."""
    return {str(int(p.phase)): round(p.peak_bytes / 2**30, 2) for p in compile_plan(loaded, schedule).residency.phases}


def with_unsplit(result: dict, loaded: LoadedSpec, rollplex: ScheduleRun, unsplit: ScheduleRun) -> dict:
    """The optional third schedule, textbook GRPO (each response scored over prompt ++ response, the prompt
    recomputed per response): its step and phase times, bounds, efficiencies and peaks beside the other two, and
    how far its update lands from rollplex's (not bitwise: the prompt's work is summed in another order; None for
    the final weights of a saved run, `--unsplit-from`, which keeps none), and whether the first step's rollouts
    were the same tokens (on a GPU, unsplit's rollout prefills in the engine: a logit that rounds otherwise can
    sample another token, and then the first gradients differ by more than rounding)."""
    step = statistics.median(unsplit.step_s)
    per_schedule = {
        "phase_s": _phase_medians(unsplit),
        "bound_s": _bound_medians(unsplit.bounds),
        "efficiency": _efficiency(unsplit),
        "per_step": _per_step(unsplit),
        "unaccounted_s": _unaccounted(unsplit),
        "timeline_s": _timeline(unsplit),
        "peak_gib": gib_by_phase(unsplit.peak_bytes),
        "allocator_peak_gib": allocator_gib_by_phase(unsplit.allocator_bytes),
        "plan_peak_gib": plan_peaks_gib(loaded, Schedule.UNSPLIT),
    }
    if unsplit.device_bounds:
        per_schedule["device_efficiency"] = _efficiency(unsplit, device=True)
    diff = max_relative_difference(unsplit.params, rollplex.params) if unsplit.params else None
    return (
        result
        | {key: result.get(key, {}) | {"unsplit": value} for key, value in per_schedule.items()}
        | {
            "step_s": result["step_s"] | {"unsplit": round(step, 4)},
            "speedup_vs_unsplit": round(step / result["step_s"]["rollplex"], 4),
            "unsplit_max_param_relative_difference": diff,
            "unsplit_first_step_rollouts_match": same_rollout(unsplit.first_rollout, rollplex.first_rollout),
            "unsplit_first_step_grad_relative_difference": relative_difference(
                unsplit.first_grads, rollplex.first_grads
            ),
        }
    )


def _per_step(run: ScheduleRun) -> dict:
    return {"step_s": [round(t, 4) for t in run.step_s], "longest_response": run.longest_response,
            "phase_s": [{k: round(v, 4) for k, v in t.items()} for t in run.times], "stalls": run.stalls,
            "decode_s": [round(t, 4) for t in run.decode_s],
            "decode_slowdown_on_device": [round(t, 4) for t in run.device_slowdown]}  # fmt: skip


def _unaccounted(run: ScheduleRun) -> float | None:
    gaps = [step - sum(times.values()) for step, times in zip(run.step_s, run.times, strict=True)]
    return round(statistics.median(gaps), 4) if gaps else None


def _timeline(run: ScheduleRun) -> list[list]:
    return [[lane, label, round(start, 4), round(end, 4)] for lane, label, start, end in run.timeline]


def _phase_medians(run: ScheduleRun) -> dict[str, float]:
    return {k: round(statistics.median(t[k] for t in run.times), 4) for k in run.times[0]}
