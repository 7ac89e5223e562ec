"""What attention shapes met for the first time cost, per SDPA backend: a GRPO step's suffix and prefix calls.

    python bench/sdpa_shapes.py --model qwen2_5_vl_3b --steps 3 --out bench/results/sdpa_shapes_h200.json

Every step of a video GRPO run meets attention shapes it has not met before: its prompts' lengths, its
responses' lengths and the length batches scoring makes of them all change from step to step. cuDNN's
attention builds an execution plan for each new shape on the host, and PyTorch caches it per process; the
other backends have no per-shape plan. This replays the attention calls of `--steps` steps of a workload
preset (prompt lengths of its rendered layouts, response lengths drawn from its distribution, grouped as
`rollplex.executors.scoring.length_batches` groups them) with the runtime's shapes, once per backend, each
backend in a process of its own (nothing cached from another backend):

- suffix: per length batch, each decoder layer's joint call (queries [B, heads, T, D] over the prompt's KV
  and their own, a [B, 1, T, S + T] mask; T is the batch's longest response less one), under no_grad
  (reference) and checkpointed with its backward (actor: the forward runs twice, as in the runtime);
- prefix: per prompt (rollplex's grouping), each layer's causal call [1, heads, L, D] over [1, kv_heads, L, D]
  (GQA), forward and backward; prefix_all: the same for all prompts in one [P, heads, L_max, D] call
  (serial's `all` grouping);
- vision: per prompt's video, each vision block's attention as the runtime runs it (`segment_attention`:
  windows in most blocks, whole frames in the full-attention ones), forward and backward; the segments'
  number and lengths follow the video's frames and size, so they change from step to step; vision_all: the
  same for all the step's videos at once (serial's `all` grouping: videos of mixed sizes in one layout).

Per backend and part: seconds per step with new shapes (cold: what a run pays), the same shapes again right
after (warm: kernels and launches), and the mean difference (the host's per-shape cost). `default` is torch's
own choice, `nocudnn` what `run.cudnn_attention: false` leaves torch (flash, memory-efficient, math),
`cudnn_pow2` cuDNN with TORCH_CUDNN_SDPA_AVOID_RECOMPILE=1 (plans keyed on power-of-2 lengths; not for calls
with a mask, so the suffix should plan as before and the prefix once per length class), `cudnn_bucketed`
cuDNN with the prefix's calls at `attention_length` buckets of length and each vision block's segments in one
packed call (rollplex/models/attention.py, vision.py: what a run on a GPU does; the suffix as `cudnn`), whose
cold cost falls as steps meet buckets already planned (`--steps` 6 or more).
A backend that cannot run a call (flash with a mask) is reported as such.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rollplex.data.presets import get_preset, sample_response_lengths
from rollplex.data.video import grid_thw
from rollplex.executors.scoring import PADDING_WASTE, length_batches
from rollplex.models.attention import causal_sdpa
from rollplex.models.config import VisionConfig, load_model_config
from rollplex.models.vision import pack_segments, segment_attention
from rollplex.models.vision_layout import patch_layout, segment_groups

BACKENDS = ("default", "nocudnn", "cudnn", "cudnn_pow2", "cudnn_bucketed", "efficient", "flash")
CHILD_ENV = {"cudnn_pow2": {"TORCH_CUDNN_SDPA_AVOID_RECOMPILE": "1"}}  # cuDNN keyed on power-of-2 lengths (no mask)


def step_shapes(preset_name: str, step: int, prompts: int, samples: int) -> tuple[list[int], list[tuple[int, int]]]:
    """A step's prompt lengths and its length batches (rows, width) of responses, as the runtime forms them."""
    preset = get_preset(preset_name)
    prompt_lens = [preset.prompt_tokens(preset.layout(seed=step, index=i)) for i in range(prompts)]
    lens = sample_response_lengths(preset, prompts * samples, seed=1000 + step).tolist()
    batches = length_batches(lens, PADDING_WASTE, max_rows=samples)
    return prompt_lens, [(len(b), max(lens[i] for i in b)) for b in batches]


