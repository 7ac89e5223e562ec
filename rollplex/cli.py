"""`rollplex compile|run|bench`: argument parsing and exit codes only; the work lives in the library."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rollplex.errors import PlanDoesNotFit, RunFailed, SpecError


def _compile(args: argparse.Namespace) -> int:
    from rollplex.graph.ir import Schedule
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import check_fits, compile_plan
    from rollplex.report.jsonout import plan_to_json

    loaded = load_spec(args.spec)
    plan = compile_plan(loaded, Schedule(args.schedule) if args.schedule else None)
    efficiencies = _efficiencies(args.efficiency, plan.schedule.value) if args.efficiency else None
    if args.check_data:
        from rollplex.executors.datacheck import check_data

        print(check_data(loaded).line(), file=sys.stderr)
    if args.plot:
        from rollplex.report.plot import plot_memory

        plot_memory(plan, args.plot)
    if args.dry_run:
        if args.format == "json":
            print(json.dumps(plan_to_json(plan, efficiencies), indent=1))
        else:
            from rollplex.report.tables import report

            print(report(plan, naive=args.naive, efficiencies=efficiencies))
        check_fits(plan)
        return 0
    check_fits(plan)
    Path(args.output).write_text(json.dumps(plan_to_json(plan), indent=1))
    print(
        f"wrote {args.output}: peak {plan.residency.peak_bytes / 2**30:.1f} GiB per GPU, schedule {plan.schedule.value}"
    )
    return 0


def _efficiencies(path: str, schedule: str) -> dict[str, float]:
    """Each phase's efficiency (bound over measured) as a `rollplex bench` result recorded it, for `schedule`."""
    try:
        result = json.loads(Path(path).read_text())
        by_schedule = result["efficiency"]
        return {k: float(v) for k, v in by_schedule.get(schedule, by_schedule["serial"]).items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpecError("", f"--efficiency {path}: not a bench result with efficiencies ({e})") from None


def _plan_to_run(args: argparse.Namespace):
    """The plan `rollplex run` executes: a `plan.json` as it is, or the spec compiled (once) for its schedule."""
    from rollplex.graph.ir import Schedule
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import compile_plan

    if Path(args.spec).suffix == ".json":
        from rollplex.graph.planfile import read_plan

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
    from rollplex.executors.loop import RunOptions, train

    opts = RunOptions(
        steps=args.steps or spec.run.steps,
        out_dir=Path(args.out or f"runs/{Path(args.spec).stem}"),
        resume=args.resume,
        checkpoint_every=args.checkpoint_every or spec.run.checkpoint_every,
        progress=not args.quiet,
        checkpoints=not args.no_checkpoints,
    )
    if args.no_checkpoints and args.checkpoint_every:
        raise SpecError("", "--no-checkpoints with --checkpoint-every", "choose one")
    if opts.out_dir.exists() and not opts.out_dir.is_dir():
        raise SpecError("", f"--out {opts.out_dir} is a file", "give a directory (it is created if missing)")
    if opts.resume and not (opts.out_dir / "checkpoints").is_dir():
        raise SpecError("", f"--resume: no checkpoints in {opts.out_dir}", "run once without --resume first")
    from rollplex.executors.distributed import check_world
    from rollplex.executors.engines import resolve_device
    from rollplex.executors.policies import mps_session

    with mps_session([plan]):  # under the mps policy: before anything touches the GPU
        try:
            resolve_device(spec.run.device)
        except ValueError as e:
            raise loaded.locate(SpecError("run.device", str(e))) from None
        try:
            check_world(spec.cluster.num_gpus)
        except ValueError as e:
            raise loaded.locate(SpecError("cluster.gpus_per_node", str(e))) from None
        records = train(plan, opts)
    from rollplex.executors.distributed import finish, is_main_process

    if records and is_main_process():  # one summary line, from rank 0 under torchrun
        last = records[-1]
        summary = f"reward {last['reward_mean']:.3f}, loss {last['loss']:.4f}"
        print(f"step {last['step']}: {summary}; metrics in {opts.out_dir / 'metrics.jsonl'}")
    finish()
    return 0


def _bench(args: argparse.Namespace) -> int:

    from rollplex.graph.load import load_spec

    loaded = load_spec(args.spec)
    from rollplex.executors.bench import with_policy
    from rollplex.executors.policies import mps_session

    try:
        variants = [with_policy(loaded, p) for p in args.policies] if args.policies else [loaded]
    except ValueError as e:
        raise SpecError("", f"--policies: {e}") from None
    # under the mps policy: before anything touches the GPU; a serial-only process runs its trainer uncapped
    from rollplex.graph.plan import compile_plan

    plans = [compile_plan(v) for v in variants]
    with mps_session(plans, cap_trainer=not args.serial_only):
        return _bench_variants(args, loaded, variants)


def _bench_variants(args: argparse.Namespace, loaded, variants: list) -> int:
    import json

    from rollplex.executors.agreement import updates_match
    from rollplex.executors.baseline import NoiseFloor, baseline_key, load_baseline, save_baseline
    from rollplex.executors.bench import (
        compare,
        noise_floor_grads,
        policy_label,
        run_schedule,
        with_prompts_per_chunk,
        with_unsplit,
    )
    from rollplex.executors.distributed import check_launch, finish, is_main_process, max_over_ranks
    from rollplex.executors.engines import resolve_device
    from rollplex.graph.ir import Schedule
    from rollplex.report.timeline import plot_timeline

    try:
        resolve_device(loaded.spec.run.device)
    except ValueError as e:
        raise loaded.locate(SpecError("run.device", str(e))) from None
    try:
        check_launch(loaded.spec.parallel.train_tp)
    except ValueError as e:
        raise loaded.locate(SpecError("parallel.train_tp", str(e))) from None
    if args.steps < 1 or args.warmup < 0:
        raise SpecError("", f"--steps {args.steps} / --warmup {args.warmup}", "use --steps >= 1 and --warmup >= 0")
    out = Path(args.out or f"bench/results/{Path(args.spec).stem}.json")
    out = out if out.suffix == ".json" else out.with_name(out.name + ".json")
    grouping = args.serial_prompts_per_chunk

    def serial_spec(variant):  # the spec serial runs under: the spec itself unless --serial-prompts-per-chunk
        return with_prompts_per_chunk(variant, grouping) if grouping else variant

    try:
        serial_spec(loaded)
    except ValueError as e:
        raise SpecError("", f"--serial-prompts-per-chunk: {e}") from None
    saved_baseline = args.save_serial or args.serial_from
    if saved_baseline and (loaded.spec.parallel.train_tp > 1 or args.unsplit):
        raise SpecError("", "--save-serial / --serial-from", "one process, without --unsplit")
    if saved_baseline and len({v.spec.sharing.policy == "mps" for v in variants}) > 1:
        raise SpecError("", "--save-serial / --serial-from with mps and other policies", "bench them apart")
    if args.serial_only and (not args.save_serial or args.serial_from):
        raise SpecError("", "--serial-only", "with --save-serial PATH and without --serial-from")
    if args.serial_from and not Path(args.serial_from).is_file():
        raise SpecError("", f"--serial-from {args.serial_from}: no such file")
    steps = f"{args.warmup} warm-up + {args.steps} steps"
    baselines: dict[bool, tuple] = {}  # (serial, unsplit) per rollout engine: in process, or mps's own process
    batches: dict[int, list] = {}  # every schedule trains on the same examples, rendered once
    command = "rollplex " + " ".join(args.argv)
    for variant in variants:
        remote = variant.spec.sharing.policy == "mps"
        identity = baseline_key(serial_spec(variant), args.steps, args.warmup)
        if remote not in baselines and args.serial_from:  # measured by an earlier bench of this spec
            try:
                serial, serial_command, floor = load_baseline(Path(args.serial_from), identity)
            except ValueError as e:
                raise SpecError("", f"--serial-from: {e}") from None
            print(f"rollplex bench: serial from {args.serial_from} ({serial_command})", file=sys.stderr)
            if args.noise_floor and floor is None:
                print(f"rollplex bench: {args.serial_from} holds no noise floor (saved without --noise-floor)",
                      file=sys.stderr)  # fmt: skip
            baselines[remote] = serial, None, floor if args.noise_floor else None
        if remote not in baselines:  # the baselines use the same rollout engine as the policy they are compared to
            where = " (rollout in its own process)" if remote else ""
            print(f"rollplex bench: serial{where}, {steps}", file=sys.stderr)
            serial = run_schedule(serial_spec(variant), Schedule.SERIAL, args.steps, args.warmup, batches)
            floor = None
            if args.noise_floor:  # serial's first step again, grouped as rollplex groups its prefixes
                per_chunk = variant.spec.sharing.prompts_per_chunk or "all"
                print(f"rollplex bench: serial's first step, {per_chunk} prompts per chunk as rollplex{where}"
                      " (noise floor)", file=sys.stderr)  # fmt: skip
                grads = noise_floor_grads(serial, run_schedule(variant, Schedule.SERIAL, 1, 0, batches))
                if grads is None:
                    print("rollplex bench: the noise-floor run sampled other tokens than serial: no floor",
                          file=sys.stderr)  # fmt: skip
                else:
                    floor = NoiseFloor(grads, variant.spec.sharing.prompts_per_chunk)
            if args.save_serial:
                save_baseline(Path(args.save_serial), serial, identity, command, floor)
            if args.serial_only:
                print(f"rollplex bench: serial saved to {args.save_serial}; time rollplex in a process of its own: "
                      f"rollplex bench {args.spec} --serial-from {args.save_serial} ...", file=sys.stderr)  # fmt: skip
                return 0
            unsplit = None
            if args.unsplit:
                print(f"rollplex bench: unsplit{where}, {steps}", file=sys.stderr)
                unsplit = run_schedule(variant, Schedule.UNSPLIT, args.steps, args.warmup, batches)
            baselines[remote] = serial, unsplit, floor
        serial, unsplit, floor = baselines[remote]
        if floor is not None and floor.prompts_per_chunk != variant.spec.sharing.prompts_per_chunk:
            print(f"rollplex bench: the noise floor was measured with {floor.prompts_per_chunk or 'all'} prompts per "
                  "chunk, not rollplex's: no floor", file=sys.stderr)  # fmt: skip
            floor = None
        label = policy_label(variant.spec)
        print(f"rollplex bench: rollplex ({label}), {steps}", file=sys.stderr)
        after_another = variant is not variants[0] or not args.serial_from
        if after_another:
            print("rollplex bench: an earlier schedule ran in this process, and the shapes it met are cached for "
                  "this one (cuDNN attention plans, GEMM heuristics); for a fair figure time each in its own "
                  "process (--serial-only --save-serial, then --serial-from, one policy each)",
                  file=sys.stderr)  # fmt: skip
        rollplex = run_schedule(variant, Schedule.ROLLPLEX, args.steps, args.warmup, batches)
        result = compare(
            variant, serial, rollplex, command, serial_spec(variant), None if floor is None else floor.grads
        )
        result["serial_from"] = args.serial_from  # None: serial ran in this bench
        result["after_another_schedule_in_process"] = after_another
        # under tensor parallelism each rank compared its own shards: the worst rank decides
        keys = ("max_param_relative_difference", "first_step_grad_relative_difference", "grad_noise_floor")
        for key in keys:  # None on every rank alike (no --noise-floor; final weights of a saved serial run)
            result[key] = None if result[key] is None else max_over_ranks(result[key])
        result["updates_match"] = updates_match(
            result["first_step_rollouts_match"],
            result["first_step_grad_relative_difference"],
            loaded.spec.run.dtype,
            result["grad_noise_floor"],
        )
        runs = {"serial": serial, "rollplex": rollplex}
        if unsplit is not None:
            result = with_unsplit(result, rollplex, unsplit)
            for key in ("unsplit_max_param_relative_difference", "unsplit_first_step_grad_relative_difference"):
                result[key] = max_over_ranks(result[key])
            runs["unsplit"] = unsplit
        if not is_main_process():
            continue
        path = out if len(variants) == 1 else out.with_name(f"{out.stem}_{label.replace(':', '')}.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        png = path.with_suffix(".png")
        plot_timeline(
            {k: r.timeline for k, r in runs.items()}, png, f"{Path(args.spec).stem} ({label}) on {result['gpu']}"
        )
        s, balance = result["step_s"], result["step_balance_s"]
        slowdown, on_device = result["decode_slowdown"], result["decode_slowdown_on_device"]
        print(
            f"{label}: step serial {s['serial']:.3f} s, rollplex {s['rollplex']:.3f} s, {result['speedup']:.3f}x "
            f"(ideal {result['ideal_speedup']:.3f}x, overlap alone {result['overlap_speedup']:.3f}x); decode slowdown "
            f"{'n/a' if slowdown is None else f'{slowdown:.3f}x'}"
            f"{'' if on_device is None else f' ({on_device:.3f}x on the device)'}; rollplex - serial: prefixes hidden "
            f"{balance['prefixes_hidden']:+.2f} s, rollout {balance['rollout_longer']:+.2f} s, after it "
            f"{balance['after_rollout_longer']:+.2f} s; updates match: {result['updates_match']} (first "
            f"step: same rollout {result['first_step_rollouts_match']}, gradients "
            f"{result['first_step_grad_relative_difference']:.2e} apart); "
            f"{path}, {png}",
            flush=True,
        )
    finish()
    return 0


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
        metavar="BENCH.json",
        help="predict each phase's seconds at the efficiencies a `rollplex bench` result recorded (bound / measured)",
    )
    c.add_argument("-o", "--output", default="plan.json", help="where to write the plan (default plan.json)")
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
    b.add_argument("--out", help="result JSON (default bench/results/<spec name>.json; the PNG goes beside it)")
    b.add_argument("--unsplit", action="store_true", help="also time the unsplit schedule (textbook GRPO)")
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
        "green:adaptive, mps, mps:<trainer %%> (default: the spec's); one JSON and PNG each, named <out>_<policy>",
    )
    b.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    args.argv = argv
    try:
        return args.func(args)
    except (SpecError, PlanDoesNotFit, RunFailed) as e:
        print(f"rollplex: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("rollplex: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
