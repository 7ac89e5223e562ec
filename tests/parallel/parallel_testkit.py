"""Test kit of the tensor-parallel tests: tiny configs that split up to TP 8, and a gloo process launcher."""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rollplex.models.config import ModelConfig, load_model_config
from rollplex.models.inputs import Prompt, Visual
from rollplex.models.positions import num_visual_tokens


def wide_config(num_kv_heads: int = 8) -> ModelConfig:
    """The tiny model with 16 heads in `num_kv_heads` query groups: training TP up to num_kv_heads."""
    tiny = load_model_config("tiny")
    text = dataclasses.replace(
        tiny.text, hidden_size=128, num_attention_heads=16, num_key_value_heads=num_kv_heads, mrope_section=(1, 1, 2)
    )
    return dataclasses.replace(tiny, text=text, vision=dataclasses.replace(tiny.vision, out_hidden_size=128))


def config_for(train_tp: int) -> ModelConfig:
    return load_model_config("tiny") if train_tp <= 2 else wide_config(num_kv_heads=train_tp)


def text_prompts(seed: int = 5) -> list[Prompt]:
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(10, 100, (n,), generator=g)) for n in (7, 3, 12)]


def image_prompt(config: ModelConfig, seed: int = 6) -> Prompt:
    """Text, a 4x4-patch image (vision start, pads, end), text: the vision encoder runs replicated."""
    g, vision, tokens = torch.Generator().manual_seed(seed), config.vision, config.tokens
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    image = Visual(torch.randn(16, width, generator=g), (1, 4, 4), is_video=False)
    pads = [tokens.image] * num_visual_tokens(image, vision)
    ids = [*torch.randint(10, 100, (3,), generator=g).tolist(), tokens.vision_start, *pads, tokens.vision_end, 11, 12]
    return Prompt(torch.tensor(ids), (image,))


def next_token_loss(model, prompts: list[Prompt]) -> torch.Tensor:
    """Mean log-likelihood of each prompt's next tokens: a loss that reaches every parameter."""
    logits = model(prompts).float()  # [B, L, V]
    total = logits.new_zeros(())
    for b, p in enumerate(prompts):
        logprobs = torch.log_softmax(logits[b, : p.num_tokens - 1], dim=-1)
        total = total + logprobs.gather(-1, p.input_ids[1:, None]).mean()
    return -total / len(prompts)


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable, world_size: int, *args) -> None:
    """Runs fn(rank, world_size, *args) in world_size gloo processes; a failing assert fails the caller.

    The processes are forked from this one (torch and the test module already imported, as a DataLoader's workers
    are; each computes on one thread), not started afresh: on 2 cores, 8 fresh interpreters spend ~10 s importing."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(_worker, args=(world_size, port, fn, args), nprocs=world_size, join=True, start_method="fork")
