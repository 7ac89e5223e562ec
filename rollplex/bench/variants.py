"""The spec variants a bench runs: another GPU sharing policy (`--policies`) or prompt grouping
(`--serial-prompts-per-chunk`), and the label a policy is reported under.

Not here: running them (`harness.py`).
"""

from __future__ import annotations

import dataclasses

from rollplex.graph.load import LoadedSpec


def parse_policy(text: str) -> tuple[str, int | str | None]:
    """`inline`, `streams`, `green`, `green:<SMs>`, `green:adaptive`, `mps` or `mps:<trainer %>` ->
    (sharing.policy, its number: prefix_sms under green, mps_trainer_percent under mps; None keeps the spec's)."""
    name, _, arg = text.partition(":")
    usage = "use inline, streams, green, green:<SMs>, green:adaptive, mps or mps:<trainer %>"
    if name not in ("inline", "streams", "green", "mps") or (arg and name not in ("green", "mps")):
        raise ValueError(f"policy '{text}': {usage}")
    if not arg:
        return name, None
    if name == "green" and arg == "adaptive":
        return name, arg
    if not arg.isdigit() or not 1 <= int(arg) <= (100 if name == "mps" else 10_000):
        raise ValueError(f"policy '{text}': {usage}")
    return name, int(arg)


def with_policy(loaded: LoadedSpec, text: str) -> LoadedSpec:
    """The spec with `sharing.policy` (and `prefix_sms` or `mps_trainer_percent`) from a `--policies` entry."""
    name, arg = parse_policy(text)
    key = "prefix_sms" if name == "green" else "mps_trainer_percent"
    if name == "mps" and loaded.spec.cluster.num_gpus > 1:
        raise ValueError("mps runs on one GPU (its rollout process beside one trainer)")
    return _with_sharing(loaded, {"policy": name} | ({key: arg} if arg is not None else {}))


def with_prompts_per_chunk(loaded: LoadedSpec, text: str) -> LoadedSpec:
    """The spec with `sharing.prompts_per_chunk` from `--serial-prompts-per-chunk` (N >= 1, or all: one batch).
    Serial has no decode to interleave with: its prefixes may run in bigger groups than rollplex's chunks, and a
    fair baseline uses whichever grouping is fastest for it (the plan then counts that group's layer in flight)."""
    if text == "all":
        value = None
    elif text.isdigit() and int(text) >= 1:
        value = int(text)
    else:
        raise ValueError(f"{text!r} is not a number of prompts >= 1 or all")
    return _with_sharing(loaded, {"prompts_per_chunk": value})


def _with_sharing(loaded: LoadedSpec, update: dict) -> LoadedSpec:
    sharing = loaded.spec.sharing.model_copy(update=update)
    return dataclasses.replace(loaded, spec=loaded.spec.model_copy(update={"sharing": sharing}))


def policy_label(spec) -> str:
    s = spec.sharing
    if s.policy == "green":
        return f"green:{s.prefix_sms}"
    if s.policy == "mps" and s.mps_trainer_percent is not None:
        return f"mps:{s.mps_trainer_percent}"
    return s.policy
