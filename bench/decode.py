"""Rollout decode speed on one GPU: the engine's step time against the HBM bound, and against transformers.

    python bench/decode.py --models 3b 7b --batches 32 64 --prompt-tokens 512 --tokens 256 \
        --hf-batches 32 64 --out bench/results/decode_h200.json

Random-weight Qwen2.5-VL language models in bf16, text prompts of one length, P = batch / 8 prompts x 8
samples each, no stop tokens (every sequence decodes `--tokens` tokens). The HBM bound of a step is the bytes
it must read (the decoder's and LM head's weights, the live prompts' KV once per prompt, every sequence's
response KV so far) over the device's measured copy bandwidth. transformers' `generate` runs the same model
shapes on the same batch (each of the batch's sequences as its own prompt, as it has no prompt sharing);
its decode rate is (batch x (T - 1)) / (time of T new tokens - time of 1).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rollplex.bench.provenance import source_commit
from rollplex.models.config import CONFIG_DIR, load_model_config
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.rollout.engine import RolloutEngine
from rollplex.rollout.weights import BY_NAME, DecodeKernels

NUM_SAMPLES = 8


def add_kernel_flags(ap: argparse.ArgumentParser) -> None:
    """The decode kernel settings a decode bench takes (`DecodeKernels`); `decode_kernels` reads them back."""
    ap.add_argument("--kernels", choices=list(BY_NAME), default="cublas", help="as the spec's run.decode_kernels")


def decode_kernels(args: argparse.Namespace) -> DecodeKernels:
    return BY_NAME[args.kernels]


def captured(model: Qwen2_5_VL, batch: int, prompt_tokens: int, tokens: int, kernels: DecodeKernels) -> RolloutEngine:
    """An engine whose decode graphs are captured for batch // 8 prompts of `prompt_tokens` x 8 samples and a
    `tokens` response cache, by a rollout cut at 4 tokens (every sequence ends together: the slots stay laid out
    for the full batch). Replays from a rewound step counter read the cache all the same (zeros past token 4)."""
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(100, 10_000, (prompt_tokens,), generator=g)) for _ in range(batch // NUM_SAMPLES)]
    engine = RolloutEngine(model, kernels=kernels)
    lens = torch.full((len(prompts), NUM_SAMPLES), 4)
    params = SamplingParams(temperature=1.0, max_tokens=tokens)
    engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=torch.Generator("cuda").manual_seed(0),
                    max_lens=lens)  # fmt: skip
    return engine


def copy_bandwidth(nbytes: int = 4 << 30) -> float:
    """Bytes/s of a device-to-device copy, counting both the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(5):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * nbytes * 5 / (time.perf_counter() - start)


def replay_seconds(calls: list, replays: int) -> float:
    """Seconds per pass over `calls`: captured in one CUDA graph (after a warm pass: compiled, launches cached)
    and its replays timed by events on a GPU; else host time of one pass (the interpreter's tests)."""
    if not torch.cuda.is_available():
        start = time.perf_counter()
        for call in calls:
            call()
        return time.perf_counter() - start
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls:
            call()
        with torch.cuda.graph(graph, stream=stream):
            for call in calls:
                call()
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3 / replays


