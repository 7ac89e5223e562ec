"""The prefix's elementwise and gather ops at a spec's own shapes, alone, forward and forward + backward:
the rotary, norm and silu * up of the decoder and of the vision tower in the forms Inductor can give them (and
as the model calls them: q and k from the whole QKV output, the MLP's whole [gate; up] output), and
the vision tower's segment attention: packed with its gathers (rollplex's, whose backward gathers, against
torch's index_select, whose backward adds atomically), and on a GPU flash attention's variable-length kernel over
the patches in window order (what the tower runs there).

    python bench/prefix_ops.py specs/qwen2_5_vl_3b_h200.yaml --out prefix_ops.json

Shapes: the spec's first step of prompts (their videos' patch grids, their prompt lengths), one layer's call.
Times are CUDA-event medians over `--iters` calls after warm-up; the bound is the bytes each call must move
(inputs read once, outputs written once) over the device's copy bandwidth.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.task import make_tokenizer
from rollplex.graph.load import load_spec
from rollplex.models import vision as vision_module
from rollplex.models.layers import gpu_compiled, packed_silu_mul, rms_norm, torch_rms_norm
from rollplex.models.rotary import apply_rotary, rotated_packed_qkv
from rollplex.models.vision_layout import patch_layout, window_order
from rollplex.parallel.layers import QKVOrder, gated, rotated_qk

CUDA = torch.cuda.is_available()


def timed(fn, iters: int) -> float:
    """Median seconds of fn() over `iters` calls (CUDA events on a GPU), after two untimed calls."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(iters):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            import time

            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def forms(fn, eager) -> dict:
    """`fn` as rollplex runs it (a gpu_compiled chain: automatic dynamic shapes), and its torch chain `eager`
    compiled with every dimension symbolic, and static (compiled for the one shape: the best a kernel of these shapes
    gets; a run would recompile every step). The norm also as Inductor's chain with unbacked lengths (`inductor`:
    what the norm ran before rollplex's kernels)."""
    if not CUDA:
        return {"rollplex": fn}
    every = torch.compile(eager, dynamic=True)
    out = {"rollplex": fn, "dynamic": every, "static": torch.compile(eager, dynamic=False)}
    if eager is torch_rms_norm:
        out["inductor"] = gpu_compiled(torch_rms_norm, unbacked=True)
    return out


def family_cases(fn, args: tuple, shorter: tuple, iters: int, bandwidth: float) -> dict:
    """Each form of `fn` on `args` (tensors first), forward alone and forward + backward. `shorter`: the same
    with fewer tokens, met first, as a run's second step meets other lengths (rollplex's form turns the token
    dimensions symbolic there)."""
    eager = torch_rms_norm if fn is rms_norm else fn.eager
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    out_bytes = sum(o.numel() * o.element_size() for o in _tuple(eager(*args)))
    out = {"bound_s": (sum(t.numel() * t.element_size() for t in tensors) + out_bytes) / bandwidth}
    for name, form in forms(fn, eager).items():
        with torch.no_grad():
            form(*shorter)
            forward = timed(partial(form, *args), iters)
        leaves, short = _leaves(args), _leaves(shorter)
        torch.autograd.backward(_tuple(form(*short)), [torch.ones_like(o) for o in _tuple(form(*short))])
        grads = [torch.randn_like(o) for o in _tuple(form(*leaves))]
        out[name] = {"forward_s": forward, "forward_backward_s": timed(partial(_backward, form, leaves, grads), iters)}
    return out


def _leaves(args: tuple) -> list:
    return [a.detach().requires_grad_() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]


