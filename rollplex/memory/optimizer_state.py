"""`ChunkedAdamW`'s state dict: torch.optim.AdamW's layout (per-parameter step, exp_avg, exp_avg_sq) plus each
FP32 master, independent of the chunking (a run may resume with another chunk size), in parts of bounded size.

Not here: where the state lives between steps (`rollplex.memory.optimizer`), writing parts to disk
(`rollplex.executors.checkpointing`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from rollplex.memory.adamw import AdamWConfig
from rollplex.memory.state_layout import STATE_BYTES_PER_ELEMENT

if TYPE_CHECKING:
    from rollplex.memory.optimizer import ChunkedAdamW


def state_parts(opt: ChunkedAdamW, max_bytes: int | None) -> Iterator[dict]:
    """The state dict in parts of about `max_bytes` of state each (whole parameters, in order; None: one part),
    made one at a time: saving them in turn never holds more than one part beside the pool (a 7B model's whole
    state is 100 GB). Each part is a state dict of its parameters' entries, with the full `param_groups`;
    `load_state` of every part, in any order, restores the optimizer. Under ZeRO-1 a part holds this rank's
    elements of each parameter, with their `range`."""
    opt.wait()
    step = torch.tensor(float(opt.num_steps))
    c = opt.config
    group = {"lr": c.lr, "betas": c.betas, "eps": c.eps, "weight_decay": c.weight_decay, "fused": True}  # its kernel
    group |= {"max_grad_norm": c.max_grad_norm, "params": list(range(len(opt.params)))}
    if opt.shard is not None:
        group["shard"] = [opt.shard.rank, opt.shard.size]
    state, num_bytes = {}, 0
    owned = opt.owned
    for k, i in enumerate(owned):
        rows = [opt.read_param_state(i, row) for row in range(3)]
        state[i] = {"step": step.clone(), "exp_avg": rows[1], "exp_avg_sq": rows[2], "master": rows[0]}
        if opt.shard is not None:
            state[i]["range"] = list(opt.own_range(i))
        num_bytes += STATE_BYTES_PER_ELEMENT * rows[0].numel()
        if max_bytes is not None and num_bytes >= max_bytes and k + 1 < len(owned):
            yield {"state": state, "param_groups": [group]}
            state, num_bytes = {}, 0
    yield {"state": state, "param_groups": [group]}


@torch.no_grad()
def load_state(opt: ChunkedAdamW, state_dict: dict) -> None:
    """Restores a whole state dict, a part of one (the parameters it holds), or a torch AdamW state dict (the
    masters then come from the parameters). A ZeRO-1 part loads only on the layout that wrote it."""
    (group,) = state_dict["param_groups"]
    state = state_dict["state"]
    if len(group["params"]) != len(opt.params):
        raise ValueError(f"state dict holds {len(group['params'])} parameters, this optimizer {len(opt.params)}")
    mine = None if opt.shard is None else [opt.shard.rank, opt.shard.size]
    if "shard" in group and list(group["shard"]) != mine:
        raise ValueError(f"optimizer state of shard {group['shard']} (rank, ranks), this optimizer's {mine}: "
                         "resume with the data-parallel layout that wrote it")  # fmt: skip
    opt.wait()
    for i, key in enumerate(group["params"]):
        if key not in state or opt.own_range(i) is None:
            continue
        e, base = state[key], 0
        if "range" in e:  # a shard's own elements of the parameter
            if tuple(e["range"]) != opt.own_range(i):
                raise ValueError(f"parameter {i}: state of elements {e['range']}, this shard keeps "
                                 f"{opt.own_range(i)}")  # fmt: skip
            base = e["range"][0]
        master = e.get("master", opt.params[i].detach())
        opt.write_param_state(i, master, e["exp_avg"], e["exp_avg_sq"], base=base)
        opt.num_steps = int(e["step"])
    keys = ("lr", "betas", "eps", "weight_decay")
    opt.config = AdamWConfig(
        *(tuple(group[k]) if k == "betas" else group[k] for k in keys),
        group.get("max_grad_norm", opt.config.max_grad_norm),
    )
