"""The cascade decode attention's chunking and launch configs, timed on one GPU for Qwen2.5-VL-3B decode shapes.

    python bench/decode_attention_sweep.py --out bench/results/decode_attention_sweep_h200.json
    # compile in parallel first: for i in $(seq 0 15); do python bench/decode_attention_sweep.py --compile-only \
    #     --shard $i/16 & done; wait

Per case (prompts P x 8 samples, prompt length S, response cache R, decode step), the partial and combine kernels
(`rollplex.kernels.decode_attention`) are timed the way decode runs them: one CUDA graph calls the attention
on enough copies of the KV (the decoder's layers) to pass three times the L2 cache, so each call reads its
keys from HBM. Every config is checked against the launcher's default config first. Reported per config: the
microseconds per call and the HBM rate of the KV the call must read (the prompts' keys and values once per
prompt, each row's own keys up to the step); `default` marks the config the launcher picks today.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from gemm_layouts import time_us  # bench/ is this script's folder: the same graph timing as the GEMM bench

from rollplex.kernels.decode_attention import DecodeAttention, DecodeAttentionShape

HEADS, KV_HEADS, HEAD_DIM, SAMPLES = 16, 2, 128, 8  # Qwen2.5-VL-3B's language model, GRPO's 8 responses
L2_BYTES = 50 << 20


@dataclass(frozen=True, slots=True)
class Case:
    prompts: int
    prompt_len: int
    max_tokens: int
    step: int

    @property
    def rows(self) -> int:
        return self.prompts * SAMPLES

    def kv_bytes(self) -> int:
        """What one call must read: every prompt's K and V once, and each row's own K and V up to the step."""
        per_key = 2 * KV_HEADS * HEAD_DIM * 2
        return per_key * (self.prompts * self.prompt_len + self.rows * (self.step + 1))


CASES = (
    Case(4, 5888, 2048, 512),  # batch 32, the LLaVA-Video-like median prompt, early in a 2k-token rollout
    Case(8, 5888, 2048, 512),  # batch 64
    Case(8, 5888, 2048, 1536),  # batch 64, late in the rollout
    Case(8, 512, 256, 128),  # bench/decode.py's short-prompt case
)


def configs(case: Case) -> list[DecodeAttentionShape]:
    base = DecodeAttentionShape(case.prompts, SAMPLES, HEADS, KV_HEADS, HEAD_DIM, case.prompt_len, case.max_tokens)
    out = [base]
    for chunk, block, warps, stages in itertools.product((64, 128, 256, 512), (32, 64, 128), (4, 8), (2, 3, 4)):
        if block > chunk:
            continue
        own = max(block, min(base.own_chunk, chunk)) if base.own_chunk % block else base.own_chunk
        shape = replace(base, prompt_chunk=chunk, own_chunk=own, block=block, num_warps=warps, num_stages=stages)
        if shape != base:
            out.append(shape)
    return out


def operands(case: Case, copies: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(case.prompt_len + case.step)

    def rand(*size: int) -> torch.Tensor:
        return torch.randn(*size, device="cuda", generator=g, dtype=torch.bfloat16)

    slots = torch.arange(case.rows, device="cuda")
    counts = torch.full((case.prompts,), SAMPLES, device="cuda")

    def kv(batch: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (rand(batch, KV_HEADS, length, HEAD_DIM), rand(batch, KV_HEADS, length, HEAD_DIM)) for _ in range(copies)
        ]

    return {
        "q": rand(case.rows, HEADS, HEAD_DIM),
        "prompt": kv(case.prompts, case.prompt_len),
        "own": kv(case.rows + 1, case.max_tokens),
        "prompt_lens": torch.full((case.prompts,), case.prompt_len, device="cuda"),
        "row_start": counts.cumsum(0) - counts,
        "row_count": counts,
        "slots": slots,
        "step": torch.tensor([case.step], device="cuda"),
    }  # fmt: skip


def calls(shape: DecodeAttentionShape, ops: dict, out: torch.Tensor) -> list:
    attention = DecodeAttention(shape, torch.device("cuda"))

    def call(i: int):
        (pk, pv), (ok, ov) = ops["prompt"][i], ops["own"][i]
        return attention(
            ops["q"], pk, pv, ops["prompt_lens"], ops["row_start"], ops["row_count"], ok, ov, ops["slots"], ops["step"],
            out,
        )  # fmt: skip

    return [lambda i=i: call(i) for i in range(len(ops["prompt"]))]


def copies_for(case: Case) -> int:
    """KV copies whose reads pass three times the L2 cache."""
    return max(2, -(-3 * L2_BYTES // case.kv_bytes()))


def measure(case: Case) -> dict:
    ops = operands(case, copies_for(case))
    out = torch.empty_like(ops["q"])
    shapes = configs(case)
    calls(shapes[0], ops, out)[0]()
    expected = out.float().clone()
    timed, failed = [], []
    for shape in shapes:
        run = calls(shape, ops, out)
        try:
            run[0]()
        except Exception as e:  # a config triton cannot fit (e.g. in shared memory): recorded
            failed.append({**_knobs(shape), "error": f"{type(e).__name__}: {str(e)[:160]}"})
            continue
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
        us = time_us(run)
        timed.append({"us": us, "tb_s": case.kv_bytes() / us / 1e6, **_knobs(shape), "default": shape == shapes[0]})
    return {**asdict(case), "rows": case.rows, "kv_mbytes": case.kv_bytes() / 1e6, "copies": len(ops["prompt"]),
            "configs": sorted(timed, key=lambda r: r["us"]), "failed": failed}  # fmt: skip


def compile_only(first: int, every: int) -> None:
    """Runs every `every`-th (case, config) once from the `first`-th: fills triton's on-disk cache, so that
    parallel shards compile what one timing process then only times."""
    pairs = [(case, shape) for case in CASES for shape in configs(case)]
    for case, shape in pairs[first::every]:
        ops = operands(case, 1)
        try:
            calls(shape, ops, torch.empty_like(ops["q"]))[0]()
        except Exception:  # the timing process records the failure
            continue
    torch.cuda.synchronize()


def _knobs(shape: DecodeAttentionShape) -> dict:
    keys = ("prompt_chunk", "own_chunk", "block", "num_warps", "num_stages")
    return {k: getattr(shape, k) for k in keys} | {"splits": shape.prompt_splits + shape.own_splits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--compile-only", action="store_true", help="only compile (warm triton's cache); no --out")
    p.add_argument("--shard", default="0/1", help="I/N: compile every N-th (case, config) from the I-th")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_attention_sweep: needs a CUDA GPU")
    if args.compile_only:
        compile_only(*(int(v) for v in args.shard.split("/")))
        return
    if args.out is None:
        sys.exit("decode_attention_sweep: --out FILE is required (or --compile-only)")
    results = [measure(case) for case in CASES]
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": "python bench/decode_attention_sweep.py " + " ".join(sys.argv[1:])}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    print(
        f"{'P':>2} {'S':>5} {'R':>5} {'step':>5} {'default us':>10} {'TB/s':>5} {'best us':>8} {'TB/s':>5}  best config"
    )
    for r in results:
        default = next(c for c in r["configs"] if c["default"])
        best = r["configs"][0]
        knobs = {k: best[k] for k in ("prompt_chunk", "own_chunk", "block", "num_warps", "num_stages")}
        print(f"{r['prompts']:>2} {r['prompt_len']:>5} {r['max_tokens']:>5} {r['step']:>5} {default['us']:10.1f} "
              f"{default['tb_s']:5.2f} {best['us']:8.1f} {best['tb_s']:5.2f}  {knobs}")  # fmt: skip


if __name__ == "__main__":
    main()
