"""Megatron-Core's tensor-parallel linears against rollplex's, on GPUs: agreement, speed, and weight binding.

First, here: ../shared/tools/gpu-wheels.sh .whl megatron-core==0.19.2 && rm -f .whl/cuda_{bindings,pathfinder}-*
(or copy megatron_core-0.19.2-*.whl and packaging-*.whl from /tmp/mcore_whl). .whl/ (git-ignored: carry it) must
hold megatron_core-*.whl and packaging-*.whl but NOT cuda_bindings-* or cuda_pathfinder-*: the GPU image has its
own cuda-bindings 13.3, and a second copy in /tmp/site would shadow it. Then on the GPU machine, from the root:

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
      && export PYTHONPATH=/tmp/site:$PWD \
      && torchrun --nproc-per-node 2 bench/megatron_trial.py --model 3b --out $OUT/megatron_trial_3b_h200x2.json

`--device cpu` runs the same trial on CPU processes over gloo (megatron draws its weights on the CPU:
use_cpu_initialization; there is no CUDA RNG tracker to seed): agreement and the binding questions mean the
same there, the times only that it ran (`pip install --target DIR megatron-core`, then PYTHONPATH=DIR):

    torchrun --nproc-per-node 2 bench/megatron_trial.py --device cpu --model 3b --tokens 64 --out trial_cpu.json

The issue prefers megatron-core for the training side's TP layers; rollplex has its own (`rollplex.parallel`).
At TP = the number of processes (1 works too), bf16, per linear of a Qwen2.5-VL decoder layer (QKV, [gate; up]:
ColumnParallelLinear; o_proj, down_proj: RowParallelLinear; no Transformer Engine): megatron's layer against
rollplex's per-rank product on a copy of its shard (`rollplex.parallel.layers`: F.linear after `copy_to`; x @
[I/tp, O] slab, then `reduce_from`), outputs and gradients compared, forward+backward timed. Then, each a boolean
and a reason: can megatron's weights be views into a rollout-sized buffer (`rollplex.parallel.bind`), (i) column,
(ii) row, by a new Parameter or by `.data`; (iii) can a row weight be the transpose of a stored [I/tp, O] slab
(DESIGN.md Case 2), and in which layout does its gradient come back; (iv) does megatron need its global state
(tried before `parallel_state` exists). Rank 0 writes the JSON and prints a table last. Not here: sequence
parallelism, megatron's DDP and optimizer (their grad buffers are a question of their own).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from rollplex.models.config import TextConfig, load_model_config, shipped_model_names
from rollplex.parallel.group import TPGroup, copy_to, reduce_from
from rollplex.parallel.layout import check_train_tp

NEEDS = "megatron_trial: needs CUDA GPUs and megatron-core (see the header; --device cpu runs it on gloo)"
TOLERANCE = 1e-2  # relative (Frobenius) error two bf16 GEMMs of the same product may differ by
PAD = 4096  # zero elements around a bound weight in its buffer: a write outside the weight would show there


@dataclass(frozen=True, slots=True)
class Op:
    """One linear of the decoder layer, full size: column-parallel splits its outputs, row-parallel its inputs."""

    name: str
    in_features: int
    out_features: int
    column: bool
    bias: bool = False


def decoder_ops(t: TextConfig) -> list[Op]:
    """The four linears of a decoder layer; column first, then row, for attention and then the MLP."""
    qkv_rows = (t.num_attention_heads + 2 * t.num_key_value_heads) * t.head_dim
    attention = t.num_attention_heads * t.head_dim
    return [
        Op("qkv", t.hidden_size, qkv_rows, column=True, bias=True),
        Op("o_proj", attention, t.hidden_size, column=False),
        Op("gate_up", t.hidden_size, 2 * t.intermediate_size, column=True),
        Op("down_proj", t.intermediate_size, t.hidden_size, column=False),
    ]


def slab_of(local: Tensor) -> Tensor:
    """Our stored [I/tp, O] slab of a RowParallelLinear's local [O, I/tp] weight: transposed, contiguous, a copy."""
    return local.t().contiguous()


class Ours(nn.Module):
    """rollplex's per-rank product (`rollplex.parallel.layers`) over a copy of a megatron layer's local shard."""

    def __init__(self, megatron: nn.Module, column: bool, group: TPGroup) -> None:
        super().__init__()
        local = megatron.weight.detach()
        self.weight = nn.Parameter(local.clone() if column else slab_of(local))  # [rows, in] or slab [I/tp, O]
        self.bias = None if megatron.bias is None else nn.Parameter(megatron.bias.detach().clone())
        self.column, self.group = column, group

    def forward(self, x: Tensor) -> tuple[Tensor, None]:  # megatron's (output, bias to add)
        if self.column:
            return F.linear(copy_to(x, self.group), self.weight, self.bias), None
        return reduce_from(x @ self.weight, self.group), None


