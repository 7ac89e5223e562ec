"""Where a decode step's time goes on one GPU: each part of the step against the bytes it must read.

    python bench/decode_profile.py --model 3b --batch 32 --prompt-tokens 512 --tokens 256 \
        --out bench/results/decode_profile_3b_h200.json

`bench/decode.py` gives the step's time against its HBM bound; this says which kernels take the rest. After
a rollout cut at 4 tokens (which captures the decode graphs) it replays the full-batch graph `--steps` times
from the middle of the response cache (the step counter rewound there; past the rollout's tokens the cache holds
zeros, which the kernels read all the same) and times it, then records the same replays and the same steps run
eagerly under torch.profiler. Kernels are labelled by where they fall in the step: the Triton kernels name
themselves, and a library kernel (cuBLAS, or our GEMM) takes the label of the projection that follows the
Triton kernel before it (after the input norm: qkv; after the attention's combine: o_proj; after the
post-attention norm: gate_up, and down for the second product there, which the fused gate_up leaves; after
silu_mul: down; after the final norm: lm_head), and a split's sum that of its product. Each label gets its
microseconds per step, launches per step and, for the projections and attention, the HBM rate of the bytes
it must read. `gap_us` is the time in the captured graph between one kernel's end and the next one's start.

A batch of B rows is B // 8 prompts of 8 samples, captured for that batch. With `--live-prompts` (one count per
`--batch`) it is a shrinking rollout's batch instead: the graphs are captured for `--capture-batch` rows (8 prompts
by default) and a batch of B rows is spread over that many of them, row i sample i // N of prompt i % N, as a
rollout's tail leaves its last sequences (the 3B workload's batches of 8 rows hold 4.6 prompts on average):

    python bench/decode_profile.py --model 3b --batch 64 8 4 2 1 --live-prompts 8 5 3 2 1 --prompt-tokens 5888 \
        --tokens 2048
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

import torch
from decode import NUM_SAMPLES, add_kernel_flags, captured, copy_bandwidth, decode_kernels  # bench/: this folder

from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL
from rollplex.rollout.batch import layout
from rollplex.rollout.weights import DecodeKernels

TRITON = ("add_rms_norm", "rotary_to_cache", "sample_", "partial_kernel", "combine_kernel", "silu_mul")
AFTER = {  # the projections that follow a Triton kernel, in order (fused kernels: gate_up, then down)
    "rms_in": ("qkv",),
    "combine_kernel": ("o_proj",),
    "rms_post": ("gate_up", "down"),
    "silu_mul": ("down",),
    "rms_final": ("lm_head",),
}


def label_kernels(names: list[str], num_layers: int) -> list[str]:
    """A label per kernel of whole steps, in launch order (see the module docstring)."""
    labels, norms, last, products = [], 0, "embed", 0
    for name in names:
        triton = next((t for t in TRITON if t in name), None)
        if triton == "add_rms_norm":
            index = norms % (2 * num_layers + 1)
            norms += 1
            last = "rms_final" if index == 2 * num_layers else ("rms_in" if index % 2 == 0 else "rms_post")
            labels.append("add_rms_norm")
        elif triton is not None:
            last = triton
            labels.append("sample" if triton == "sample_" else triton.removesuffix("_kernel"))
        elif "sum_splits" in name and labels:  # a split's sum belongs to the product before it
            labels.append(labels[-1])
            continue
        else:
            after = AFTER.get(last)
            labels.append(after[min(products, len(after) - 1)] if after else f"other after {last}")
            products += 1
            continue
        products = 0
    return labels


def kernels_of(prof) -> list[dict]:
    """The profiled GPU kernels (name, ts, dur in us) in start order, read from the chrome trace."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    return sorted(kernels, key=lambda e: e["ts"])


