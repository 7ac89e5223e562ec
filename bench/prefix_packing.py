"""The prefix with its decoder layers over the prompts' real tokens (packed, `rollplex.models.prompt_rows`)
against the same layers over the padded batch, at a spec's own prompts, in one process:

    python bench/prefix_packing.py specs/qwen2_5_vl_3b_h200.yaml --steps 2 --out prefix_packing.json

Per step of prompts (the spec's dataset from position 0) and per layout: the reference's prefix (no grad) and
the actor's (attached, each layer and vision block rerun in backward as `memory.prefix_activations: recompute`
has it) forward, then its backward from a loss on the boundary; CUDA-event medians over `--iters`
after one untimed call. The padded layout is the packed code with `PromptRows.of` answering None. Where the
vision tower runs in window order (`vision.runs_varlen`: on a GPU), a third layout, `packed_by_index`, times the
packed decoder with the tower in the processor's order (its segments gathered and masked, as on the CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rollplex.bench.provenance import source_commit
from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.task import make_tokenizer
from rollplex.graph.load import load_spec
from rollplex.models.chunks import drain
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.prompt_rows import PromptRows
from rollplex.models.rerun import Rerun
from rollplex.models.vision import runs_varlen

CUDA = torch.cuda.is_available()


def seconds(fn) -> float:
    """Wall seconds of fn(), the device synchronised before and after."""
    if CUDA:
        torch.cuda.synchronize()
    begin = time.perf_counter()
    fn()
    if CUDA:
        torch.cuda.synchronize()
    return time.perf_counter() - begin


def measure(model: Qwen2_5_VL, prompts: list, iters: int) -> dict:
    """Median seconds of the reference prefix, the attached prefix forward, and its backward."""

    def reference():
        with torch.no_grad():
            model.prefix(prompts, attached=False)

    def attached():
        boundary = drain(model.prefix_chunks(prompts, attached=True, layers_per_chunk=1, rerun=Rerun()))
        real = boundary.key_mask()[:, None, :, None]
        return sum((k * real).float().square().mean() for k in boundary.keys) + boundary.first_logprobs.mean()

    times = {"reference_s": [], "actor_forward_s": [], "actor_backward_s": []}
    losses = []
    for i in range(iters + 1):
        ref = seconds(reference)
        forward = seconds(lambda: losses.append(attached()))
        backward = seconds(lambda: losses.pop().backward())
        model.zero_grad(set_to_none=True)
        if i > 0:  # the first call plans and compiles
            for key, value in zip(times, (ref, forward, backward), strict=True):
                times[key].append(value)
    return {key: statistics.median(values) for key, values in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--steps", type=int, default=2, help="steps of prompts measured")
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--out", help="write the results here (JSON)")
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    spec = loaded.spec
    device = torch.device("cuda" if CUDA else "cpu")
    torch.manual_seed(spec.run.seed)
    model = Qwen2_5_VL(loaded.model, dtype=getattr(torch, spec.run.dtype), device=device)
    dataset = open_dataset(spec.workload.dataset, make_tokenizer(loaded), spec.run.seed, loaded.path.parent)
    size, rows, packed_of = spec.workload.prompts_per_step, [], PromptRows.of
    in_order = runs_varlen(device, model.model.visual.merger.mlp[0].weight.dtype, loaded.model.vision.head_dim)
    layouts = ("padded", "packed", *(("packed_by_index",) if in_order else ()))
    for step in range(args.steps):
        prompts = [example.prompt for example in batch_at(dataset, step * size, size)]
        lens = [p.num_tokens for p in prompts]
        row = {"step": step, "prompt_tokens": sum(lens), "padded_tokens": max(lens) * len(lens)}
        for layout in layouts:
            padded = staticmethod(lambda lens, device: None)
            PromptRows.of = padded if layout == "padded" else packed_of
            model.model.visual.varlen = False if layout == "packed_by_index" else None
            row[layout] = measure(model, prompts, args.iters)
        PromptRows.of, model.model.visual.varlen = packed_of, None
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{'step':>4} {'tokens':>7} {'padded':>7}  {' / '.join(layouts)} s: reference, actor forward, actor backward"
    )
    for r in rows:
        cells = ["/".join(f"{r[layout][key]:.3f}" for layout in layouts) for key in r["packed"]]
        print(f"{r['step']:>4} {r['prompt_tokens']:>7} {r['padded_tokens']:>7}  {'  '.join(cells)}")
    if args.out:
        gpu = torch.cuda.get_device_name() if CUDA else "cpu"
        with open(args.out, "w") as f:
            command = "python bench/prefix_packing.py " + " ".join(sys.argv[1:])
            result = {"gpu": gpu, "commit": source_commit(), "command": command, "iters": args.iters, "steps": rows}
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
