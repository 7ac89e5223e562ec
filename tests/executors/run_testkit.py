"""Test kit of the executors tests: the tiny spec `rollplex run` trains, and ways to run it.

The spec's model is the tiny config with weights that stop: random weights, then a few supervised steps that put
about a third of every response position's probability on the stop token. Its rollouts end at different
lengths, most of them by a stop token and some at max tokens, so that a loss mask, a normaliser or a stop
token handled wrongly changes a number the tests compare (random weights stop too rarely to show it).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from rollplex.data.rewards import REWARDS
from rollplex.data.source import batch_at, open_dataset
from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.loop import RunOptions, train
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.models.checkpoint import save_checkpoint
from rollplex.models.config import load_model_config
from rollplex.models.model import Qwen2_5_VL

ROOT = Path(__file__).resolve().parents[2]
STOP_SHARE = 0.3  # of each response position's probability on the stop token, after `stopping_checkpoint`


def char_share(text: str, example) -> float:
    """A reward that differs between random responses, so advantages (and gradients) are not zero."""
    return sum(c in "aeiou0123456789" for c in text) / max(len(text), 1)


REWARDS.setdefault("test_char_share", char_share)

SPEC = """
model: {model}
cluster: {{hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 2, group_size: 3, prompt_tokens: 384, response_tokens: 6, visual_tokens: 18,
            dataset: "synthetic:clevrer@tiny"}}
algorithm: {{kl_coef: {kl}, lr: 1.0e-2, rewards: [{{name: test_char_share}}]}}
run: {{seed: 3, dtype: float32, device: {device}, init: {init}}}
"""


@functools.cache
def stopping_checkpoint() -> Path:
    """The tiny model, trained for a few steps to give the stop token STOP_SHARE of every response position and
    spread the rest over the printable characters; a checkpoint directory (made once per process)."""
    torch.manual_seed(0)
    config = load_model_config("tiny")
    model = Qwen2_5_VL(config)
    tokenizer = CharTokenizer.for_model(*(getattr(config.tokens, k) for k in ("eos", "vision_start", "vision_end",
                                                                             "image", "video")))  # fmt: skip
    prompts = [e.prompt for e in batch_at(open_dataset("synthetic:clevrer@tiny", tokenizer, 0), 0, 4)]
    chars = torch.tensor(tokenizer.encode("abcdefghijklmnopqrstuvwxyz0123456789 <>/"))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        tokens = chars[torch.randint(len(chars), (4, 8, 8), generator=generator)]
        stop = torch.rand(tokens.shape, generator=generator) < STOP_SHARE
        tokens = tokens.where(~stop, config.tokens.eos)
        boundary = model.prefix(prompts, attached=True)
        out = model.suffix(boundary, tokens, torch.full((4, 8), 8))
        optimizer.zero_grad()
        (-out.logprobs.mean()).backward()
        optimizer.step()
    directory = Path(tempfile.mkdtemp(prefix="rollplex-stopping-"))
    save_checkpoint(model, directory)
    return directory


def spec_text(kl: float = 0.1, device: str = "cpu", model: str | None = None) -> str:
    """The spec: the stopping checkpoint, or random weights of `model` (a config name or path)."""
    if model is not None:
        return SPEC.format(model=model, kl=kl, device=device, init="random")
    return SPEC.format(model=stopping_checkpoint(), kl=kl, device=device, init="checkpoint")


def loaded(kl: float = 0.1, device: str = "cpu"):
    """The tests' spec; on the CPU unless asked, so that a GPU machine runs the same checks (with deterministic
    kernels: the memory-efficient attention backward is otherwise not bitwise repeatable)."""
    text = spec_text(kl, device)
    return parse_spec(text.replace("device: cuda,", "device: cuda, deterministic: true,"))


def run(tmp_path: Path, schedule: str, steps: int = 2, name: str | None = None, device: str = "cpu", **kw):
    opts = RunOptions(steps, tmp_path / (name or schedule), progress=False, tensorboard=False, **kw)
    return train_fresh(compile_plan(loaded(device=device), Schedule(schedule)), opts)


def train_fresh(plan, opts: RunOptions) -> list[dict]:
    """`train`, its compiled chains as a process of its own compiles them: Inductor compiles a chain for the shapes
    it first meets and again for any length once a length changes, and the two kernels may sum in another order;
    so two runs compared bitwise in one process (on a GPU) each start from no compiled chain."""
    if plan.loaded.spec.run.device != "cpu" and torch.cuda.is_available():
        torch._dynamo.reset()
    return train(plan, opts)


def cli_here(capsys, command: str, *args: str) -> tuple[int, str]:
    """`rollplex COMMAND ARGS` in this process, for errors that stop it before any model is built: exit code, stderr."""
    from rollplex.cli import main

    code = main([command, *args])
    return code, capsys.readouterr().err


def cli(*args: str) -> subprocess.CompletedProcess:
    """`rollplex run specs/tiny_cpu.yaml ARGS` in a fresh interpreter."""
    command = [sys.executable, "-m", "rollplex.cli", "run", str(ROOT / "specs/tiny_cpu.yaml"), *args]
    return subprocess.run(command, capture_output=True, text=True)