def summarise(kernels: list[dict], num_steps: int, num_layers: int, bytes_of: dict[str, int]) -> dict:
    labels = label_kernels([k["name"] for k in kernels], num_layers)
    per_label: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "launches": 0, "names": set()})
    for k, label in zip(kernels, labels, strict=True):
        entry = per_label[label]
        entry["us"] += k["dur"] / num_steps
        entry["launches"] += 1
        entry["names"].add(k["name"][:80])
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in itertools.pairwise(kernels)]
    rows = {}
    for label, entry in sorted(per_label.items(), key=lambda kv: -kv[1]["us"]):
        row = {"us": round(entry["us"], 2), "launches": entry["launches"] / num_steps, "names": sorted(entry["names"])}
        if label in bytes_of:
            row["mbytes"] = round(bytes_of[label] / 1e6, 2)
            row["gb_s"] = round(bytes_of[label] / (entry["us"] * 1e-6) / 1e9, 1)
        rows[label] = row
    return {
        "kernels_per_step": len(kernels) / num_steps,
        "kernel_us_per_step": round(sum(k["dur"] for k in kernels) / num_steps, 1),
        "gap_us_per_step": round(sum(g for g in gaps if g < 1000) / num_steps, 1),  # not the gaps between steps
        "labels": rows,
    }


def step_bytes(model: Qwen2_5_VL, batch: int, prompt_tokens: int, at_step: int, prompts: int) -> dict[str, int]:
    """Bytes each projection (over all layers) and the attention must read in one step at response step `at_step`,
    the batch's rows over `prompts` prompts."""
    text, lm = model.config.text, model.model.language_model
    layer = lm.layers[0]
    attn, mlp = layer.self_attn, layer.mlp

    def nbytes(*tensors: torch.Tensor) -> int:
        return text.num_hidden_layers * sum(t.numel() * t.element_size() for t in tensors)

    kv_token = 2 * text.num_key_value_heads * text.head_dim * 2  # K and V, one layer, bf16
    return {
        "qkv": nbytes(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight),
        "o_proj": nbytes(attn.o_proj.weight),
        "gate_up": nbytes(mlp.gate_proj.weight, mlp.up_proj.weight),
        "down": nbytes(mlp.down_proj.weight),
        "lm_head": model.lm_head.weight.numel() * model.lm_head.weight.element_size(),
        "partial": text.num_hidden_layers * kv_token * (prompts * prompt_tokens + batch * at_step),
    }


