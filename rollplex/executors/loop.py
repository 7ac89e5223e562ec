"""`rollplex run`: the training loop. Builds the engines of a compiled plan, then per step takes a batch at
the data position (made on a worker thread during the step before, `rollplex.data.prefetch`), walks the plan's
steps, logs metrics, checkpoints, and evaluates on held-out prompts where the spec asks (`evaluation.py`).

Stopping: Ctrl-C, SIGTERM or SIGHUP (`executors.signals`) or an error before a step's update loses that step only
(the last completed step is saved on the way out); a signal during the update waits until the step is complete;
weights of half an update are never saved.
"""

from __future__ import annotations

import signal
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rollplex.data.prefetch import Prefetch
from rollplex.data.source import open_dataset
from rollplex.errors import RunFailed, SpecError, Stopped
from rollplex.executors import checkpointing
from rollplex.executors.bounds import prefix_backward_bound_s, step_bounds, step_tokens
from rollplex.executors.collector import collections_between_steps
from rollplex.executors.compiles import compiled_so_far
from rollplex.executors.datacheck import check_budget
from rollplex.executors.distributed import is_main_process
from rollplex.executors.engines import Engines, build_engines
from rollplex.executors.evaluation import eval_line, evaluate, open_evaluation
from rollplex.executors.memprobe import PhaseMemory, allocator_gib_by_phase, chain, gib_by_phase
from rollplex.executors.metrics import Fingerprints, MetricsLog, param_digest, peak_mem_bytes
from rollplex.executors.preflight import preflight
from rollplex.executors.progress import PhaseBars, say, stalls, step_bars, step_line
from rollplex.executors.record import StepRecord
from rollplex.executors.runtime import run_iteration
from rollplex.executors.signals import InterruptGate
from rollplex.executors.task import make_tokenizer
from rollplex.graph.ir import NodeKind, Op, Part, Role, Schedule
from rollplex.graph.plan import Plan


@dataclass(frozen=True)
class RunOptions:
    steps: int
    out_dir: Path
    resume: bool = False
    checkpoint_every: int | None = None
    keep_checkpoints: int | None = None  # only the newest K stay (`run.keep_checkpoints`)
    progress: bool = True
    tensorboard: bool = True
    checkpoints: bool = True  # False: none at all, not even the last step's (timing runs: 7B's state is 108 GB)