def _backward(form, leaves: list, grads: list) -> None:
    torch.autograd.backward(_tuple(form(*leaves)), grads)


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _cos_sin(*shape: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    angles = torch.rand(*shape, device=device) * 100
    return angles.cos(), angles.sin()


def torch_gathers(q, k, v, packed):
    rows, width = packed.index.shape
    q_s, k_s, v_s = (x.index_select(0, packed.index.flatten()).view(rows, width, *x.shape[1:]).transpose(1, 2)
                     for x in (q, k, v))  # fmt: skip
    o = F.scaled_dot_product_attention(q_s, k_s, v_s, attn_mask=packed.sees)
    return o.transpose(1, 2).reshape(rows * width, *q.shape[1:]).index_select(0, packed.entry)


def attention_cases(q, k, v, cases: dict, iters: int) -> dict:
    """{name: (fn, segments)}: each fn(q, k, v, segments) timed forward and forward + backward."""
    out = {}
    for name, (fn, segments) in cases.items():
        with torch.no_grad():
            forward = timed(partial(fn, q, k, v, segments), iters)
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        grads = [torch.randn_like(q)]
        out[name] = {
            "forward_s": forward,
            "forward_backward_s": timed(partial(_backward, fn, [*leaves, segments], grads), iters),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--prompts", type=int, help="prompts of the first step used (default: the step's)")
    ap.add_argument("--out")
    args = ap.parse_args()
    loaded = load_spec(args.spec)
    spec, model = loaded.spec, loaded.model
    dataset = open_dataset(spec.workload.dataset, make_tokenizer(loaded), spec.run.seed, loaded.path.parent)
    examples = batch_at(dataset, 0, args.prompts or spec.workload.prompts_per_step)
    grids = [visual.grid_thw for e in examples for visual in e.prompt.visuals]
    device = torch.device("cuda" if CUDA else "cpu")
    bandwidth = 4.27e12 if CUDA else 2e10
    dtype = torch.bfloat16
    text, vision = model.text, model.vision

    tokens = max(e.prompt.num_tokens for e in examples)
    b, h, kv, d = len(examples), text.num_attention_heads, text.num_key_value_heads, text.head_dim
    families = {}

    def add(name, fn, make):  # make(tokens) -> the args at that many tokens
        families[name] = family_cases(fn, make(tokens_of[name]), make(tokens_of[name] - 64), args.iters, bandwidth)

    layout = patch_layout(grids, vision)
    patches, vh, vd = layout.rows.numel(), vision.num_heads, vision.head_dim
    text_families = ("text_rotary", "text_rotary_qk", "text_norm", "text_silu_mul", "text_gated")
    vision_families = ("vision_rotary", "vision_rotary_qkv", "vision_norm", "vision_silu_mul")
    tokens_of = {**dict.fromkeys(text_families, tokens), **dict.fromkeys(vision_families, patches)}
    rand = partial(torch.randn, device=device, dtype=dtype)
    add("text_rotary", apply_rotary, lambda t: (rand(b, t, h * d).view(b, t, h, d).transpose(1, 2),
                                                *_cos_sin(b, 1, t, d, device=device)))  # fmt: skip
    add("vision_rotary", apply_rotary, lambda t: (rand(t, 3, vh, vd)[:, 0], *_cos_sin(t, 1, vd, device=device)))
    add("vision_rotary_qkv", rotated_packed_qkv, lambda t: (rand(t, 3, vh, vd), *_cos_sin(t, 1, vd, device=device)))
    add("text_rotary_qk", rotated_qk, lambda t: (rand(b, t, (h + 2 * kv) * d), *_cos_sin(b, 1, t, d, device=device),
                                                 QKVOrder.INTERLEAVED, h, kv, d))  # fmt: skip
    add("text_norm", rms_norm, lambda t: (rand(b, t, text.hidden_size), rand(text.hidden_size), 1e-6))
    add("vision_norm", rms_norm, lambda t: (rand(t, vision.hidden_size), rand(vision.hidden_size), 1e-6))
    wide = text.intermediate_size
    add("text_silu_mul", packed_silu_mul, lambda t: (rand(b, t, 2 * wide),))  # the MLP's whole [gate; up] output
    add("text_gated", gated, lambda t: (rand(b, t, 1, 2, wide),))  # the TP MLP's whole [gate; up] output
    vwide = vision.stored_intermediate_size
    add("vision_silu_mul", packed_silu_mul, lambda t: (rand(t, 2 * vwide),))
    vq, vk, vv = rand(patches, 3, vh, vd).unbind(1)
    attention = {}
    ordered = layout.take(window_order(layout))
    for kind in ("windows", "frames"):
        cases = {}
        packed = vision_module.pack_segments(vision_module.segment_groups(getattr(layout, kind)))
        if packed is not None:
            packed = vision_module.PackedSegments(*(t.to(device) for t in packed))
            cases |= {
                "rollplex": (vision_module.packed_segment_attention, packed),
                "torch_index_select": (torch_gathers, packed),
            }
        if vision_module.runs_varlen(
            device, dtype, vd
        ):  # the patches already in window order: the tower's layout on a GPU
            cases["varlen"] = (
                vision_module.varlen_attention,
                vision_module.varlen_segments(getattr(ordered, kind), device),
            )
        attention[kind] = attention_cases(vq.contiguous(), vk.contiguous(), vv.contiguous(), cases, args.iters)

    result = {
        "gpu": torch.cuda.get_device_name() if CUDA else "cpu",
        "command": "python bench/prefix_ops.py " + args.spec,
        "shapes": {"prompts": len(examples), "prompt_tokens": tokens, "patches": patches, "grids": grids},
        **families,
        "vision_attention": attention,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    print(f"{'case':<34} {'fwd ms':>8} {'fwd+bwd ms':>10}")
    for family in families:
        print(f"{family + ' bound':<34} {result[family]['bound_s'] * 1e3:>8.3f}")
        for name, t in result[family].items():
            if name != "bound_s":
                print(f"{family + ' ' + name:<34} {t['forward_s'] * 1e3:>8.3f} {t['forward_backward_s'] * 1e3:>10.3f}")
    for kind, cases in attention.items():
        for name, t in cases.items():
            case = f"attention {kind} {name}"
            print(f"{case:<34} {t['forward_s'] * 1e3:>8.3f} {t['forward_backward_s'] * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