def rel_err(a: Tensor, b: Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def randn(tokens: int, width: int, seed: int, device: str) -> Tensor:
    gen = torch.Generator(device).manual_seed(seed)
    return torch.randn(tokens, 1, width, generator=gen, device=device, dtype=torch.bfloat16)


def inputs(op: Op, tokens: int, group: TPGroup, device: str) -> tuple[Tensor, Tensor]:
    """x [T, 1, in] and the output's gradient [T, 1, out] at local sizes; a replicated one is alike on every rank."""
    own = 1 + group.rank  # the seed of a rank's own part; 0 for a part every rank holds
    if op.column:
        return randn(tokens, op.in_features, 0, device), randn(tokens, op.out_features // group.size, own, device)
    return randn(tokens, op.in_features // group.size, own, device), randn(tokens, op.out_features, 0, device)


def run_once(layer: nn.Module, x: Tensor, grad: Tensor) -> dict[str, Tensor]:
    """Output and gradients of one forward+backward; the weight's in nn.Linear's [out, in] (our slab's is not)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = layer(x)[0]
    out.backward(grad)
    w = layer.weight.grad.t() if isinstance(layer, Ours) and not layer.column else layer.weight.grad
    got = {"out": out.detach(), "x_grad": x.grad, "weight_grad": w}
    return got if layer.bias is None else {**got, "bias_grad": layer.bias.grad}


def fwd_bwd_ms(layer: nn.Module, x: Tensor, grad: Tensor, reps: int = 20, warmup: int = 5) -> float:
    """Median forward+backward time (CUDA events; on the CPU, 3 reps of wall time), ranks lined up by a barrier
    before each rep."""
    x = x.detach().requires_grad_()

    def step() -> None:
        x.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x)[0].backward(grad)

    if x.device.type == "cpu":
        walls = []
        for _ in range(3):
            dist.barrier()
            start = time.perf_counter()
            step()
            walls.append((time.perf_counter() - start) * 1e3)
        return statistics.median(walls)
    for _ in range(warmup):
        step()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        dist.barrier(device_ids=[torch.cuda.current_device()])
        start.record()
        step()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def guarded(check: Callable[..., dict], *args) -> dict:
    """One binding question's answer; an exception answers False with its first line, so the others still run."""
    try:
        return check(*args)
    except Exception as e:  # any failure is the answer
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return {"answer": False, "reason": f"{type(e).__name__}: {first}"}


def megatron_config(tp: int, *, initialise: bool, device: str):
    """All megatron's linears read: TP size, bf16 parameters, whether megatron draws the weights itself, and where."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=torch.bfloat16,
                               perform_initialization=initialise, use_cpu_initialization=device == "cpu")  # fmt: skip


def megatron_layer(op: Op, group: TPGroup, device: str, *, initialise: bool = True) -> nn.Module:
    """megatron's layer for `op` on `group`, weights drawn by megatron; the QKV bias drawn here (megatron zeroes it)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = megatron_config(group.size, initialise=initialise, device=device)
    common = {"config": config, "init_method": partial(nn.init.normal_, std=0.02), "tp_group": group.group}
    if not op.column:
        return RowParallelLinear(op.in_features, op.out_features, bias=False, input_is_parallel=True,
                                 skip_bias_add=False, **common)  # fmt: skip
    layer = ColumnParallelLinear(op.in_features, op.out_features, bias=op.bias, gather_output=False, **common)
    if op.bias:
        nn.init.normal_(layer.bias.data, std=0.02)
    return layer


def rebind(layer: nn.Module, how: str) -> tuple[Tensor, Tensor]:
    """Moves `layer.weight` into the middle of a fresh zeroed buffer: a new Parameter over a view ('parameter'),
    `.data = view` ('data'), or a Parameter over the transpose of an [in, out] slab ('slab'). -> (buffer, region)."""
    from megatron.core.tensor_parallel import copy_tensor_model_parallel_attributes

    old = layer.weight
    buffer = torch.zeros(old.numel() + 2 * PAD, dtype=old.dtype, device=old.device)
    region = buffer[PAD : PAD + old.numel()]
    with torch.no_grad():
        if how == "slab":
            view = region.view(old.shape[1], old.shape[0]).copy_(old.t()).t()  # [O, I/tp], strides (1, O)
        else:
            view = region.view(old.shape).copy_(old)
    if how == "data":
        layer.weight.data = view
        return buffer, region
    layer.weight = nn.Parameter(view)
    copy_tensor_model_parallel_attributes(layer.weight, old)  # what megatron's optimizer and checkpoints read
    layer.weight.allreduce = old.allreduce
    return buffer, region


def bound_check(layer: nn.Module, x: Tensor, grad: Tensor, how: str) -> dict:
    """Forward+backward through the rebound weight against the layer as built, then an AdamW step: does the step
    land in the buffer, in place, and nothing around the weight change?"""
    expected = run_once(layer, x, grad)
    buffer, region = rebind(layer, how)
    got = run_once(layer, x, grad)
    worst = max(rel_err(got[k], expected[k]) for k in expected)
    before = region.clone()
    torch.optim.AdamW([layer.weight], lr=1e-3).step()
    stored = layer.weight.detach().t() if how == "slab" else layer.weight.detach()  # as laid out in the buffer
    aliased = layer.weight.data_ptr() == region.data_ptr() and torch.equal(stored.flatten(), region)
    in_place = aliased and not torch.equal(before, region)
    clean = not buffer[:PAD].any().item() and not buffer[-PAD:].any().item()
    answer = worst < TOLERANCE and in_place and clean
    reason = f"fwd+bwd max rel err {worst:.1e}; AdamW step {'in' if in_place else 'NOT in'} the buffer"
    reason += "" if clean else ", and outside the weight"
    if how != "slab":
        return {"answer": answer, "reason": reason}
    g = layer.weight.grad
    layout = "the slab's [in, out] (AccumulateGrad re-lays it)" if g.stride() == layer.weight.stride() else "[out, in]"
    return {"answer": answer, "reason": f"{reason}; weight grad laid out {layout}", "grad_strides": list(g.stride())}


def binding_checks(ops: list[Op], group: TPGroup, device: str, tokens: int = 512) -> dict:
    column, row = ops[0], ops[1]  # qkv (with its bias), o_proj
    questions = {"i_column_view_parameter": (column, "parameter"), "i_column_view_data": (column, "data"),
                 "ii_row_view_parameter": (row, "parameter"), "ii_row_view_data": (row, "data"),
                 "iii_row_weight_is_slab_transpose": (row, "slab")}  # fmt: skip
    return {
        name: guarded(bound_check, megatron_layer(op, group, device), *inputs(op, tokens, group, device), how)
        for name, (op, how) in questions.items()
    }


def bare_run(group: TPGroup, ops: list[Op], device: str, initialise: bool) -> dict:
    """A column and a row layer on an explicit tp_group, forward and backward, before parallel_state exists."""
    for op in ops[:2]:
        layer = megatron_layer(op, group, device, initialise=initialise)
        nn.init.normal_(layer.weight.data, std=0.02)
        run_once(layer, *inputs(op, 64, group, device))
    return {"answer": True, "reason": "ran"}


def probe_global_state(ops: list[Op], group: TPGroup, device: str) -> dict:
    """(iv), asked before parallel_state and the RNG tracker exist."""
    plain = guarded(bare_run, group, ops, device, False)
    initialised = guarded(bare_run, group, ops, device, True)
    return {
        "answer": not (plain["answer"] and initialised["answer"]),
        "reason": f"tp_group passed, no weight init: {plain['reason']}; with megatron's init: {initialised['reason']}",
        "runs_without_parallel_state": plain["answer"],
        "inits_without_rng_tracker": initialised["answer"],
    }


INITIALISED = ["torch.distributed.init_process_group('nccl')", "parallel_state.initialize_model_parallel(tp)",
               "tensor_parallel.model_parallel_cuda_manual_seed (the CUDA RNG tracker megatron's init draws from)",
               "ModelParallelConfig(tensor_model_parallel_size=tp, params_dtype=bf16)"]  # fmt: skip


def init_megatron(tp: int, device: str) -> list[str]:
    from megatron.core import parallel_state, tensor_parallel

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    if device == "cpu":  # weights drawn on the CPU (use_cpu_initialization) from torch's own generator
        return [INITIALISED[0].replace("nccl", "gloo"), INITIALISED[1], INITIALISED[3]]
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    return INITIALISED


def slab_ms(op: Op, group: TPGroup, x: Tensor, grad: Tensor) -> dict:
    """Forward+backward of megatron's row layer with its weight the transpose of our stored slab (Case 2)."""
    layer = megatron_layer(op, group, x.device.type)
    rebind(layer, "slab")
    return {"answer": True, "ms": fwd_bwd_ms(layer, x, grad)}


def one_op(op: Op, group: TPGroup, tokens: int, device: str) -> dict:
    megatron = megatron_layer(op, group, device)
    ours = Ours(megatron, op.column, group)
    x, grad = inputs(op, tokens, group, device)
    theirs, mine = run_once(megatron, x, grad), run_once(ours, x, grad)
    errors = {k: rel_err(mine[k], theirs[k]) for k in theirs}
    times = {"megatron_ms": fwd_bwd_ms(megatron, x, grad), "rollplex_ms": fwd_bwd_ms(ours, x, grad)}
    if not op.column:  # None when (iii) fails
        times["megatron_on_slab_ms"] = guarded(slab_ms, op, group, x, grad).get("ms")
    return {**asdict(op), **times, "megatron_over_rollplex": times["megatron_ms"] / times["rollplex_ms"],
            "rel_err": errors, "agree": max(errors.values()) < TOLERANCE}  # fmt: skip


def missing_requirement(device: str = "cuda") -> str | None:
    """The one line to exit with when this machine cannot run the trial on `device`, or None."""
    if device == "cuda" and not torch.cuda.is_available():
        return NEEDS
    try:
        with warnings.catch_warnings():  # megatron warns at import that TE and Apex are absent
            warnings.simplefilter("ignore")
            import megatron.core.tensor_parallel  # noqa: F401
    except Exception as e:  # any failure to import it: ImportError, or a CUDA library it loads
        first = (str(e).strip().splitlines() or [""])[0]
        return f"megatron_trial: cannot import megatron-core ({type(e).__name__}: {first}); see the header"
    return None


def table(out: dict) -> str:
    lines = [f"{'op':10} {'megatron ms':>12} {'rollplex ms':>12} {'ratio':>6} {'on slab ms':>11} agree"]
    for name, r in out["ops"].items():
        slab = "-" if r.get("megatron_on_slab_ms") is None else f"{r['megatron_on_slab_ms']:.3f}"
        ms = f"{r['megatron_ms']:12.3f} {r['rollplex_ms']:12.3f} {r['megatron_over_rollplex']:6.2f}"
        lines.append(f"{name:10} {ms} {slab:>11} {r['agree']}")
    lines += [f"{name:34} {a['answer']!s:5} {a['reason']}" for name, a in out["binding"].items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="3b", help="3b, 7b, ... (qwen2_5_vl_<model>) or a shipped config name")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per forward (prefill-like)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: processes over gloo")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if (missing := missing_requirement(args.device)) is not None:
        sys.exit(missing)  # the line on stderr, exit status 1, no traceback
    name = f"qwen2_5_vl_{args.model}"
    text = load_model_config(name if name in shipped_model_names() else args.model).text
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(key, value)  # so that plain `python` runs as one process
    os.environ.setdefault("MASTER_PORT", "29531")
    world = int(os.environ["WORLD_SIZE"])
    try:
        check_train_tp(text, world)
    except ValueError as e:
        sys.exit(f"megatron_trial: {e}")
    device = args.device
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    rank, ops = dist.get_rank(), decoder_ops(text)
    needs_global = probe_global_state(ops, TPGroup(world, rank, dist.new_group(list(range(world)))), device)
    initialised = init_megatron(world, device)
    from megatron.core import __version__, parallel_state

    group = TPGroup(world, rank, parallel_state.get_tensor_model_parallel_group())
    results = {op.name: one_op(op, group, args.tokens, device) for op in ops}
    binding = binding_checks(ops, group, device, min(512, args.tokens))
    binding["iv_needs_global_state"] = {**needs_global, "initialised": initialised}
    if rank == 0:
        where = torch.cuda.get_device_name() if device == "cuda" else f"cpu ({os.cpu_count()} cores, gloo)"
        out = {"gpu": where, "device": device, "world_size": world, "model": args.model, "tokens": args.tokens,
               "dtype": "bfloat16", "torch": torch.__version__, "megatron_core": __version__,
               "cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
               "command": " ".join(["torchrun", f"--nproc-per-node {world}", *sys.argv]), "tolerance": TOLERANCE,
               "times": "CUDA events" if device == "cuda" else "CPU wall time (3 reps): not GPU figures",
               "ops": results, "binding": binding}  # fmt: skip
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
        print(table(out))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
