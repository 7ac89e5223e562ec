"""`rollplex bench`'s orchestration: the schedules to time, their order and processes, the saved serial run, the
result documents. `harness.py` times one schedule, `document.py` compares them; `cli.py` only parses the flags.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rollplex.bench.agreement import updates_match
from rollplex.bench.baseline import NoiseFloor, baseline_key, load_baseline, save_baseline
from rollplex.bench.document import beyond_ideal, compare, with_unsplit
from rollplex.bench.harness import noise_floor_grads, run_schedule
from rollplex.bench.provenance import source_commit
from rollplex.bench.variants import policy_label, with_policy, with_prompts_per_chunk
from rollplex.errors import SpecError
from rollplex.executors.device_settings import resolve_device
from rollplex.executors.distributed import check_launch, finish, is_main_process, max_over_ranks
from rollplex.executors.policies import mps_session
from rollplex.executors.preflight import check_spec
from rollplex.graph.ir import Schedule
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.outputs import check_output
from rollplex.report.timeline import plot_timeline


def bench(args: argparse.Namespace) -> int:
    """`rollplex bench SPEC`: serial against rollplex (and unsplit, and each policy) on the same seeds; the
    result JSON and a timeline PNG per policy."""
    loaded = load_spec(args.spec)
    try:
        variants = [with_policy(loaded, p) for p in args.policies] if args.policies else [loaded]
    except ValueError as e:
        raise SpecError("", f"--policies: {e}") from None
    # under the mps policy: before anything touches the GPU; a serial-only process runs its trainer uncapped
    plans = [compile_plan(v) for v in variants]
    check_spec(plans[0])  # before any model is built: what would otherwise fail after it
    with mps_session(plans, cap_trainer=not (args.serial_only or args.save_unsplit)):
        return _bench_variants(args, loaded, variants)


def _bench_variants(args: argparse.Namespace, loaded, variants: list) -> int:
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
    grouping = args.serial_prompts_per_chunk

    def serial_spec(variant):  # the spec serial runs under: the spec itself unless --serial-prompts-per-chunk
        return with_prompts_per_chunk(variant, grouping) if grouping else variant

    try:
        serial_spec(loaded)
    except ValueError as e:
        raise SpecError("", f"--serial-prompts-per-chunk: {e}") from None
    saved_baseline = args.save_serial or args.serial_from
    if saved_baseline and (loaded.spec.parallel.train_tp > 1 or args.unsplit):
        raise SpecError("", "--save-serial / --serial-from", "one process, without --unsplit (--unsplit-from)")
    if (args.save_unsplit or args.unsplit_from) and loaded.spec.parallel.train_tp > 1:
        raise SpecError("", "--save-unsplit / --unsplit-from", "one process (parallel.train_tp 1)")
    if args.unsplit_from and args.unsplit:
        raise SpecError("", "--unsplit-from", "without --unsplit")
    serial_flags = (args.noise_floor, grouping, args.serial_only)  # of the serial run
    if args.save_unsplit and (saved_baseline or args.unsplit or args.unsplit_from or len(variants) > 1
                              or any(serial_flags)):  # fmt: skip
        raise SpecError("", "--save-unsplit times unsplit alone", "without --unsplit, --*-from, --save-serial, the "
                        "serial run's flags and with one policy at most")  # fmt: skip
    if args.unsplit_from and args.serial_only:
        raise SpecError("", "--unsplit-from with --serial-only", "add the unsplit run to the bench that times rollplex")
    if (saved_baseline or args.unsplit_from) and len({v.spec.sharing.policy == "mps" for v in variants}) > 1:
        raise SpecError("", "--save-serial / --serial-from / --unsplit-from with mps and other policies",
                        "bench them apart: a saved run had its rollout in process or not")  # fmt: skip
    if args.serial_only and (not args.save_serial or args.serial_from):
        raise SpecError("", "--serial-only", "with --save-serial PATH and without --serial-from")
    for flag, path in (("--serial-from", args.serial_from), ("--unsplit-from", args.unsplit_from)):
        if path and not Path(path).is_file():
            raise SpecError("", f"{flag} {path}: no such file")
    out = _result_path(args)
    steps = f"{args.warmup} warm-up + {args.steps} steps"
    command = "rollplex " + " ".join(args.argv)
    if args.save_unsplit:
        return _save_unsplit(args, variants[0], steps, command)
    baselines: dict[bool, tuple] = {}  # (serial, unsplit) per rollout engine: in process, or mps's own process
    batches: dict[int, list] = {}  # every schedule trains on the same examples, rendered once
    # a saved unsplit run, checked before anything runs: per rollout engine, as the serial baselines
    engines = {v.spec.sharing.policy == "mps": v for v in variants}  # one variant per rollout engine
    saved_unsplit = {remote: _saved_unsplit(args, v) for remote, v in engines.items()}
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
            baselines[remote] = serial, saved_unsplit[remote], floor if args.noise_floor else None
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
            unsplit = saved_unsplit[remote]
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
        if after_another and torch.cuda.is_available():  # the CPU caches no plan
            print("rollplex bench: an earlier schedule ran in this process, and the shapes it met are cached for "
                  "this one (cuDNN attention plans, GEMM heuristics); for a fair figure time each in its own "
                  "process (--serial-only --save-serial, then --serial-from, one policy each)",
                  file=sys.stderr)  # fmt: skip
        rollplex = run_schedule(variant, Schedule.ROLLPLEX, args.steps, args.warmup, batches)
        result = compare(
            variant, serial, rollplex, command, serial_spec(variant), None if floor is None else floor.grads
        )
        result["commit"] = source_commit()
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
            result = with_unsplit(result, variant, rollplex, unsplit)
            result["unsplit_from"] = args.unsplit_from  # None: unsplit ran in this bench
            for key in ("unsplit_max_param_relative_difference", "unsplit_first_step_grad_relative_difference"):
                result[key] = None if result[key] is None else max_over_ranks(result[key])
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
        if note := beyond_ideal(result):
            print(f"rollplex bench: note: {note}", file=sys.stderr, flush=True)
    finish()
    return 0


def _result_path(args: argparse.Namespace) -> Path:
    """The result JSON's path (`--out`, default runs/bench/<spec>.json; a path without a suffix gets .json), and
    before minutes of steps, each file the bench will write checked: a folder this user can write, made if missing.
    Under torchrun only rank 0 writes them."""
    out = Path(args.out or f"runs/bench/{Path(args.spec).stem}.json")
    if out.suffix not in ("", ".json") or out.is_dir():
        raise SpecError("", f"--out {out}: the result is a JSON file", "end it in .json, or give no suffix")
    out = out.with_suffix(".json")
    writes_result = not (args.serial_only or args.save_unsplit)
    files = (("--out", out if writes_result else None), ("--save-serial", args.save_serial),
             ("--save-unsplit", args.save_unsplit))  # fmt: skip
    for flag, path in files:
        if path and is_main_process():
            check_output(flag, path, create=True)
    return out


def _save_unsplit(args: argparse.Namespace, loaded, steps: str, command: str) -> int:
    """`--save-unsplit PATH`: the unsplit schedule alone, saved for later benches of the spec (`--unsplit-from`):
    a textbook step takes several times a split one, so it is timed in a process of its own."""
    print(f"rollplex bench: unsplit, {steps}", file=sys.stderr)
    unsplit = run_schedule(loaded, Schedule.UNSPLIT, args.steps, args.warmup)
    if is_main_process():
        key = baseline_key(loaded, args.steps, args.warmup, Schedule.UNSPLIT)
        save_baseline(Path(args.save_unsplit), unsplit, key, command)
        print(f"rollplex bench: unsplit saved to {args.save_unsplit}; compare it with serial and rollplex: "
              f"rollplex bench {args.spec} --unsplit-from {args.save_unsplit} ...", file=sys.stderr)  # fmt: skip
    finish()
    return 0


def _saved_unsplit(args: argparse.Namespace, loaded):
    """The unsplit run `--unsplit-from` names, if it was measured as this bench would measure it; else None."""
    if not args.unsplit_from:
        return None
    try:
        run, saved_command, _ = load_baseline(Path(args.unsplit_from), baseline_key(loaded, args.steps, args.warmup,
                                                                                   Schedule.UNSPLIT))  # fmt: skip
    except ValueError as e:
        raise SpecError("", f"--unsplit-from: {e}") from None
    print(f"rollplex bench: unsplit from {args.unsplit_from} ({saved_command})", file=sys.stderr)
    return run