def train(plan: Plan, opts: RunOptions) -> list[dict]:
    """`opts.steps` steps (in all, counting those a resumed run has done) of the plan; the metrics of each."""
    preflight(plan, opts.out_dir, opts.steps, opts.resume)  # before any model is built or file written
    loaded, g = plan.loaded, plan.graph
    try:  # every row parsed and its media found before a file is written or minutes of building
        w = loaded.spec.workload
        dataset = open_dataset(
            w.dataset, make_tokenizer(loaded), loaded.spec.run.seed, loaded.path.parent, w.mismatch_videos
        )
    except ValueError as e:
        raise loaded.locate(SpecError("workload.dataset", str(e))) from None
    evaluation = open_evaluation(loaded)
    try:
        opts.out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError("", f"--out {opts.out_dir}: {e.strerror}", "give a directory this user can write") from None
    announce = opts.progress and is_main_process()
    if announce:  # a large model's start-up (weights, pinned optimizer state) takes a while: say what is happening
        print("rollplex: building the models, the optimizer state and the host pool", file=sys.stderr, flush=True)
    began = time.perf_counter()
    engines = build_engines(plan)
    if announce:
        compiles = "; the first step also compiles its GPU kernels" if engines.actor.device.type == "cuda" else ""
        print(f"rollplex: ready in {time.perf_counter() - began:.1f} s{compiles}", file=sys.stderr, flush=True)
    start, position = 0, 0
    if opts.resume and (found := checkpointing.latest(opts.out_dir)) is not None:
        try:
            resumed = checkpointing.load(found, engines)
        except ValueError as e:
            raise SpecError("", str(e)) from None
        except (OSError, RuntimeError, KeyError) as e:  # a file that changed since preflight's `damage` looked
            first = str(e).splitlines()[0] if str(e) else ""
            raise SpecError("", f"--resume: {found} could not be read ({type(e).__name__}: {first[:200]})") from None
        start, position = resumed.step, resumed.data_position
        if start >= opts.steps:
            raise SpecError("", f"--resume: {found} is step {start}, and the run has {opts.steps} steps",
                            f"raise --steps above {start} to train on")  # fmt: skip
    main = engines.is_main  # under tensor parallelism the other ranks compute and write nothing but their state
    evaluate_again = evaluation is not None and start > 0 and evaluation.due(start, opts.steps)  # a stop may cut it
    log = (
        MetricsLog(
            opts.out_dir,
            resume_step=start if opts.resume else None,
            tensorboard=opts.tensorboard,
            evaluation=evaluation is not None,
            evaluations_kept=start - 1 if evaluate_again else None,
        )
        if main
        else None
    )
    progress = opts.progress and main
    bars = progress and sys.stderr.isatty()  # a log file gets one line a step instead of redrawn bars
    size, gate = loaded.spec.workload.prompts_per_step, InterruptGate()
    records: list[dict] = []
    run_id = checkpointing.identity(loaded)
    saved = checkpointing.Snapshot.of(start, position, engines, run_id)  # the last completed step
    updating, peak_allocated = False, 0
    ending = False  # the run's last lines are being written
    interrupted: signal.Signals | None = None  # the stop signal a gate held back meanwhile
    share = engines.dp.share if engines.dp is not None else None  # a data-parallel rank's prompt groups
    prefetch = Prefetch(dataset, size, pin=engines.actor.device.type == "cuda", share=share)  # made a step ahead
    examples: list = []
    waiting: list[dict] = []  # a step's metrics while its update runs on (`sharing.update_beside_prefix`)
    fingerprints: list[Fingerprints] = []  # of the weights that update wrote, launched once it has joined

    step_bar = step_bars(range(start + 1, opts.steps + 1), bars, start, opts.steps)

    def emit(r: dict) -> None:
        if log is not None:
            log.write(r)
        if bars:  # the terminal's bar carries the last step's reward and loss
            warm = r["step"] > start + 1
            step_bar.set_postfix_str(f"reward {r['reward_mean']:.3f}, loss {r['loss']:.4f}{stalls(r, warm)}")
        elif progress:
            print(step_line(r, opts.steps, warm=r["step"] > start + 1), file=sys.stderr, flush=True)

    def complete(o: Op | None = None) -> None:
        """After the next step's actor prefix (which the runtime ends by joining the update) or at the run's end (the
        update joins here): the fingerprints of the weights it wrote are launched, read by `emit_waiting` (no wait
        for the device here); an interrupt held since the update began is let through."""
        if not waiting or fingerprints or (o is not None and (o.role, o.part) != (Role.ACTOR, Part.PREFIX)):
            return
        engines.optimizer.finish()  # joined already after a prefix; at the run's end, here
        fingerprints.append(Fingerprints.of(engines.actor))
        joined()

    def joined() -> None:
        """The update is whole (ended in its step, or a deferred one joined): what a checkpoint saves is one step's.
        While the run ends (`ending`), an interrupt held meanwhile waits for the last save."""
        nonlocal updating, interrupted
        if updating and engines.optimizer.in_flight is None:
            updating = False
            interrupted = interrupted or gate.release(raise_pending=not ending)

    def emit_waiting() -> None:
        """The waiting step's metrics line, its weights' digest read (at the next step's end, or the run's)."""
        complete()
        if waiting:
            (r,) = waiting
            r["param_digest"] = fingerprints.pop().digest()
            emit(r)
            waiting.clear()

    def evaluated(step: int) -> None:
        """The held-out evaluation of the weights as they are after `step` (0: the starting weights)."""
        figures = evaluate(engines, evaluation, step, share)
        if log is not None:
            log.write_eval(figures)
        if progress:
            say(eval_line(figures), step_bar if bars else None)

    with collections_between_steps(loaded.spec.run.manual_gc) as collect:
        try:
            if (evaluation is not None and evaluation.at_start and start == 0) or evaluate_again:
                evaluated(start)
            for step in step_bar:
                try:
                    examples = prefetch.take(position, position + size if step < opts.steps else None)
                except ValueError as e:  # a row the dataset cannot read (a corrupt video): the steps before it stay
                    kept = opts.checkpoints and saved.step > start  # saved as the run ends (`finally`)
                    then = "the steps before it are kept: fix or drop that row, then --resume"
                    raise RunFailed(f"step {step}'s data: {e}; {then if kept else 'fix or drop that row'}") from None
                check_budget(loaded, examples)

                def before(o: Op) -> None:
                    nonlocal updating
                    if o.kind is NodeKind.UPDATE and not updating:
                        gate.hold()
                        updating = True

                update_beside = bool(waiting)  # the step before's update runs on into this step's actor prefix
                begin, compiled_before = time.perf_counter(), compiled_so_far()
                with PhaseBars(g, step, bars) as after, PhaseMemory(engines.actor.device) as memory:
                    hooks = {
                        "before_op": chain(before, memory.before),
                        "after_op": chain(after, memory.after, complete),
                    }
                    record = run_iteration(g, engines, examples, **hooks)
                keep_streaming(engines)
                gc_s = collect()  # inside the step's time; beside a deferred update the device is busy meanwhile
                keep_streaming(engines)
                position += size
                local_lens = record.response_lens  # this rank's: its bound is of its own share
                if engines.dp is not None:
                    record = _over_ranks(record, engines.dp)
                in_flight = engines.update_beside_prefix and engines.optimizer.in_flight is not None  # digest: later
                records.append(
                    _metrics(record, engines, step, plan.schedule, time.perf_counter() - begin, not in_flight)
                )
                on_gpu = engines.actor.device.type == "cuda"  # the CPU's peaks are unknown: no bounds there
                tokens = step_tokens(examples, local_lens)
                records[-1]["bound_s"], records[-1]["device_bound_s"] = (
                    step_bounds(plan, tokens, update_beside, in_flight) if on_gpu else ({}, {})
                )
                records[-1]["tokens"] = tokens.record()  # a later cost model reprices the step
                records[-1]["update_beside_prefix"] = update_beside  # the actor prefix's seconds hold an update
                records[-1]["update_deferred"] = in_flight  # the step's update timer waited for the gradient norm
                if on_gpu and record.prefix_backward_s is not None:  # of actor_suffix_backward, bounded apart
                    records[-1]["prefix_backward_s"] = round(record.prefix_backward_s, 4)
                    records[-1]["prefix_backward_bound_s"] = prefix_backward_bound_s(plan, tokens)
                records[-1]["data_wait_s"] = round(prefetch.waited_s, 4)  # before the step: not in time_s.step
                records[-1]["gc_s"] = round(gc_s, 4)
                records[-1]["compiles"] = asdict(compiled_so_far().since(compiled_before))
                records[-1]["gaps_s"] = round(record.gaps_s, 4)
                records[-1]["gaps_at_s"] = {k: round(v, 4) for k, v in record.gaps_at.items()}
                records[-1]["peak_gib_by_phase"] = gib_by_phase(memory.peaks())
                if memory.allocator_peaks():  # on a GPU: the probe resets torch's peak counters at each phase
                    records[-1]["allocator_gib_by_phase"] = allocator_gib_by_phase(memory.allocator_peaks())
                    records[-1]["alloc_retries_by_phase"] = {
                        str(int(p)): n for p, n in memory.allocator_retries().items()
                    }
                    peak_allocated = max(peak_allocated, memory.high_water())
                    records[-1]["peak_mem_bytes"] = peak_allocated  # the run's peak so far, as without the resets
                emit_waiting()  # the step before's, whose update this step's actor prefix joined
                if in_flight:
                    waiting.append(records[-1])
                else:
                    emit(records[-1])
                saved = checkpointing.Snapshot.of(step, position, engines, run_id)
                if opts.checkpoints and opts.checkpoint_every and step % opts.checkpoint_every == 0:
                    emit_waiting()  # joins a deferred update; its line before its checkpoint: none without one
                    checkpointing.save(opts.out_dir, saved, engines, opts.keep_checkpoints)
                keep_streaming(engines)
                joined()  # a deferred update holds interrupts until the next actor prefix joins it
                if evaluation is not None and evaluation.due(step, opts.steps):
                    emit_waiting()  # a deferred update joins: the evaluation reads the weights it writes
                    evaluated(step)
        finally:  # a second interrupt would cut the run's last line or checkpoint short: it waits for them
            ending = True
            why = "ending the run: its last metrics and checkpoint first (interrupts wait for them)" if main else ""
            gate.hold(why)
            try:
                prefetch.close()
                emit_waiting()  # joining a deferred update lets the gate go (`joined`): held again below
                if log is not None:
                    log.close()
                if (
                    opts.checkpoints
                    and not updating
                    and saved.step > start
                    and checkpointing.latest(opts.out_dir) != checkpointing.checkpoint_dir(opts.out_dir, saved.step)
                ):
                    gate.hold(why)
                    checkpointing.save(opts.out_dir, saved, engines, opts.keep_checkpoints)
            finally:
                interrupted = interrupted or gate.release(raise_pending=False)
    if interrupted is not None:
        raise Stopped(interrupted)  # held while the last update ended, let through once it was saved
    examples = []  # their pinned patches recorded the prefix streams: freed while those live
    engines.settle()  # a later run in this process may free what recorded the prefix streams
    return records


