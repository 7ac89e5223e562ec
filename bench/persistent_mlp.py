"""A decoder layer's MLP at decode rows as one persistent kernel, against the fused chain the decode step launches
for it (`rollplex.rollout.weights`, `rollplex_fused`): whether kernel boundaries or the work between them keep a
decode step from its HBM bound.

    python bench/persistent_mlp.py --model 3b --batch 8 --layers 36 --out bench/results/persistent_mlp_3b_h100.json

The chain, per layer, three launches as programmatic dependents: `add_rms_norm` (the previous layer's down_proj
parts summed into the residual, then the norm), `gate_up_silu` (swapped GEMM, K whole) and `linear_parts`
(down_proj, K split into fp32 parts). The persistent form, per layer, one launch of one program an SM (or
`--per-sm` of them; on a GPU also each launched as a programmatic dependent of the one before, `_pdl`) doing the
same three steps one after another, a grid barrier (`grid_sync.grid_barrier`) between them: each program takes
rows (the norm), then 64-row tiles of [gate; up], then (tile, part) pairs of down_proj, with the chain's tile
shapes, reading the weights through tensor descriptors and the activations with loads that skip L1 (other
programs wrote them). Both run `--layers` layers, each its own weights, in one CUDA graph; the persistent form's
outputs are checked against the chain's. The bound: the layer's weight bytes over the measured copy bandwidth.
Off a GPU (the tests) both run under Triton's interpreter with one program, times from the host clock.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

import torch
import triton
import triton.language as tl
from decode import copy_bandwidth, replay_seconds  # bench/: this folder
from grid_sync import grid_barrier

from rollplex.bench.provenance import source_commit
from rollplex.kernels.decode_ops import add_rms_norm, add_rms_norm_row, norm_weight
from rollplex.kernels.pdl import pdl_options
from rollplex.kernels.swap_gemm import SWAP_BLOCK_K, SWAP_BLOCK_N, swap_tiles
from rollplex.kernels.tiles import k_per_split, sm_count
from rollplex.kernels.transposed_gemm import gate_up_silu, linear_parts
from rollplex.models.config import load_model_config

NUM_WARPS = 4


@triton.jit
def persistent_mlp_kernel(
    parts_in,  # [S_IN, M, N] fp32: the previous layer's down_proj parts
    residual,  # [M, N], updated in place
    norm_w,  # [N]
    normed,  # [M, N] scratch
    gate_up_desc,  # [2I, N] = [gate; up], blocks [BLOCK_N, BLOCK_K]
    hidden,  # [M, INNER] scratch
    down_desc,  # [N, INNER], blocks [BLOCK_N, BLOCK_K]
    parts_out,  # [S, M, N] fp32
    counter,  # [1] int32, zero at launch (each layer its own, all zeroed before the first)
    M,
    eps,
    N: tl.constexpr,
    INNER: tl.constexpr,
    S_IN: tl.constexpr,
    S: tl.constexpr,  # down_proj's K parts
    K_SPLIT: tl.constexpr,  # down_proj's K per part
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NORM_BLOCK: tl.constexpr,
    USE_GDC: tl.constexpr = False,  # a programmatic dependent: the next layer's launch goes at once and waits
):
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid, programs = tl.program_id(0), tl.num_programs(0)
    # 1. residual += the parts, normed = RMSNorm(residual): `add_rms_norm`'s rows
    w = norm_weight(norm_w, N, NORM_BLOCK)
    for row in range(pid, M, programs):
        add_rms_norm_row(parts_in, residual, w, normed, row, eps, M * N, N, NORM_BLOCK, True, S_IN)
    grid_barrier(counter, programs)
    # 2. hidden = silu(normed G^T) * (normed U^T), one 64-column tile at a time, K whole
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    dtype = hidden.dtype.element_ty
    for tile in range(pid, INNER // BLOCK_N, programs):
        first = tile * BLOCK_N
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)
        up = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)
        for k0 in range(0, N, BLOCK_K):
            mask = (rows[:, None] < M) & ((k0 + ks)[None, :] < N)
            x_t = tl.load(normed + rows[:, None] * N + (k0 + ks)[None, :], mask=mask, other=0.0, cache_modifier=".cg").T
            acc = tl.dot(gate_up_desc.load([first, k0]), x_t, acc)
            up = tl.dot(gate_up_desc.load([INNER + first, k0]), x_t, up)
        gate = acc.T.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = act * up.T.to(dtype).to(tl.float32)
        out_cols = first + tl.arange(0, BLOCK_N)
        tl.store(hidden + rows[:, None] * INNER + out_cols[None, :], out.to(dtype), mask=rows[:, None] < M)
    grid_barrier(counter, 2 * programs)
    # 3. parts_out = down_proj's K parts of hidden D^T, one (64-column tile, part) pair at a time
    for job in range(pid, (N // BLOCK_N) * S, programs):
        first, part = (job // S) * BLOCK_N, job % S
        acc = tl.full((BLOCK_N, BLOCK_M), 0.0, dtype=tl.float32)
        for k0 in range(part * K_SPLIT, tl.minimum(part * K_SPLIT + K_SPLIT, INNER), BLOCK_K):
            mask = (rows[:, None] < M) & ((k0 + ks)[None, :] < INNER)
            x_t = tl.load(
                hidden + rows[:, None] * INNER + (k0 + ks)[None, :], mask=mask, other=0.0, cache_modifier=".cg"
            ).T
            acc = tl.dot(down_desc.load([first, k0]), x_t, acc)
        out_cols = first + tl.arange(0, BLOCK_N)
        tl.store(parts_out + part * M * N + rows[:, None] * N + out_cols[None, :], acc.T, mask=rows[:, None] < M)


class Layer:
    """One layer's MLP weights (random, scaled to keep activations in range) and its buffers."""

    def __init__(self, hidden: int, inner: int, batch: int, parts: int, device: torch.device, seed: int) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)
        bf16 = torch.float32 if device.type == "cpu" else torch.bfloat16

        def weight(rows: int, cols: int) -> torch.Tensor:
            return (torch.randn(rows, cols, generator=g) * cols**-0.5).to(device, bf16)

        self.gate_up, self.down = weight(2 * inner, hidden), weight(hidden, inner)
        self.norm_w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, bf16)
        self.parts = torch.zeros(parts, batch, hidden, dtype=torch.float32, device=device)
        self.normed = torch.empty(batch, hidden, dtype=bf16, device=device)
        self.hidden = torch.empty(batch, inner, dtype=bf16, device=device)