def write_sweep(out: Path, cases: list[dict], bandwidth: float | None) -> None:
    """A sweep's cases as JSON with the GPU, torch, the code's commit, the command and the copy bandwidth."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"gpu": gpu, "torch": torch.__version__, "commit": source_commit(), "command": " ".join(sys.argv)}
    out.write_text(json.dumps({**meta, "read_bandwidth_gb_s": (bandwidth or 0) / 1e9, "cases": cases}))


def weight_bytes(model: Qwen2_5_VL) -> int:
    """Bytes a decode step reads of the weights: the decoder (less the embedding table) and the LM head."""
    lm = model.model.language_model
    params = [p for n, p in lm.named_parameters() if not n.startswith("embed_tokens")] + [model.lm_head.weight]
    return sum(p.numel() * p.element_size() for p in params)


def kv_bytes_per_token(model: Qwen2_5_VL) -> int:
    t = model.config.text
    return 2 * t.num_hidden_layers * t.num_key_value_heads * t.head_dim * 2


def engine_run(
    model: Qwen2_5_VL, batch: int, prompt_tokens: int, tokens: int, bandwidth: float, kernels: DecodeKernels
) -> dict:
    num_prompts = batch // NUM_SAMPLES
    g = torch.Generator().manual_seed(0)
    prompts = [Prompt(torch.randint(100, 10_000, (prompt_tokens,), generator=g)) for _ in range(num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=tokens)
    engine = RolloutEngine(model, kernels=kernels)
    start = time.perf_counter()
    engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=torch.Generator("cuda").manual_seed(0))
    first_s = time.perf_counter() - start  # includes graph capture
    engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=torch.Generator("cuda").manual_seed(1))
    stats = engine.stats
    step_s = stats.decode_s / stats.num_steps
    kv = kv_bytes_per_token(model)
    own_tokens = batch * (stats.num_steps + 1) / 2  # response KV read per step, averaged over the steps
    step_bytes = weight_bytes(model) + num_prompts * prompt_tokens * kv + own_tokens * kv
    return {
        "batch": batch,
        "prompts": num_prompts,
        "prompt_tokens": prompt_tokens,
        "new_tokens": tokens,
        "first_rollout_s_with_capture": round(first_s, 3),
        "prefill_s": round(stats.prefill_s, 4),
        "decode_s": round(stats.decode_s, 4),
        "step_ms": round(step_s * 1e3, 4),
        "tokens_per_s": round(batch * stats.num_steps / stats.decode_s, 1),
        "bytes_per_step": int(step_bytes),
        "hbm_bound_ms": round(step_bytes / bandwidth * 1e3, 4),
        "fraction_of_hbm_bound": round(step_bytes / bandwidth / step_s, 4),
    }


def hf_run(name: str, batch: int, prompt_tokens: int, tokens: int) -> dict:
    """transformers' generate on the same shapes: tokens/s of its decode."""
    import transformers

    hf_config = transformers.Qwen2_5_VLConfig(**json.loads((CONFIG_DIR / f"qwen2_5_vl_{name}.json").read_text()))
    with torch.device("cuda"):
        model = transformers.Qwen2_5_VLForConditionalGeneration._from_config(hf_config, torch_dtype=torch.bfloat16)
    model.eval()
    ids = torch.randint(100, 10_000, (batch, prompt_tokens), device="cuda")

    def timed(new_tokens: int, model=model) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
            min_new_tokens=new_tokens, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        )  # fmt: skip
        torch.cuda.synchronize()
        return time.perf_counter() - start

    timed(2)
    one, full = timed(1), timed(tokens)
    del model
    torch.cuda.empty_cache()
    return {
        "batch": batch,
        "new_tokens": tokens,
        "step_ms": round((full - one) / (tokens - 1) * 1e3, 3),
        "tokens_per_s": round(batch * (tokens - 1) / (full - one), 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["3b"])
    ap.add_argument("--batches", nargs="+", type=int, default=[32, 64])
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--hf-batches", nargs="*", type=int, default=[])
    ap.add_argument("--hf-tokens", type=int, default=64)
    add_kernel_flags(ap)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    kernels = decode_kernels(args)
    bandwidth = copy_bandwidth()
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "command": "python bench/decode.py " + " ".join(sys.argv[1:]),
        "kernels": asdict(kernels),
        "engine": [],
        "transformers": [],
    }
    for name in args.models:
        torch.manual_seed(0)
        model = Qwen2_5_VL(load_model_config(f"qwen2_5_vl_{name}"), dtype=torch.bfloat16, device="cuda").eval()
        for batch in args.batches:
            row = {"model": name, **engine_run(model, batch, args.prompt_tokens, args.tokens, bandwidth, kernels)}
            print(json.dumps(row), flush=True)
            result["engine"].append(row)
        del model
        torch.cuda.empty_cache()
        for batch in args.hf_batches:
            row = {"model": name, **hf_run(name, batch, args.prompt_tokens, args.hf_tokens)}
            print(json.dumps(row), flush=True)
            result["transformers"].append(row)
    for row in result["transformers"]:
        ours = next(r for r in result["engine"] if (r["model"], r["batch"]) == (row["model"], row["batch"]))
        row["engine_speedup"] = round(ours["tokens_per_s"] / row["tokens_per_s"], 2)
    print(f"\n{'model':>5} {'batch':>5} {'step ms':>8} {'bound ms':>8} {'of bound':>8} {'tok/s':>9} {'vs HF':>6}")
    for r in result["engine"]:
        hf = next((h for h in result["transformers"] if (h["model"], h["batch"]) == (r["model"], r["batch"])), {})
        speedup = hf.get("engine_speedup", "-")
        print(f"{r['model']:>5} {r['batch']:>5} {r['step_ms']:>8.3f} {r['hbm_bound_ms']:>8.3f} "
              f"{r['fraction_of_hbm_bound']:>8.1%} {r['tokens_per_s']:>9.0f} {speedup:>6}")  # fmt: skip
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