def _over_ranks(record: StepRecord, dp) -> StepRecord:
    """The step's record over every data-parallel rank: rewards and responses gathered in rank order, each
    reward term's and the accuracy's mean over the ranks' equal shares (the training sums are reduced already)."""
    names = list(record.reward_terms)
    means = dp.sum([record.reward_terms[k] for k in names] + [record.stats.get("accuracy", 0.0)])
    record.rewards = dp.gather(record.rewards)
    record.response_lens = dp.gather(record.response_lens)
    record.responses = dp.gather(record.responses)
    record.reward_terms = {k: v / dp.size for k, v in zip(names, means[:-1], strict=True)}
    record.stats["accuracy"] = means[-1] / dp.size
    return record


def keep_streaming(engines: Engines) -> None:
    """Between steps, a deferred update's next chunks onto its streams (`UpdateInFlight.pump`: a few ahead, never
    waiting): otherwise its host link idles from the update's first chunks until the next prefix's first module."""
    if (update := engines.optimizer.in_flight) is not None:
        update.pump()


def _metrics(
    record: StepRecord, engines: Engines, step: int, schedule: Schedule, seconds: float, digest: bool = True
) -> dict:
    """The step's metrics; `digest` False leaves `param_digest` None (its update still runs: `complete` fills it)."""
    rewards, lens = record.rewards, record.response_lens.float()
    return {
        "step": step,
        "schedule": schedule.value,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if rewards.numel() > 1 else 0.0,
        **{f"rewards/{name}": value for name, value in record.reward_terms.items()},
        "accuracy": record.stats.get("accuracy", 0.0),
        **{
            k: record.stats.get(k, 0.0)
            for k in ("loss", "kl", "entropy", "clip_frac", "grad_norm", "logprob_diff_mean", "logprob_diff_max")
        },
        "response_len_mean": float(lens.mean()),
        "prefix_beside_decode": record.stats.get("prefix_chunks_during_decode", 0.0),
        "decode_slowdown": record.stats.get("decode_slowdown"),
        **{k: round(record.stats[k], 4) for k in ("decode_steps_s", "decode_idle_s") if k in record.stats},
        **{k: record.stats[k] for k in ("value_loss", "critic_grad_norm") if k in record.stats},  # PPO's critic
        "param_digest": param_digest(engines.actor) if digest else None,
        **({"critic_digest": param_digest(engines.critic)} if engines.critic is not None else {}),
        "time_s": {**{k: round(v, 4) for k, v in record.times.items()}, "step": round(seconds, 4)},
        "peak_mem_bytes": peak_mem_bytes(engines.actor.device),
    }