def profile_case(
    model: Qwen2_5_VL,
    batch: int,
    prompt_tokens: int,
    tokens: int,
    steps: int,
    bandwidth: float,
    kernels: DecodeKernels,
    spread: tuple[int, int] | None = None,
) -> dict:
    """One batch's case; `spread` (capture batch, live prompts): the batch's rows over that many prompts of graphs
    captured for the larger batch (see the module docstring)."""
    engine = captured(model, spread[0] if spread else batch, prompt_tokens, tokens, kernels)
    graphs, step = engine.graphs, engine.graphs.step
    prompts = batch // NUM_SAMPLES
    if spread:
        prompts = spread_rows(step, batch, spread[1], spread[0] // NUM_SAMPLES)
    launched = graphs.launch_count(prompts)  # the graph of the batch's size and chunk
    assert (batch, launched) in graphs.graphs, f"batch {batch} over {prompts} prompts is not a captured case"
    graph = graphs.graphs[batch, launched]
    start = (tokens - steps) // 2
    assert start >= 1, "--steps must leave room in the response cache"

    def replay(run) -> None:  # the caller rewinds the step counter first, outside any profile
        for _ in range(steps):
            run()

    step.step.fill_(start)
    replay(graph.replay)  # warm
    step.step.fill_(start)
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    replay(graph.replay)
    end.record()
    torch.cuda.synchronize()
    graph_ms = begin.elapsed_time(end) / steps
    num_layers = model.config.text.num_hidden_layers
    bytes_of = step_bytes(model, batch, prompt_tokens, start + steps // 2, prompts)
    total_bytes = sum(bytes_of.values())
    result = {
        "batch": batch,
        "live_prompts": prompts,
        "capture_batch": spread[0] if spread else batch,
        "prompt_tokens": prompt_tokens,
        "response_steps": [start, start + steps],
        "graph_step_ms": round(graph_ms, 4),
        "bytes_per_step": total_bytes,
        "hbm_bound_ms": round(total_bytes / bandwidth * 1e3, 4),
        "fraction_of_hbm_bound": round(total_bytes / bandwidth / (graph_ms * 1e-3), 4),
    }
    from torch.profiler import ProfilerActivity, profile

    for mode, run in (("graph", graph.replay), ("eager", lambda: step.forward(batch, launched))):
        step.step.fill_(start)
        torch.cuda.synchronize()
        with torch.no_grad(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            replay(run)
            torch.cuda.synchronize()
        kernels = kernels_of(prof)
        if len(kernels) % steps:
            result[mode] = {"error": f"{len(kernels)} kernels over {steps} steps"}
            continue
        result[mode] = summarise(kernels, steps, num_layers, bytes_of)
    return result


def spread_rows(step, rows: int, live_prompts: int, num_prompts: int) -> int:
    """Lays `rows` batch rows over `live_prompts` of the step's `num_prompts` prompts (row i: sample i // N of prompt
    i % N) in the step's row maps, as the engine places a shrinking batch; the live prompts' count."""
    assert 1 <= live_prompts <= min(num_prompts, rows) and rows <= live_prompts * NUM_SAMPLES, (
        f"{rows} rows over {live_prompts} of {num_prompts} prompts of {NUM_SAMPLES} samples"
    )
    live = torch.tensor([(i % live_prompts) * NUM_SAMPLES + i // live_prompts for i in range(rows)])
    placed = layout(live, rows, num_prompts, NUM_SAMPLES)
    step.slots[:rows].copy_(placed.slots)
    step.row_start.copy_(placed.row_start)
    step.row_count.copy_(placed.row_count)
    step.batch_prompts.copy_(placed.prompts)
    return live_prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--batch", nargs="+", type=int, default=[32])
    ap.add_argument("--prompt-tokens", nargs="+", type=int, default=[512])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--live-prompts", nargs="+", type=int, help="per --batch: its rows over this many prompts")
    ap.add_argument("--capture-batch", type=int, default=8 * NUM_SAMPLES, help="with --live-prompts")
    add_kernel_flags(ap)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.live_prompts and len(args.live_prompts) != len(args.batch):
        ap.error(f"--live-prompts: one count per --batch ({len(args.batch)}), not {len(args.live_prompts)}")
    for batch, live in zip(args.batch, args.live_prompts or (), strict=False):
        if not (1 <= live <= min(args.capture_batch // NUM_SAMPLES, batch) and batch <= live * NUM_SAMPLES):
            ap.error(f"--live-prompts {live} for batch {batch}: from ceil(batch / {NUM_SAMPLES}) to min(batch, "
                     f"--capture-batch / {NUM_SAMPLES})")  # fmt: skip
    kernels = decode_kernels(args)
    bandwidth = copy_bandwidth()
    torch.manual_seed(0)
    model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{args.model}"), dtype=torch.bfloat16, device="cuda").eval()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "model": args.model,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "command": "python bench/decode_profile.py " + " ".join(sys.argv[1:]),
        "kernels": asdict(kernels),
        "cases": [],
    }
    for i, batch in enumerate(args.batch):
        spread = (args.capture_batch, args.live_prompts[i]) if args.live_prompts else None
        for prompt_tokens in args.prompt_tokens:
            case = profile_case(model, batch, prompt_tokens, args.tokens, args.steps, bandwidth, kernels, spread)
            result["cases"].append(case)
            torch.cuda.empty_cache()  # the case's decode buffers and graphs went with its engine
            if args.out:
                args.out.write_text(json.dumps(result, indent=2) + "\n")
    for case in result["cases"]:
        head = f"batch {case['batch']} over {case['live_prompts']} prompts of {case['prompt_tokens']}"
        print(f"\n{head}: graph step {case['graph_step_ms']} ms, bound {case['hbm_bound_ms']} ms "
              f"({case['fraction_of_hbm_bound']:.1%})")  # fmt: skip
        for mode in ("graph", "eager"):
            part = case[mode]
            if "error" in part:
                print(f"  {mode}: {part['error']}")
                continue
            print(f"  {mode}: {part['kernels_per_step']:.0f} kernels, {part['kernel_us_per_step']} us of kernels, "
                  f"{part['gap_us_per_step']} us of gaps")  # fmt: skip
            for label, row in part["labels"].items():
                rate = f"{row['gb_s']:>7.0f} GB/s" if "gb_s" in row else ""
                print(f"    {label:>16} {row['us']:>8.1f} us {row['launches']:>5.0f} launches {rate}")


if __name__ == "__main__":
    main()
