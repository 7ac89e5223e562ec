"""A spec's variants for `bench/run7b_h200.sh`, and the summary of a run of one.

    python bench/run_variants.py spec SPEC VARIANT      # writes the variant's spec, prints its path
    python bench/run_variants.py summary METRICS SPEC   # the run's phases, its peaks against the plan's, its steps

A VARIANT is `shipped` or keys joined by '+' (`KEYS`, `chunkN`: memory.optimizer_chunk_mib N, `mbN`:
memory.microbatch_tokens N, `tailN`: sharing.tail_rows N).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

KEYS = {
    "joined": ("sharing", "update_beside_prefix", False),
    "beside": ("sharing", "update_beside_prefix", True),
    "nocudnn": ("run", "cudnn_attention", False),
    "hbm": ("memory", "prefix_saved", "hbm"),
    "norecompute": ("memory", "recompute", "none"),
    "selective": ("memory", "recompute", "selective"),
    "compiled": ("run", "compiled_layers", True),
    "keepcache": ("memory", "empty_cache", "mappings"),
    "adaptive": ("sharing", "prefix_sms", "adaptive"),
    "flex": ("run", "suffix_attention", "flex"),
    "cudnnsuffix": ("run", "suffix_attention", "cudnn"),
}


def variant(spec: dict, name: str) -> dict:
    """`spec` (parsed YAML) with the variant's keys set."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in spec.items()}
    for part in name.split("+"):
        if part == "shipped":
            continue
        if part.startswith("chunk") and part[5:].isdigit():
            section, key, value = "memory", "optimizer_chunk_mib", int(part[5:])
        elif part.startswith("mb") and part[2:].isdigit():
            section, key, value = "memory", "microbatch_tokens", int(part[2:])
        elif part.startswith("tail") and part[4:].isdigit():
            section, key, value = "sharing", "tail_rows", int(part[4:])
        elif part in KEYS:
            section, key, value = KEYS[part]
        else:
            raise SystemExit(f"unknown variant part {part!r}: shipped, {', '.join(KEYS)}, chunkN, mbN or tailN")
        out.setdefault(section, {})[key] = value
    return out


def summary(metrics: Path, spec: Path) -> str:
    from rollplex.graph.load import load_spec
    from rollplex.graph.plan import compile_plan
    from rollplex.report.efficiency import run_summary

    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    planned = {str(p.phase.value): p.peak_bytes / 2**30 for p in compile_plan(load_spec(spec)).residency.phases}
    warm = records[1:] or records
    peaks = {k: max(r["peak_gib_by_phase"][k] for r in warm) for k in warm[0]["peak_gib_by_phase"]}
    return "\n".join(
        [
            run_summary(records),
            "peaks GiB (measured / plan): "
            + ", ".join(f"{k}: {v:.1f} / {planned.get(k, 0):.1f}" for k, v in peaks.items()),
            "steps: " + ", ".join(f"{r['time_s']['step']:.2f}" for r in records),
        ]
    )


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "spec":
        path = Path(f"/tmp/{Path(argv[1]).stem}_{argv[2]}.yaml")
        path.write_text(yaml.safe_dump(variant(yaml.safe_load(Path(argv[1]).read_text()), argv[2]), sort_keys=False))
        print(path)
    elif len(argv) == 3 and argv[0] == "summary":
        print(summary(Path(argv[1]), Path(argv[2])))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
