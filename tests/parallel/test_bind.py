"""A rollout replica bound over training shards (gloo processes): after an update and `publish()`, it computes
what a model loaded with the freshly materialised weights computes, and holds no actor bytes of its own beyond
the Case-3 copies (paper path) or none at all (in place)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from parallel_testkit import config_for, image_prompt, next_token_loss, spawn, text_prompts

from rollplex.layout.shapes import BF16, Sharding, family_params_per_rank
from rollplex.layout.sharing import Case, sharing_report
from rollplex.memory.optimizer import ChunkedAdamW
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.parallel.bind import QKVPath, bind_rollout, make_groups
from rollplex.parallel.model import materialise, parallelize
from rollplex.rollout.engine import RolloutEngine
from rollplex.rollout.weights import DecodeKernels


def _inside(t: torch.Tensor, storage: torch.Tensor) -> bool:
    start, stop = storage.data_ptr(), storage.data_ptr() + storage.numel()
    return start <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= stop


def _bound_equals_fresh(rank: int, world_size: int, rollout_tp: int, path: str, decode: bool, streamed: bool) -> None:
    config = config_for(world_size)
    torch.manual_seed(0)
    train, exchange, rollout = make_groups(world_size, rollout_tp, rank)
    model = parallelize(Qwen2_5_VL(config), train)
    bound = bind_rollout(model, exchange, rollout, QKVPath(path))
    trained = [p for p in model.parameters() if p.requires_grad]
    sharded = {id(p) for p in trained if _inside(p, bound.storage)}
    per_layer = 5 if path == "in_place" or exchange.size == 1 else 3  # on the copy path QKV stays apart
    assert len(sharded) == per_layer * config.text.num_hidden_layers + 1 + (not config.text.tie_word_embeddings)
    own = [p for p in bound.model.parameters() if not _inside(p, bound.storage)]
    allowed = {p.data_ptr() for p in trained} | {c.dst.data_ptr() for c in bound.copies}  # norms, vision; copies
    assert {p.data_ptr() for p in own} <= allowed
    report = sharing_report(config.text, world_size, rollout_tp, in_place=path == "in_place")
    assert bound.copy_bytes // 4 * BF16 == report.case3_buffer_bytes_per_gpu  # fp32 weights here, bf16 in the plan
    apart = [e for e in report.entries if e.family.sharding is Sharding.REPLICATED or e.case is Case.COPIED]
    kept = sum(family_params_per_rank(e.family, config.text, world_size) * BF16 for e in apart if e.case is Case.COPIED)
    norms = sum(e.family.params * BF16 for e in apart if e.family.sharding is Sharding.REPLICATED)
    # the storage holds everything the planner counts as shared but the norms (rollout reads the trainer's) and,
    # on the copy path, the Case-3 training shards (kept apart, as in the paper)
    assert bound.shared_bytes // 4 * BF16 == report.shared_bytes_per_gpu - norms - (kept if path == "copy" else 0)

    prompts = [*text_prompts(), image_prompt(config)]
    params = list(model.parameters())
    if streamed:  # the chunked optimizer starts each region's exchange as soon as it has written the parameter
        optimizer = ChunkedAdamW(params, lr=1e-2, chunk_bytes=1 << 16, write=bound.writer(params))
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-2)
    next_token_loss(model, prompts).backward()
    optimizer.step()
    fresh = materialise(model, train)
    with torch.no_grad():
        if exchange.size > 1 and not streamed:  # before publishing, the peers' regions hold the old weights
            assert not torch.allclose(bound.model(prompts), fresh(prompts), atol=1e-3)
        bound.publish()
        torch.testing.assert_close(bound.model(prompts), fresh(prompts), atol=1e-5, rtol=1e-5)
    if decode:
        # one sample a prompt: greedy samples of a prompt are the same tokens (the engine's groups: test_engine.py);
        # two tokens: the prefill's and one graph-replayed decode step through the bound weights (longer: test_engine)
        greedy = dict(num_samples=1, params=SamplingParams(temperature=0.0, max_tokens=2), generator=torch.Generator())
        # every rank's fresh model holds the same gathered weights: rank 0 decodes it once for all of them
        theirs = [RolloutEngine(fresh).generate(text_prompts(), **greedy) if rank == 0 else None]
        dist.broadcast_object_list(theirs, src=0)
        theirs = theirs[0]
        # cuBLAS, then our GEMMs on the slabs, unfused and fused. The unfused ones run on the copy path at rollout
        # TP 1 only: in place, QKV goes through the permuted GEMM whatever the kernels, and o_proj, gate_up and
        # down_proj are the same slabs on both paths; over a rollout group of several ranks the fused step sums
        # o_proj and down_proj as the unfused one does (all-reduce), so the two differ only in the gate_up GEMM
        kernels_to_run = [DecodeKernels(), DecodeKernels(triton_gemm=True), DecodeKernels(triton_gemm=True, fused=True)]
        if rollout_tp > 1 or path == "in_place":
            del kernels_to_run[1]
        for kernels in kernels_to_run:
            ours = RolloutEngine(bound.model, kernels=kernels).generate(text_prompts(), **greedy)
            assert torch.equal(ours.responses, theirs.responses)
            torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("world_size", "rollout_tp", "path", "decode", "streamed"),
    [
        (2, 1, "in_place", True, False),  # the configuration: permuted QKV GEMM in decode
        (2, 1, "copy", True, True),
        (2, 2, "in_place", False, False),  # matched degrees: everything Case 1
        (4, 2, "in_place", True, False),  # rollout TP 2: decode all-reduces and gathers the vocabulary
        (4, 1, "copy", False, True),
        (8, 4, "in_place", False, True),  # issue 7's degrees: two rollout replicas at TP 4 over 8 training ranks
    ],
)
@pytest.mark.slow
def test_a_bound_replica_after_publish_equals_the_materialised_model(world_size, rollout_tp, path, decode, streamed):
    spawn(_bound_equals_fresh, world_size, rollout_tp, path, decode, streamed)


def test_rollout_tp_must_divide_training_tp():
    with pytest.raises(ValueError, match="must divide training TP 4"):
        make_groups(4, 3, 0)