def chain_calls(layers: list[Layer], first_parts: torch.Tensor, residual: torch.Tensor, eps: float, pdl: bool):
    """The fused step's three launches a layer; returns the calls and where the last layer's parts land."""
    outs: list[torch.Tensor] = []

    def layer_call(i: int):
        def call() -> None:
            parts = first_parts if i == 0 else outs[i - 1]
            add_rms_norm(parts, residual, layers[i].norm_w, eps, layers[i].normed, pdl)
            hidden = gate_up_silu(layers[i].normed, layers[i].gate_up, layers[i].down.shape[1], pdl=pdl)
            out = linear_parts(hidden, layers[i].down, pdl=pdl)
            if len(outs) <= i:
                outs.append(out)
            else:
                outs[i] = out

        return call

    return [layer_call(i) for i in range(len(layers))], outs


def persistent_calls(layers, first_parts, residual, eps, counters, programs, tiles, pdl):
    """One launch a layer of `programs` programs (`pdl`: as programmatic dependents); NotResident where they would
    not all be resident at once."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, hidden = residual.shape
    inner = layers[0].down.shape[1]
    per_split = k_per_split(inner, tiles.split_k, tiles)
    constants = dict(
        N=hidden, INNER=inner, S=tiles.split_k, K_SPLIT=per_split, BLOCK_M=tiles.block_m, BLOCK_N=SWAP_BLOCK_N,
        BLOCK_K=SWAP_BLOCK_K, NORM_BLOCK=triton.next_power_of_2(hidden), num_warps=NUM_WARPS, num_stages=3,
        **pdl_options(pdl, residual),
    )  # fmt: skip
    calls = []
    for i, layer in enumerate(layers):
        gate_up_desc = TensorDescriptor.from_tensor(layer.gate_up, [SWAP_BLOCK_N, SWAP_BLOCK_K])
        down_desc = TensorDescriptor.from_tensor(layer.down, [SWAP_BLOCK_N, SWAP_BLOCK_K])
        parts_in = first_parts if i == 0 else layers[i - 1].parts
        args = (parts_in, residual, layer.norm_w, layer.normed, gate_up_desc, layer.hidden, down_desc, layer.parts,
                counters[i : i + 1], batch, eps)  # fmt: skip
        if i == 0 and residual.is_cuda:  # a grid barrier hangs unless every program is resident at once
            kernel = persistent_mlp_kernel.warmup(*args, grid=(programs,), S_IN=parts_in.shape[0], **constants)
            fit = resident_per_sm(kernel) * sm_count(residual.device)
            if programs > fit:
                raise NotResident(f"{programs} programs, {fit} resident at once")

        def call(args=args, s_in=parts_in.shape[0], first=i == 0) -> None:
            if first:  # one memset for every layer's counter: a node between two launches would break their PDL
                counters.zero_()
            persistent_mlp_kernel[(programs,)](*args, S_IN=s_in, **constants)

        calls.append(call)
    return calls


class NotResident(Exception):
    """More programs than the GPU holds at once: their grid barrier would wait forever."""


def resident_per_sm(kernel) -> int:
    """How many programs of a compiled kernel an SM holds at once, by shared memory and registers."""
    kernel._init_handles()  # loads the binary: the register count comes with it
    device = torch.cuda.current_device()
    shared = triton.runtime.driver.active.utils.get_device_properties(device)["max_shared_mem"] + 1024
    by_shared = shared // (kernel.metadata.shared + 1024)
    per_warp = -(-kernel.n_regs * 32 // 256) * 256  # registers are granted a warp at a time, 256 at once
    return min(by_shared, 65536 // (per_warp * NUM_WARPS), 2048 // (32 * NUM_WARPS))


def measure(model: str, batch: int, num_layers: int, per_sm: list[int], replays: int) -> dict:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    text = load_model_config(model if model == "tiny" else f"qwen2_5_vl_{model}").text
    hidden, inner, eps = text.hidden_size, text.intermediate_size, text.rms_norm_eps
    num_sms = sm_count(device)
    tiles = swap_tiles(batch, hidden, inner, num_sms, element_size=2 if cuda else 4)
    layers = [Layer(hidden, inner, batch, tiles.split_k, device, seed) for seed in range(num_layers)]
    dtype = layers[0].gate_up.dtype
    g = torch.Generator(device="cpu").manual_seed(1234)
    first_parts = torch.randn(tiles.split_k, batch, hidden, generator=g).to(device)
    start = torch.randn(batch, hidden, generator=g).to(device, dtype)
    residual = start.clone()
    calls, outs = chain_calls(layers, first_parts, residual, eps, pdl=cuda)
    result = {"model": model, "batch": batch, "layers": num_layers, "sms": num_sms, "down_parts": tiles.split_k}
    result["chain_s"] = replay_seconds(calls, replays) / num_layers
    residual.copy_(start)
    for call in calls:  # one plain pass: the outputs to check against
        call()
    want_residual, want_parts = residual.clone(), outs[-1].clone()
    counters = torch.zeros(num_layers, dtype=torch.int32, device=device)
    result["persistent"] = {}
    for k, pdl in itertools.product(per_sm, [False, True] if cuda else [False]):
        programs, name = (k * num_sms if cuda else 1), f"{k}{'_pdl' if pdl else ''}"
        try:
            calls = persistent_calls(layers, first_parts, residual, eps, counters, programs, tiles, pdl)
        except NotResident as e:
            result["persistent"][name] = {"s": None, "not_resident": str(e)}
            continue
        seconds = replay_seconds(calls, replays) / num_layers
        residual.copy_(start)
        for call in calls:
            call()
        residual_diff = (residual.float() - want_residual.float()).abs().max().item()
        parts_diff = (layers[-1].parts - want_parts.float()).abs().max().item()
        scale = max(1.0, want_parts.abs().max().item())
        if not (residual_diff <= 0.05 and parts_diff <= 0.05 * scale):  # NaN fails too
            raise SystemExit(f"persistent_mlp: {name} differs from the chain ({residual_diff}, {parts_diff})")
        result["persistent"][name] = {"s": seconds, "residual_diff": residual_diff, "parts_diff": parts_diff}
    weight_bytes = 3 * hidden * inner * layers[0].gate_up.element_size()
    result["bound_s"] = weight_bytes / copy_bandwidth() if cuda else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="3b", help="3b, 7b, ... (qwen2_5_vl_<this>), or tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--per-sm", nargs="+", type=int, default=[1, 2], help="programs an SM of the persistent form")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args()
    if not 1 <= args.batch <= 64 or args.layers < 1 or min(args.per_sm) < 1:
        sys.exit("persistent_mlp: --batch takes 1-64 rows, --layers and --per-sm at least 1")
    result = measure(args.model, args.batch, args.layers, args.per_sm, args.replays)
    result.update(commit=source_commit(), gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
    bound = result["bound_s"]
    print(f"chain      {result['chain_s'] * 1e6:8.2f} us a layer" + (f"  (bound {bound * 1e6:.2f})" if bound else ""))
    for k, row in result["persistent"].items():
        if row["s"] is None:
            print(f"persistent {k}: not run ({row['not_resident']})")
        else:
            print(f"persistent {row['s'] * 1e6:8.2f} us a layer, {k} (programs an SM, _pdl: launched so; max diff "
                  f"{row['parts_diff']:.2e})")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
