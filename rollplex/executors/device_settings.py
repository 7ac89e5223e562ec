"""The process-wide settings a spec makes for its run: the device, deterministic algorithms, cuDNN attention and the
caching allocator's expandable segments; and which attention scores responses (`suffix_attention`, and the cuDNN
kernels it builds: `scoring_kernels`). Each setting is
torch state the whole process shares, so `build_engines` sets every one from the spec at each build and no run's
setting leaks into the next. Not the engines themselves (`engines.py`)."""

from __future__ import annotations

import os
import sys

import torch

from rollplex.errors import SpecError
from rollplex.executors.distributed import TPSetup
from rollplex.graph.load import LoadedSpec
from rollplex.graph.spec_runtime import RunSpec, scoring_choice
from rollplex.graph.workload import per_gpu
from rollplex.models.cudnn_ragged import CudnnRaggedKernels, SuffixKernels, build_graphs, suffix_kernels


def resolve_device(setting: str) -> torch.device:
    """`run.device`: auto is the GPU when torch sees one; cuda without one is a one-line error."""
    if setting == "cuda" and not torch.cuda.is_available():
        raise ValueError("run.device is cuda but torch sees no GPU: use auto or cpu")
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(setting)


def set_determinism(on: bool) -> None:
    """`run.deterministic`, process-wide (torch has no narrower switch); set from the spec at every build so that
    one run's setting never leaks into the next. cuBLAS needs a fixed workspace for deterministic results."""
    if on:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(on)


def set_cudnn_attention(on: bool) -> None:
    """`run.cudnn_attention`, process-wide (torch's SDPA backend switch), set from the spec at every build."""
    torch.backends.cuda.enable_cudnn_sdp(on)


def suffix_attention(run: RunSpec, device: torch.device) -> str:
    """`run.suffix_attention` resolved for `device` (`scoring_choice`, then whether cudnn-frontend is installed):
    "cudnn" or "flex" (what a model's scoring runs on a GPU; the CPU scores with SDPA and a dense mask, "flex" here).
    An explicit cudnn on a GPU without cudnn-frontend installed is a one-line error."""
    from rollplex.models.cudnn_ragged import ragged_attention_available

    choice = scoring_choice(run)
    if choice == "flex" or device.type != "cuda":
        return "flex"
    available = ragged_attention_available(device)
    if choice == "cudnn" and not available:
        raise ValueError("run.suffix_attention is cudnn but cudnn-frontend is not installed: pip install rollplex[gpu]")
    return "cudnn" if available else "flex"


def set_expandable_segments(on: bool, device: torch.device) -> None:
    """`memory.expandable_segments` for the caching allocator's segments from now on (process-wide, set from the
    spec at every build). torch reads PYTORCH_CUDA_ALLOC_CONF once; this is its runtime switch."""
    if device.type != "cuda":
        return
    # the accelerator-wide setter where torch has it (2.13 deprecates the CUDA one), else the CUDA one
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or torch.cuda.memory._set_allocator_settings
    setter(f"expandable_segments:{on}")


def scoring_kernels(loaded: LoadedSpec, device: torch.device, tp: TPSetup | None) -> SuffixKernels | None:
    """The cuDNN kernels a model scores with (`run.suffix_attention` resolved to cudnn, a dtype and head size cuDNN
    takes), their graphs built at the workload's capacities; None: FlexAttention. Where cuDNN refuses the graphs, or
    one of them takes a workspace larger than `memory.runtime_reserve_gib` (the plan counts no other room for it),
    `auto` scores on FlexAttention (one line says why) and an explicit `cudnn` is an error."""
    spec, text = loaded.spec, loaded.model.text
    dtype = getattr(torch, spec.run.dtype)
    if suffix_attention(spec.run, device) != "cudnn" or not CudnnRaggedKernels.takes(device, dtype, text.head_dim):
        return None
    g = per_gpu(spec, loaded.model)  # the scoring batches' largest: a rank's mini-batch of groups
    kernels = suffix_kernels(g.prompts_per_rank // spec.algorithm.minibatches_per_step, g.group_size,
                             g.response_tokens, g.prompt_tokens, spec.run.deterministic)  # fmt: skip
    ranks = 1 if tp is None else tp.train.size
    heads = (text.num_attention_heads // ranks, text.num_key_value_heads // ranks, text.head_dim)
    reserve = spec.memory.runtime_reserve_gib
    try:
        workspace = build_graphs(kernels, device, dtype, *heads)
    except Exception as e:  # cuDNN's errors have no common type: cudnn-frontend raises its own and RuntimeError
        why = f"cuDNN refused the scoring attention's graphs on this GPU ({type(e).__name__}: {str(e)[:160]})"
        return _not_cudnn(loaded, tp, why, "set suffix_attention: flex or auto", e)
    if workspace > reserve * 2**30:
        backward = "deterministic backward (run.deterministic)" if spec.run.deterministic else "graphs"
        why = (f"cuDNN's scoring {backward} takes a {workspace / 2**30:.1f} GiB workspace at this workload, more "
               f"than the plan's reserve for workspaces (memory.runtime_reserve_gib: {reserve:g})")  # fmt: skip
        return _not_cudnn(loaded, tp, why, "set suffix_attention: flex or auto, or raise memory.runtime_reserve_gib")
    return kernels


def _not_cudnn(loaded: LoadedSpec, tp: TPSetup | None, why: str, fix: str, cause: Exception | None = None) -> None:
    """Scoring off cuDNN: an explicit `suffix_attention: cudnn` is a one-line error, `auto` scores on FlexAttention
    and says why on one line (rank 0 under TP)."""
    if loaded.spec.run.suffix_attention == "cudnn":
        raise SpecError("run.suffix_attention", why, fix) from cause
    if tp is None or tp.is_main:
        print(f"rollplex: scoring on FlexAttention: {why}", file=sys.stderr, flush=True)
    return None
