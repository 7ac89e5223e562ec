"""Actor weights shared by training at TP t and rollout at TP r on t GPUs: equality, HBM, publish time, decode.

    torchrun --nproc-per-node 2 bench/tp_sharing.py --model 3b --rollout-tp 1 \
        --out bench/results/tp_sharing_3b_h200x2.json

Random-weight Qwen2.5-VL in bf16, parallelized at TP t = the number of processes (Megatron layouts), bound to a
rollout replica at TP r (`rollplex.parallel.bind`), once per Case-3 path (in place, copy; and in place with the
rollout storage a region of the VMM arena, `in_place_vmm`). Per path: one AdamW
step on a next-token loss, `publish()`, then the replica against a model loaded with the freshly materialised
weights: logits of the same prompts, and a greedy rollout of both through the rollout engine (CUDA graphs).
HBM: the bytes behind the replica's weights that are neither the shared storage nor the trainer's own tensors,
found from the tensors' storages, against the planner's Case-3 figure. Publish time against two ways of getting
the same weights to rollout without sharing: an out-of-place all-gather into a separate rollout copy, and a
plain device-to-device copy of the whole rollout shard (the floor of any copy-based update); and what publishing
adds to a ChunkedAdamW update when the exchange is streamed under it (`BoundRollout.writer`) and when not.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from rollplex.layout.sharing import sharing_report
from rollplex.memory.optimizer import ChunkedAdamW, copy_into
from rollplex.memory.vmm import VmmArena
from rollplex.models.config import load_model_config
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.parallel.bind import QKVPath, bind_rollout, make_groups, vmm_allocator
from rollplex.parallel.group import all_gather_many
from rollplex.parallel.model import materialise, parallelize
from rollplex.rollout.engine import RolloutEngine


def timed(fn, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def prompts_of(config, num: int, length: int, seed: int) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(10, config.text.vocab_size, (length,), generator=g)) for _ in range(num)]


def loss_of(model: Qwen2_5_VL, prompts: list[Prompt]) -> torch.Tensor:
    logits = model(prompts).float()
    ids = torch.stack([p.input_ids for p in prompts]).to(logits.device)
    return -torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).mean()


def rollout(model: Qwen2_5_VL, prompts: list[Prompt], tokens: int) -> tuple[torch.Tensor, float]:
    engine = RolloutEngine(model)
    params = SamplingParams(temperature=0.0, max_tokens=tokens)
    run = lambda: engine.generate(prompts, num_samples=8, params=params, generator=torch.Generator("cuda"))  # noqa: E731
    run()
    torch.cuda.synchronize()
    out = run()
    return out.responses, engine.stats.decode_s


def bytes_beyond_shared(bound, model: Qwen2_5_VL) -> int:
    """Device bytes behind the replica's weights outside the shared storage and the trainer's own tensors
    (replicated norms and vision encoder): what rollout holds of the actor beyond what training holds."""
    start = bound.storage.data_ptr()
    stop = start + bound.storage.numel()
    trainer = {p.untyped_storage().data_ptr() for p in model.parameters()}
    extra = {}
    for p in bound.model.parameters():
        storage = p.untyped_storage()
        if storage.data_ptr() not in trainer and not start <= p.data_ptr() < stop:
            extra[storage.data_ptr()] = storage.nbytes()
    return sum(extra.values())


def separate_copy_s(bound, exchange) -> float:
    """An out-of-place all-gather of every tensor into a separate rollout copy (no sharing), coalesced too."""
    separate = [torch.empty_like(r.whole) for r in bound.regions]
    pairs = list(zip(separate, bound.regions, strict=True))
    return timed(lambda: all_gather_many([(whole, r.part) for whole, r in pairs], exchange))


def d2d_copy_s(storage: torch.Tensor) -> float:
    copy = torch.empty_like(storage)
    return timed(lambda: copy.copy_(storage))


def update_and_publish_s(model: Qwen2_5_VL, bound, config) -> dict:
    """ChunkedAdamW step then publish, with the exchange streamed under the step and without, and the step
    alone: what publishing adds to the update."""
    loss_of(model, prompts_of(config, 2, 256, seed=1)).backward()
    params = [p for p in model.parameters() if p.grad is not None]  # text prompts: the vision encoder gets none
    optimizer = ChunkedAdamW(params, lr=1e-5, chunk_bytes=256 << 20, write=bound.writer(params))
    streamed, plain = optimizer.write, copy_into(params)

    def update(writer, publish: bool) -> None:
        optimizer.write = writer
        optimizer.step()
        if publish:
            bound.publish()

    return {
        "update_s": timed(lambda: update(plain, False), reps=3),
        "update_then_publish_s": timed(lambda: update(plain, True), reps=3),
        "update_streaming_publish_s": timed(lambda: update(streamed, True), reps=3),
    }


def one_path(args, config, groups, path: QKVPath, arena=None) -> dict:
    train, exchange, replica_group = groups
    gc.collect()  # the previous path's models and graphs go now, not during this path's measurements
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = parallelize(Qwen2_5_VL(config, dtype=torch.bfloat16, device="cuda"), train)
    bound = bind_rollout(model, exchange, replica_group, path, None if arena is None else vmm_allocator(arena))
    beyond = bytes_beyond_shared(bound, model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss_of(model, prompts_of(config, 2, 256, seed=1)).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del optimizer
    chunked = update_and_publish_s(model, bound, config) if path is QKVPath.IN_PLACE and arena is None else {}
    publish_s = timed(bound.publish)
    publish_one_by_one_s = timed(lambda: bound.publish(coalesced=False))
    gather_s, copy_s = separate_copy_s(bound, exchange), d2d_copy_s(bound.storage)
    fresh = materialise(model, train)
    prompts = prompts_of(config, 4, 256, seed=2)
    with torch.no_grad():
        ours, theirs = bound.model(prompts).float(), fresh(prompts).float()
    decode_prompts = prompts_of(config, 8, args.prompt_tokens, seed=3)
    ours_tokens, ours_decode_s = rollout(bound.model, decode_prompts, args.tokens)
    fresh_tokens, fresh_decode_s = rollout(fresh, decode_prompts, args.tokens)
    first = (ours_tokens[..., 0] == fresh_tokens[..., 0]).float().mean().item()
    whole = (ours_tokens == fresh_tokens).all(-1).float().mean().item()
    return {
        "publish_s": publish_s,
        **chunked,
        "publish_one_call_per_tensor_s": publish_one_by_one_s,
        "separate_copy_gather_s": gather_s,
        "d2d_copy_of_rollout_shard_s": copy_s,
        "shared_bytes": bound.shared_bytes,
        "copy_bytes": bound.copy_bytes,
        "measured_bytes_beyond_shared": beyond,
        "logits_max_abs_diff": (ours - theirs).abs().max().item(),
        "logits_max_abs": theirs.abs().max().item(),
        "argmax_agreement": (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item(),
        "greedy_first_token_agreement": first,
        "greedy_sequences_identical": whole,
        "decode_s": {"bound": ours_decode_s, "fresh": fresh_decode_s},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="3b")
    parser.add_argument("--rollout-tp", type=int, default=1)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = load_model_config(args.model)
    groups = make_groups(world, args.rollout_tp, rank)
    report = sharing_report(config.text, world, args.rollout_tp)
    results = {path.value: one_path(args, config, groups, path) for path in QKVPath}
    with VmmArena(64 << 30, torch.cuda.current_device()) as arena:  # addresses only until a region maps pages
        results["in_place_vmm"] = one_path(args, config, groups, QKVPath.IN_PLACE, arena)
    if rank == 0:
        out = {
            "gpu": f"{world} x {torch.cuda.get_device_name()}",
            "model": args.model,
            "train_tp": world,
            "rollout_tp": args.rollout_tp,
            "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv]),
            "torch": torch.__version__,
            "plan": {
                "case_percent": {c: report.percent(c) for c in (1, 2, 3)},
                "case3_buffer_bytes_per_gpu": report.case3_buffer_bytes_per_gpu,
                "shared_bytes_per_gpu": report.shared_bytes_per_gpu,
            },
            "paths": results,
        }
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(f"{'path':9} {'publish ms':>10} {'gather-copy ms':>14} {'d2d ms':>7} {'beyond MB':>9} {'plan MB':>8} "
              f"{'logit diff':>10} {'argmax':>6} {'greedy=':>7} {'dec bound/fresh s':>18}")  # fmt: skip
        for name, r in results.items():
            plan = report.case3_buffer_bytes_per_gpu if name == "copy" else 0
            name = name.replace("in_place_vmm", "vmm")
            print(f"{name:9} {r['publish_s'] * 1e3:10.2f} {r['separate_copy_gather_s'] * 1e3:14.2f} "
                  f"{r['d2d_copy_of_rollout_shard_s'] * 1e3:7.2f} {r['measured_bytes_beyond_shared'] / 2**20:9.1f} "
                  f"{plan / 2**20:8.1f} {r['logits_max_abs_diff']:10.4f} {r['argmax_agreement']:6.3f} "
                  f"{r['greedy_sequences_identical']:7.3f} "
                  f"{r['decode_s']['bound']:8.3f}/{r['decode_s']['fresh']:.3f}")  # fmt: skip
        c = results["in_place"]
        print(f"ChunkedAdamW update {c['update_s']:.3f} s; then publish {c['update_then_publish_s']:.3f} s; "
              f"publish streamed under it {c['update_streaming_publish_s']:.3f} s")  # fmt: skip
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