def vision_shapes(
    preset_name: str, step: int, prompts: int, vision: VisionConfig, grouped: bool = False
) -> list[tuple[list, list]]:
    """Per prompt of a step: its video's (windows, frames) segment groups (`segment_groups`, on the CPU);
    `grouped`: one entry for all the step's videos together (serial's `all` grouping: mixed sizes)."""
    preset = get_preset(preset_name)
    layouts = [preset.layout(seed=step, index=i) for i in range(prompts)]
    grids = [grid_thw(layout.num_frames, *preset.frame_size(layout), preset.vision) for layout in layouts]
    out = []
    for part in [grids] if grouped else [[grid] for grid in grids]:
        patches = patch_layout(part, vision)
        out.append((segment_groups(patches.windows), segment_groups(patches.frames)))
    return out


def vision_calls(shapes, vision: VisionConfig, device: str, bucketed: bool = False) -> None:
    """Each prompt's vision blocks' attention through the runtime's `segment_attention`: one call per segment
    length, or under `bucketed` the packed call (`pack_segments`, as `segment_layout` picks on a GPU with
    cuDNN), forward and backward."""
    dim = vision.hidden_size // vision.num_heads

    def layout(groups):
        packed = pack_segments(groups) if bucketed else None
        return [t.to(device) for t in (packed if packed is not None else groups)]

    for windows, frames in shapes:
        num_patches = sum(g.numel() for g in windows)  # the windows (and the frames) partition the patches
        windows, frames = layout(windows), layout(frames)
        outs = []
        for block in range(vision.depth):
            q, k, v = (torch.randn(num_patches, vision.num_heads, dim, device=device, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            groups = frames if block in vision.fullatt_block_indexes else windows
            outs.append(segment_attention(q, k, v, groups).float().sum())
        torch.stack(outs).sum().backward()


def backend_context(name: str):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    cudnn, flash, efficient = SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION
    chosen = {"cudnn": [cudnn], "cudnn_pow2": [cudnn], "cudnn_bucketed": [cudnn], "efficient": [efficient],
              "flash": [flash], "nocudnn": [flash, efficient, SDPBackend.MATH]}  # fmt: skip
    return sdpa_kernel(chosen[name]) if name in chosen else contextlib.nullcontext()


def suffix_calls(shapes, layers: int, heads: int, kv_heads: int, dim: int, train: bool, device: str) -> None:
    prompt_lens, batches = shapes[:2]
    longest = max(prompt_lens)
    for rows, width in batches:
        tokens = max(width - 1, 1)  # the runtime scores responses[:, :-1] (token 0 comes from the boundary)
        q = torch.randn(rows, heads, tokens, dim, device=device, dtype=torch.bfloat16, requires_grad=train)
        kv = torch.randn(rows, kv_heads, longest + tokens, dim, device=device, dtype=torch.bfloat16)
        k = kv.repeat_interleave(heads // kv_heads, dim=1).requires_grad_(train)
        v = k.detach().clone().requires_grad_(train)
        own = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        lens = torch.tensor([prompt_lens[i % len(prompt_lens)] for i in range(rows)], device=device)
        prompt = torch.arange(longest, device=device) < lens[:, None]
        mask = torch.cat([prompt[:, None, :].expand(rows, tokens, -1), own.expand(rows, -1, -1)], dim=-1)[:, None]
        if not train:
            with torch.no_grad():
                for _ in range(layers):
                    F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            continue
        outs = [checkpoint(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, use_reentrant=False)
                for _ in range(layers)]  # fmt: skip
        torch.stack(outs).float().sum().backward()


def prefix_calls(
    shapes, layers: int, heads: int, kv_heads: int, dim: int, device: str, grouped: bool = False, bucketed: bool = False
) -> None:
    prompt_lens = shapes[0]
    groups = [(len(prompt_lens), max(prompt_lens))] if grouped else [(1, length) for length in prompt_lens]
    for batch, length in groups:
        q = torch.randn(batch, heads, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(batch, kv_heads, length, dim, device=device, dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn_like(k, requires_grad=True)
        outs = [causal_sdpa(q, k, v, bucketed=bucketed) for _ in range(layers)]
        torch.stack(outs).float().sum().backward()


def timed(device: str, fn, *args) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    fn(*args)
    sync()
    return time.perf_counter() - start


def measure(backend: str, args) -> dict:
    """One backend's seconds per part: each step's new shapes (cold), then the same shapes again (warm)."""
    config = load_model_config(args.model)
    text, vision = config.text, config.vision
    dims = (text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads, text.head_dim)
    at = {"device": args.device, "bucketed": backend == "cudnn_bucketed"}
    parts = {
        "ref_suffix": lambda s: suffix_calls(s, *dims, train=False, device=args.device),
        "actor_suffix": lambda s: suffix_calls(s, *dims, train=True, device=args.device),
        "prefix": lambda s: prefix_calls(s, *dims, **at),
        "prefix_all": lambda s: prefix_calls(s, *dims, grouped=True, **at),
        "vision": lambda s: vision_calls(s[2], vision, **at),
        "vision_all": lambda s: vision_calls(s[3], vision, **at),
    }
    torch.manual_seed(0)
    # shapes no step has: the backend's first use, not a plan a step could reuse
    first_use = (segment_groups(torch.arange(3).repeat(16)), segment_groups(torch.zeros(48, dtype=torch.long)))
    tiny = ([64, 48], [(2, 17)], [first_use], [first_use])
    out = {}
    for name, run in parts.items():
        cold, warm = [], []
        try:
            with backend_context(backend):
                run(tiny)
                for step in range(args.steps):
                    shapes = (*step_shapes(args.preset, step, args.prompts, args.samples),
                              vision_shapes(args.preset, step, args.prompts, vision),
                              vision_shapes(args.preset, step, args.prompts, vision, grouped=True))  # fmt: skip
                    cold.append(timed(args.device, run, shapes))
                    warm.append(timed(args.device, run, shapes))
        except RuntimeError as e:  # e.g. no flash kernel for a masked call
            out[name] = {"error": str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__}
            continue
        host = float(np.mean([c - w for c, w in zip(cold, warm, strict=True)]))
        out[name] = {"cold_s": cold, "warm_s": warm, "per_shape_host_s": host}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2_5_vl_3b")
    ap.add_argument("--preset", default="llava_video")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    ap.add_argument("--only", choices=BACKENDS, help=argparse.SUPPRESS)  # the child process of one backend
    ap.add_argument("--child-out", help=argparse.SUPPRESS)  # where that child writes its JSON
    ap.add_argument("--out", help="JSON of every backend's seconds (written after each backend)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help=argparse.SUPPRESS)  # cpu: smoke run
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("sdpa_shapes: needs a CUDA GPU")
    if args.only:  # a child: its JSON to the parent's file, nothing to --out
        Path(args.child_out).write_text(json.dumps(measure(args.only, args)))
        return
    results = {}
    for backend in args.backends:  # each in its own process: a backend's cache must not serve the next
        with tempfile.TemporaryDirectory() as tmp:
            child_out = Path(tmp) / "result.json"
            child = [sys.executable, __file__, *sys.argv[1:], "--only", backend, "--child-out", str(child_out)]
            env = {**os.environ, **CHILD_ENV.get(backend, {})}
            proc = subprocess.run(child, capture_output=True, text=True, env=env)
            try:
                results[backend] = json.loads(child_out.read_text())
            except (OSError, ValueError):
                lines = proc.stderr.strip().splitlines()
                results[backend] = {"error": (lines[-1] if lines else f"exit {proc.returncode}")[:200]}
        if args.out:
            gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
            record = {"gpu": gpu, "torch": torch.__version__, "command": " ".join(sys.argv), "model": args.model,
                      "preset": args.preset, "steps": args.steps, "results": results}  # fmt: skip
            Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"{'backend':<10} {'part':<13} {'cold s/step':>12} {'warm s/step':>12} {'host s/step':>12}")
    for backend, parts in results.items():
        for name, r in parts.items() if "error" not in parts else [("all", parts)]:
            if "error" in r:
                print(f"{backend:<10} {name:<13} {r['error']}")
                continue
            print(f"{backend:<10} {name:<13} {np.mean(r['cold_s']):>12.3f} {np.mean(r['warm_s']):>12.3f} "
                  f"{r['per_shape_host_s']:>12.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
