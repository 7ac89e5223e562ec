"""The packed suffix's attention (`PackedPrefixAttention`) under FlexAttention kernel options, one decoder layer.

    python bench/flex_suffix.py --model 3b --iters 10 --out flex_suffix_3b_h200.json

Builds the scoring shapes of one length batch of the 3B spec: 8 prompts of 4.9k-6.8k tokens (their boundary KV,
random), responses of long-tailed lengths packed to at most 16,384 tokens, the model's heads. Times forward and
forward + backward (CUDA events, medians) for each option set of FlexAttention (`kernel_options`, or Inductor's max-
autotune), checks each against the default's output, and prices the pairs each query sees (its prompt and its own
earlier tokens) at the device's peak: efficiency = FLOP bound / measured. With `--cascade`, also the two-part form
(`models/cascade.py`: the prompt part and the own-response part merged by log-sum-exps), on FlashAttention's
variable-length calls, with the prompt part on cuDNN's dense calls padded to buckets (`CUDNN_PADDED`), and on
cuDNN's ragged calls as the runtime scores (`cudnn_ragged.suffix_kernels`, where cudnn-frontend is installed), its
parts merged by the kernel and by torch ops; each cascade's first call, which builds cuDNN's graphs, is timed apart
(the torch merge's reuses the graphs the kernel merge's built). Beside them, cuDNN's dense attention of each
prompt's queries over its prompt (no mask; the prompt part alone) shows what a dense kernel reaches at these shapes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from contextlib import nullcontext
from unittest import mock

import torch
import torch.nn.functional as F

from rollplex.bench.provenance import source_commit
from rollplex.models import cascade
from rollplex.models.attention import PackedPrefixAttention
from rollplex.models.boundary import Boundary
from rollplex.models.cascade import CUDNN_PADDED, FLASH, PackedCascadeAttention
from rollplex.models.config import load_model_config
from rollplex.models.cudnn_ragged import ragged_attention_available, suffix_kernels
from rollplex.models.packed import ResponsePack

PEAK_TFLOPS = 796.0  # bf16 dense, measured once (`rollplex compile`'s device line)
OPTIONS = {
    "default": {},
    "tma": {"USE_TMA": True},
    "fwd 128x128 w8 s2": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2},
    "fwd 128x64 w4 s3": {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3},
    "bwd 64/128 128/64 w8 s2": {
        "bwd_BLOCK_M1": 64,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 64,
        "bwd_num_warps": 8,
        "bwd_num_stages": 2,
    },
    "bwd 32/128 128/32 w4 s3": {
        "bwd_BLOCK_M1": 32,
        "bwd_BLOCK_N1": 128,
        "bwd_BLOCK_M2": 128,
        "bwd_BLOCK_N2": 32,
        "bwd_num_warps": 4,
        "bwd_num_stages": 3,
    },
    "max-autotune": None,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=16384, help="tokens of one length batch")
    ap.add_argument("--options", nargs="*", default=list(OPTIONS), choices=list(OPTIONS))
    ap.add_argument("--cascade", action="store_true", help="also the two-part cascade (`models/cascade.py`)")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    text = load_model_config(f"qwen2_5_vl_{args.model}").text
    device, dtype = torch.device("cuda"), torch.bfloat16
    boundary, pack = shapes(text, args.max_tokens, device, dtype)
    attention = PackedPrefixAttention(boundary, pack)
    heads, d = text.num_attention_heads, text.hidden_size // text.num_attention_heads
    gen = torch.Generator(device).manual_seed(1)
    q = torch.randn(1, heads, pack.num_tokens, d, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(1, text.num_key_value_heads, pack.num_tokens, d, device=device, dtype=dtype, generator=gen)
            for _ in range(2))  # fmt: skip
    pairs = int((boundary.prompt_lens[pack.prompt] + pack.offset + 1).sum())
    flop = 4 * heads * d * pairs
    rows, reference = [], None
    for name in args.options:
        fwd, both, out = timed(attention, q, k, v, OPTIONS[name], args.iters)
        reference = out if reference is None else reference
        rows.append({
            "options": name, "forward_ms": fwd, "forward_backward_ms": both,
            "forward_efficiency": flop / fwd / 1e-3 / (PEAK_TFLOPS * 1e12),
            "forward_backward_efficiency": 3.5 * flop / both / 1e-3 / (PEAK_TFLOPS * 1e12),
            "max_abs_difference": float((out.float() - reference.float()).abs().max()),
        })  # fmt: skip
        print(f"{name:<26} fwd {fwd:6.2f} ms ({rows[-1]['forward_efficiency']:.2f})"
              f"  fwd+bwd {both:6.2f} ms ({rows[-1]['forward_backward_efficiency']:.2f})", flush=True)  # fmt: skip
    cascades = {
        "cascade (FlashAttention 2)": (FLASH, True), "cascade (cuDNN padded prompts)": ((CUDNN_PADDED, FLASH), True)
    }  # fmt: skip
    if ragged_attention_available(device):
        ragged = suffix_kernels(8, 8, 2048, boundary.max_prompt_len)
        cascades |= {"cascade (cuDNN ragged)": (ragged, True), "cascade (cuDNN ragged), torch merge": (ragged, False)}
    for name, (kernels, fused_merge) in cascades.items() if args.cascade else ():
        with nullcontext() if fused_merge else mock.patch.object(cascade, "merged", cascade.torch_merged):
            attention = PackedCascadeAttention(boundary, pack, kernels)
            fwd, both, out, first_s = timed_cascade(attention, q, k, v, args.iters)
        rows.append({
            "options": name, "forward_ms": fwd, "forward_backward_ms": both, "first_call_s": first_s,
            "forward_efficiency": flop / fwd / 1e-3 / (PEAK_TFLOPS * 1e12),
            "forward_backward_efficiency": 3.5 * flop / both / 1e-3 / (PEAK_TFLOPS * 1e12),
            "max_abs_difference": None if reference is None else float((out.float() - reference.float()).abs().max()),
        })  # fmt: skip
    dense = dense_prompt_part(boundary, pack, heads, d, args.iters)
    result = {
        "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "commit": source_commit(),
        "command": "python bench/flex_suffix.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in
                                                             vars(args).items() if k not in ("options", "out")),
        "queries": pack.num_tokens, "responses": len(pack.counts), "prompt_lens": boundary.prompt_lens.tolist(),
        "pairs": pairs, "forward_tflop": flop / 1e12, "peak_tflops": PEAK_TFLOPS, "flex": rows,
        "dense_prompt_part": dense,
    }  # fmt: skip
    print(f"\n{'options':<26} {'fwd ms':>7} {'eff':>5} {'f+b ms':>7} {'eff':>5} {'max diff':>9}")
    for r in rows:
        first = f"  first call {r['first_call_s']:.2f} s" if "first_call_s" in r else ""
        print(f"{r['options']:<26} {r['forward_ms']:>7.2f} {r['forward_efficiency']:>5.2f} "
              f"{r['forward_backward_ms']:>7.2f} {r['forward_backward_efficiency']:>5.2f} "
              f"{r['max_abs_difference'] or 0:>9.2e}{first}")  # fmt: skip
    print(
        f"cuDNN dense, prompt part only: fwd {dense['forward_ms']:.2f} ms ({dense['forward_efficiency']:.2f}), "
        f"fwd+bwd {dense['forward_backward_ms']:.2f} ms ({dense['forward_backward_efficiency']:.2f})"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


def shapes(text, max_tokens: int, device: torch.device, dtype: torch.dtype) -> tuple[Boundary, ResponsePack]:
    """8 prompts of 4.9k-6.8k tokens; 64 long-tailed response lengths (one of 2,048), the first fit of the
    longest into one batch of `max_tokens`, each prompt's responses together (as `token_batches` packs them)."""
    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(4900, 6800, (8,), generator=gen)
    lens = torch.exp(5.2 + 0.9 * torch.randn(64, generator=gen)).clamp(8, 2048).long()  # log-normal
    lens[5] = 2048
    order, room, chosen = sorted(range(64), key=lambda i: -int(lens[i])), max_tokens, []
    for i in order:
        if lens[i] <= room:
            chosen.append(i)
            room -= int(lens[i])
    chosen.sort()
    rows, counts = [i // 8 for i in chosen], [int(lens[i]) - 1 for i in chosen]
    pack = ResponsePack.of(rows, counts, 2047, device)
    span, kv_heads, d = int(prompt_lens.max()), text.num_key_value_heads, text.hidden_size // text.num_attention_heads
    kv = [torch.randn(8, kv_heads, span, d, device=device, dtype=dtype) for _ in range(2)]
    boundary = Boundary(
        keys=(kv[0],), values=(kv[1],), first_logprobs=torch.zeros(8, 1, device=device),
        next_positions=prompt_lens.to(device), prompt_lens=prompt_lens.to(device),
    )  # fmt: skip
    return boundary, pack


def timed(attention: PackedPrefixAttention, q, k, v, options: dict | None, iters: int):
    """Median forward and forward + backward ms of the layer's call under `options` (None: max-autotune)."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = (torch.compile(flex_attention, dynamic=True, mode="max-autotune-no-cudagraphs") if options is None
                else torch.compile(flex_attention, dynamic=True))  # fmt: skip
    kernel_options = options or {}
    keys = torch.cat([attention._prompt_kv(attention.boundary.keys[0]), k], dim=2)
    values = torch.cat([attention._prompt_kv(attention.boundary.values[0]), v], dim=2)
    q_, keys_, values_ = (t.detach().requires_grad_() for t in (q, keys, values))

    def forward():
        return compiled(q_, keys_, values_, block_mask=attention.mask, enable_gqa=True, kernel_options=kernel_options)

    def both():
        forward().backward(grad)

    out = forward()
    grad = torch.randn_like(out)
    both()
    return median_ms(forward, iters), median_ms(both, iters), out.detach()


def timed_cascade(attention: PackedCascadeAttention, q, k, v, iters: int):
    """Median forward and forward + backward ms of the cascade's layer call (boundary KV gradients included), and
    the seconds of the first forward + backward (what the kernels build on their first call included)."""
    keys, values = attention.boundary.keys[0], attention.boundary.values[0]
    leaves = [t.detach().requires_grad_() for t in (q, k, v, keys, values)]
    attention.boundary = dataclasses.replace(attention.boundary, keys=(leaves[3],), values=(leaves[4],))

    def forward():
        return attention(0, *leaves[:3])

    torch.cuda.synchronize()
    began = time.perf_counter()
    out = forward()
    grad = torch.randn_like(out)
    out.backward(grad)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - began
    fwd, both = median_ms(forward, iters), median_ms(lambda: forward().backward(grad), iters)
    return fwd, both, out.detach(), first_s


def median_ms(fn, iters: int) -> float:
    """Median wall time of `fn` in ms: CUDA events on a GPU, the host clock elsewhere (a smoke run's)."""
    times = []
    for _ in range(iters):
        if not torch.cuda.is_available():
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
            continue
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def dense_prompt_part(boundary: Boundary, pack: ResponsePack, heads: int, d: int, iters: int) -> dict:
    """Each prompt's packed queries over its whole prompt KV, no mask, one cuDNN call ([P, H, longest, D])."""
    per_prompt = torch.bincount(pack.prompt, minlength=boundary.num_prompts)
    longest = int(per_prompt.max())
    q = torch.randn(boundary.num_prompts, heads, longest, d, device=pack.prompt.device, dtype=torch.bfloat16)
    group = heads // boundary.keys[0].shape[1]  # heads per KV head, repeated: cuDNN's call takes no GQA
    kv = (t.repeat_interleave(group, dim=1) for t in (boundary.keys[0], boundary.values[0]))
    q, k, v = (t.detach().requires_grad_() for t in (q, *kv))
    flop = 4 * heads * d * longest * boundary.num_prompts * boundary.max_prompt_len
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):

        def forward():
            return F.scaled_dot_product_attention(q, k, v)

        out = forward()
        grad = torch.randn_like(out)
        fwd = median_ms(forward, iters)
        both = median_ms(lambda: forward().backward(grad), iters)
    peak = PEAK_TFLOPS * 1e12
    return {"forward_ms": fwd, "forward_backward_ms": both, "forward_efficiency": flop / fwd / 1e-3 / peak,
            "forward_backward_efficiency": 3.5 * flop / both / 1e-3 / peak}  # fmt: skip


if __name__ == "__main__":
    main()
