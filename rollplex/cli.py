"""`rollplex compile|run|bench`: argument parsing and exit codes only; the work lives in the library."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from rollplex.errors import PlanDoesNotFit, RunFailed, SpecError, Stopped
from rollplex.outputs import check_output


def _compile(args: argparse.Namespace) -> int:
    from rollplex.graph.ir import Schedule
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import check_fits, compile_plan
    from rollplex.report.efficiency import read_efficiencies, recorded_efficiencies
    from rollplex.report.jsonout import plan_to_json

    dry_only = (("--format json", args.format == "json"), ("--naive", args.naive), ("--efficiency", args.efficiency))
    for flag, given in dry_only:
        if given and not args.dry_run:
            raise SpecError("", f"{flag} shapes the dry-run's output", "add --dry-run")
    if args.dry_run and args.output is not None:
        raise SpecError("", f"-o {args.output} with --dry-run, which writes no plan", "drop one of them")
    args.output = args.output or "plan.json"
    if args.plot is not None and Path(args.plot).suffix.lower() not in PLOT_SUFFIXES:
        raise SpecError("", f"--plot {args.plot}: no image format matplotlib writes",
                        f"end it in {', '.join(PLOT_SUFFIXES)}")  # fmt: skip
    if args.plot is not None:
        _check_installed("compile --plot", ("matplotlib",))
    for flag, path in (("--plot", args.plot), ("-o", None if args.dry_run else args.output)):
        if path is not None:
            check_output(flag, path)
    loaded = load_spec(args.spec)
    plan = compile_plan(loaded, Schedule(args.schedule) if args.schedule else None)
    efficiencies, source = None, None
    if args.efficiency:
        efficiencies, source = (
            read_efficiencies(args.efficiency, plan.schedule.value),
            f"predicted at --efficiency {args.efficiency}",
        )
    elif args.dry_run and (
        recorded := recorded_efficiencies(loaded.spec.cluster.gpu, loaded.spec.model.name, plan.schedule.value)
    ):
        efficiencies, source = recorded.efficiencies, recorded.line
    if args.check_data:
        from rollplex.executors.datacheck import check_data

        print(check_data(loaded).line(), file=sys.stderr)
    if args.plot:
        from rollplex.report.plot import plot_memory

        try:
            plot_memory(plan, args.plot)
        except OSError as e:  # checked before the work; the folder changed since
            raise SpecError("", f"--plot {args.plot}: {e.strerror or e}", "give a path this user can write") from None
    if args.dry_run:
        if args.format == "json":
            print(json.dumps(plan_to_json(plan, efficiencies, source), indent=1))
        else:
            from rollplex.report.tables import report

            print(report(plan, naive=args.naive, efficiencies=efficiencies, efficiency_source=source))
        check_fits(plan)
        return 0
    check_fits(plan)
    try:
        Path(args.output).write_text(json.dumps(plan_to_json(plan), indent=1))
    except OSError as e:
        raise SpecError("", f"-o {args.output}: {e.strerror}", "give a path this user can write") from None
    print(
        f"wrote {args.output}: peak {plan.residency.peak_bytes / 2**30:.1f} GiB per GPU, schedule {plan.schedule.value}"
    )
    return 0


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".eps", ".ps", ".tif", ".tiff", ".webp")  # matplotlib's


def _plan_to_run(args: argparse.Namespace):
    """The plan `rollplex run` executes: a `plan.json` as it is, or the spec compiled (once) for its schedule."""
    from rollplex.graph.ir import Schedule
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import compile_plan
    from rollplex.graph.planfile import is_plan_file, read_plan

    if is_plan_file(args.spec):
        if args.schedule:
            raise SpecError("", "--schedule with a plan: a plan has its schedule", "compile the spec with --schedule")
        return read_plan(args.spec)
    return compile_plan(load_spec(args.spec), Schedule(args.schedule) if args.schedule else None)


def _run(args: argparse.Namespace) -> int:
    for flag, value in (("--steps", args.steps), ("--checkpoint-every", args.checkpoint_every)):
        if value is not None and value < 1:
            raise SpecError("", f"{flag} {value}", f"use {flag} 1 or more")
    plan = _plan_to_run(args)
    loaded = plan.loaded
    spec = loaded.spec
    videos = ("av",) if not spec.workload.dataset.startswith("synthetic:") else ()  # decoded from files
    _check_installed("rollplex run", (*RUN_MODULES, *videos))
    from rollplex.executors.loop import RunOptions, train

    opts = RunOptions(
        steps=args.steps or spec.run.steps,
        out_dir=Path(args.out or f"runs/{loaded.path.stem}"),  # a plan's: of the spec it was compiled from
        resume=args.resume,
        checkpoint_every=args.checkpoint_every or spec.run.checkpoint_every,
        keep_checkpoints=spec.run.keep_checkpoints,
        progress=not args.quiet,
        checkpoints=not args.no_checkpoints,
    )
    if args.no_checkpoints and args.checkpoint_every:
        raise SpecError("", "--no-checkpoints with --checkpoint-every", "choose one")
    if opts.out_dir.exists() and not opts.out_dir.is_dir():
        raise SpecError("", f"--out {opts.out_dir} is a file", "give a directory (it is created if missing)")
    from rollplex.executors.distributed import check_world, is_main_process
    from rollplex.executors.launch import launch_local, launches_here
    from rollplex.executors.policies import mps_session
    from rollplex.executors.signals import stop_line

    if launches_here(spec.cluster.nodes, spec.cluster.gpus_per_node):  # one node of several GPUs: a rank each
        _check_device(loaded)
        return launch_local(spec.cluster.gpus_per_node, args.argv)
    with mps_session([plan]):  # under the mps policy: before anything touches the GPU
        _check_device(loaded)
        try:
            check_world(spec.cluster.nodes, spec.cluster.gpus_per_node)
        except ValueError as e:
            raise loaded.locate(SpecError("cluster.gpus_per_node", str(e))) from None
        try:
            records = train(plan, opts)
        except KeyboardInterrupt as e:  # Ctrl-C, SIGTERM or SIGHUP (`Stopped`): said once, by rank 0
            signum = signal.Signals(getattr(e, "signum", signal.SIGINT))
            if not is_main_process():
                raise Stopped(signum, said=False) from None
            raise Stopped(signum, stop_line(signum, opts.out_dir, opts.checkpoints)) from None
    from rollplex.executors.distributed import finish

    if records and is_main_process():  # one summary line, from rank 0 under torchrun
        last = records[-1]
        summary = f"reward {last['reward_mean']:.3f}, loss {last['loss']:.4f}"
        evaluations = f", held-out evaluations in {opts.out_dir / 'eval.jsonl'}" if spec.evaluation else ""
        print(f"step {last['step']}: {summary}; metrics in {opts.out_dir / 'metrics.jsonl'}{evaluations}")
        from rollplex.report.efficiency import run_summary

        print(run_summary(records))
    finish()
    return 0


def _check_device(loaded) -> None:
    """The spec's run.device is one this machine has, else one line."""
    from rollplex.executors.device_settings import resolve_device

    try:
        resolve_device(loaded.spec.run.device)
    except ValueError as e:
        raise loaded.locate(SpecError("run.device", str(e))) from None


RUN_MODULES = ("torch", "safetensors", "PIL", "tqdm", "tensorboard")  # what training imports: rollplex[train] and torch


def _check_installed(command: str, modules: tuple[str, ...]) -> None:
    """Before the work: the packages `command` imports are installed (the base install plans only), else one line."""
    from importlib.util import find_spec

    missing = [m for m in modules if find_spec(m) is None]
    if missing:
        torch_first = "pip install torch (README: Install), then " if "torch" in missing else ""
        raise SpecError("", f"{command} needs {', '.join(missing)}, not installed",
                        f"{torch_first}pip install 'rollplex[train]'")  # fmt: skip


def _bench(args: argparse.Namespace) -> int:
    _check_installed("rollplex bench", (*RUN_MODULES, "matplotlib"))
    from rollplex.bench.command import bench

    return bench(args)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rollplex", description="Cross-phase GRPO for video VLMs.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compile", help="compile a spec into a phase schedule and per-GPU memory plan")
    c.add_argument("spec", help="the YAML spec")
    c.add_argument("--dry-run", action="store_true", help="print the plan instead of writing it")
    c.add_argument("--naive", action="store_true", help="also show the everything-resident footprint")
    c.add_argument(
        "--check-data",
        action="store_true",
        help="render the first step's prompts on the CPU and check them against the budgets (one line on stderr)",
    )
    c.add_argument("--plot", metavar="FILE.png", help="plot HBM by role over the phases")
    c.add_argument("--format", choices=["text", "json"], default="text", help="dry-run output format")
    c.add_argument("--schedule", choices=["serial", "rollplex"], help="override the spec's schedule")
    c.add_argument(
        "--efficiency",
        metavar="SOURCE",
        help="predict each phase's seconds at efficiencies (bound / measured): a `rollplex bench` result (JSON), a "
        "`rollplex run`'s metrics.jsonl (medians over its steps) or PHASE=E[,PHASE=E...] set by hand (default: "
        "those measured for the spec's model, GPU and schedule, where rollplex ships some)",
    )
    c.add_argument("-o", "--output", help="where to write the plan (default plan.json)")
    c.set_defaults(func=_compile)
    r = sub.add_parser("run", help="train: GRPO steps executing the compiled plan")
    r.add_argument("spec", help="the YAML spec, or a plan.json written by `rollplex compile`")
    r.add_argument("--steps", type=int, help="steps to run in all (default: run.steps)")
    r.add_argument("--schedule", choices=["unsplit", "serial", "rollplex"], help="default: the spec's schedule")
    r.add_argument("--out", help="run directory: metrics.jsonl, tb/, checkpoints/ (default runs/<spec name>)")
    r.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    r.add_argument("--checkpoint-every", type=int, help="save every K steps (default: run.checkpoint_every)")
    r.add_argument("--quiet", action="store_true", help="no progress bars")
    r.add_argument(
        "--no-checkpoints", action="store_true", help="write no checkpoint, not even the last step's (timing runs)"
    )
    r.set_defaults(func=_run)
    b = sub.add_parser("bench", help="time serial against rollplex on the same seeds; JSON and a timeline PNG")
    b.add_argument("spec", help="the YAML spec")
    b.add_argument("--steps", type=int, default=3, help="measured steps per schedule (default 3)")
    b.add_argument("--warmup", type=int, default=1, help="steps run first and not measured (default 1)")
    b.add_argument("--out", help="result JSON (default runs/bench/<spec name>.json; the PNG goes beside it)")
    b.add_argument("--unsplit", action="store_true", help="also time the unsplit schedule (textbook GRPO)")
    b.add_argument(
        "--save-unsplit",
        metavar="PATH",
        help="time the unsplit schedule alone and save it for --unsplit-from (it takes several split steps' time: "
        "a process of its own)",
    )
    b.add_argument(
        "--unsplit-from",
        metavar="PATH",
        help="add the unsplit run a bench of the same spec and step counts saved (--save-unsplit) on this kind of "
        "GPU to the results",
    )
    b.add_argument(
        "--save-serial",
        metavar="PATH",
        help="also save the serial run (times, memory, first-step rollout and gradients) for --serial-from",
    )
    b.add_argument(
        "--serial-from",
        metavar="PATH",
        help="compare with the serial run a bench of the same spec, grouping and step counts saved "
        "(--save-serial) on this kind of GPU, instead of running serial again",
    )
    b.add_argument(
        "--serial-only",
        action="store_true",
        help="run serial only and save it (--save-serial), so that each rollplex policy is timed later in a "
        "process of its own (--serial-from): a schedule run after another in one process finds the shapes the "
        "first met already cached",
    )
    b.add_argument(
        "--serial-prompts-per-chunk",
        metavar="N|all",
        help="prompts per prefix group in the serial baseline (default: the spec's sharing.prompts_per_chunk); "
        "all: one batch. Serial has no decode to interleave with, so its fastest grouping is the fair baseline",
    )
    b.add_argument(
        "--noise-floor",
        action="store_true",
        help="also rerun serial's first step with rollplex's prefix grouping: the gradient difference that "
        "rounding alone makes (grad_noise_floor); updates then match within twice that, or the dtype's tolerance",
    )
    b.add_argument(
        "--policies",
        nargs="+",
        metavar="POLICY",
        help="rollplex once per GPU sharing policy against one serial run: inline, streams, green, green:<SMs>, "
        "green:adaptive, mps, mps:<trainer %%> (default: the spec's); one JSON and PNG each, named <out>_<policy> "
        "where there are several",
    )
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    from rollplex.executors.signals import stop_signals

    try:
        with stop_signals():  # SIGTERM and SIGHUP end a command as Ctrl-C does
            return args.func(args)
    except (SpecError, PlanDoesNotFit, RunFailed) as e:
        from rollplex.executors.distributed import is_main_process

        if is_main_process() or isinstance(e, RunFailed):  # the spec's and flags' errors: every rank meets them
            print(f"rollplex: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        if getattr(e, "said", True):
            print(f"rollplex: {str(e) or 'interrupted'}", file=sys.stderr)
        return getattr(e, "exit_code", 130)


if __name__ == "__main__":
    sys.exit(main())
