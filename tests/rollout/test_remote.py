"""`RemoteRollout` against `generate` in this process: the child samples with the seed the parent draws, reads
the actor's weights where the trainer writes them, and the actor still trains on the shared storage."""

from __future__ import annotations

import copy
import dataclasses
import os
import signal
from itertools import pairwise

import pytest
import torch

from rollplex.models.config import ModelConfig, load_model_config
from rollplex.models.generate import Rollout, generate
from rollplex.models.inputs import Prompt, Visual
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.packing import packed_view
from rollplex.models.positions import num_visual_tokens
from rollplex.models.sampling import SamplingParams
from rollplex.parallel.bind import ALIGN
from rollplex.rollout.beside import Beside
from rollplex.rollout.remote import RemoteRollout, draw_seed
from rollplex.rollout.shared_weights import move_into, named_tensors, plan_slots, shared_model

NUM_SAMPLES = 3
PARAMS = SamplingParams(temperature=1.0, max_tokens=8, stop_token_ids=tuple(range(20, 40)))


def visual_prompt(config: ModelConfig, g: torch.Generator, grid_thw: tuple[int, int, int], is_video: bool) -> Prompt:
    """Text, one visual wrapped in vision start / end tokens, text."""
    vision, tokens = config.vision, config.tokens
    width = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
    visual = Visual(torch.randn(grid_thw[0] * grid_thw[1] * grid_thw[2], width, generator=g), grid_thw, is_video)
    pad = [tokens.video if is_video else tokens.image] * num_visual_tokens(visual, vision)
    ids = [torch.randint(10, 100, (4,), generator=g), torch.tensor([tokens.vision_start, *pad, tokens.vision_end])]
    return Prompt(torch.cat([*ids, torch.randint(10, 100, (3,), generator=g)]), (visual,))


@pytest.fixture(scope="module")
def config() -> ModelConfig:
    return load_model_config("tiny")


@pytest.fixture(scope="module")
def prompts(config) -> list[Prompt]:
    g = torch.Generator().manual_seed(5)
    return [
        visual_prompt(config, g, (2, 8, 8), is_video=True),
        visual_prompt(config, g, (1, 4, 6), is_video=False),
        Prompt(torch.randint(10, 100, (12,), generator=g)),
    ]


@pytest.fixture(scope="module")
def shared(config):
    """(actor, twin, remote): the actor's weights shared with one child for the whole module; the twin is a
    copy made before sharing (plain memory) for the tests to load the actor's current weights into."""
    torch.manual_seed(0)
    actor = Qwen2_5_VL(config)
    twin = copy.deepcopy(actor)
    with RemoteRollout(actor) as remote:
        yield actor, twin, remote


def remote_and_local(actor, remote, prompts, seed: int = 7) -> tuple[Rollout, Rollout]:
    """The remote rollout, and `generate` in this process with the one seed the remote rollout drew."""
    out = remote(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator().manual_seed(seed))
    local_seed = draw_seed(torch.Generator().manual_seed(seed))
    local = generate(
        actor, prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator().manual_seed(local_seed)
    )
    return out, local


def assert_same_rollout(a: Rollout, b: Rollout) -> None:
    for field in dataclasses.fields(Rollout):
        assert torch.equal(getattr(a, field.name), getattr(b, field.name)), field.name


def test_slots_keep_packed_projections_packed_and_groups_aligned(config):
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    before = {name: t.clone() for name, t in named_tensors(model).items()}
    num_bytes, slots = plan_slots(named_tensors(model))
    storage = torch.empty(num_bytes, dtype=torch.uint8)
    move_into(named_tensors(model), storage, slots)
    assert num_bytes % ALIGN == 0
    for name, t in named_tensors(model).items():
        assert t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr(), name
        assert torch.equal(t, before[name]), name
    spans = sorted((s.offset, s.offset + s.num_bytes) for s in slots.values())
    assert all(end <= start for (_, end), (start, _) in pairwise(spans)), "no two slots overlap"
    attn = model.model.language_model.layers[0].self_attn
    assert packed_view(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight) is not None


def test_a_model_built_over_the_storage_computes_what_the_actor_does_with_its_packs_intact(config, prompts):
    torch.manual_seed(0)
    actor = Qwen2_5_VL(config)
    num_bytes, slots = plan_slots(named_tensors(actor))
    storage = torch.empty(num_bytes, dtype=torch.uint8)
    move_into(named_tensors(actor), storage, slots)
    model = shared_model(config, torch.float32, storage, tuple(slots.items()))
    for t in named_tensors(model).values():
        assert t.untyped_storage().data_ptr() == storage.untyped_storage().data_ptr()
    mlp = model.model.language_model.layers[1].mlp
    assert packed_view(mlp.gate_proj.weight, mlp.up_proj.weight) is not None
    with torch.no_grad():
        assert torch.equal(model(prompts), actor(prompts))


def test_a_tied_weight_stays_one_tensor(config):
    tied = dataclasses.replace(config, text=dataclasses.replace(config.text, tie_word_embeddings=True))
    model = Qwen2_5_VL(tied)
    num_bytes, slots = plan_slots(named_tensors(model))
    move_into(named_tensors(model), torch.empty(num_bytes, dtype=torch.uint8), slots)
    assert model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert slots["lm_head.weight"] == slots["model.language_model.embed_tokens.weight"]


@pytest.mark.slow
def test_a_remote_rollout_equals_generate_here_with_the_seed_it_drew(shared, prompts):
    actor, _, remote = shared
    out, local = remote_and_local(actor, remote, prompts)
    assert_same_rollout(out, local)
    assert len(set(out.response_lens.flatten().tolist())) > 1, "the stop tokens end some responses early"
    assert remote.stats() is None


def test_the_child_reads_the_weights_the_parent_writes_in_place(shared, prompts):
    actor, _, remote = shared
    before, _ = remote_and_local(actor, remote, prompts)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(0.5 * torch.randn_like(p))
    after, local = remote_and_local(actor, remote, prompts)
    assert_same_rollout(after, local)
    assert not torch.equal(before.logprobs, after.logprobs)


def test_the_actor_still_trains_on_the_shared_storage(shared, prompts):
    actor, twin, remote = shared
    twin.load_state_dict(actor.state_dict())
    for model in (actor, twin):
        model.zero_grad()
        model(prompts).float().logsumexp(dim=-1).mean().backward()
    for (name, p), q in zip(actor.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    for model in (actor, twin):
        torch.optim.SGD(model.parameters(), lr=0.5).step()
    for (name, p), q in zip(actor.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert p.untyped_storage().data_ptr() == remote.storage.untyped_storage().data_ptr(), name
    out, local = remote_and_local(actor, remote, prompts)
    assert_same_rollout(out, local)


def test_prefix_work_runs_here_while_the_child_decodes(shared, prompts):
    actor, _, remote = shared
    beside = Beside([actor.prefix_chunks(prompts, attached=False)])
    gen = torch.Generator().manual_seed(3)
    together = remote(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=gen, beside=beside)
    (boundary,) = beside.finish()
    assert torch.equal(boundary.first_logprobs, actor.prefix(prompts, attached=False).first_logprobs)
    remote.start(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator().manual_seed(3))
    with pytest.raises(RuntimeError, match="already in flight"):
        remote.start(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator())
    assert_same_rollout(remote.result(), together)
    with pytest.raises(RuntimeError, match="call start"):
        remote.result()


def test_an_error_in_the_child_is_one_line_and_the_next_rollout_works(shared, prompts):
    actor, _, remote = shared
    with pytest.raises(RuntimeError, match=r"rollout process: ValueError: num_samples 0") as error:
        remote(prompts, num_samples=0, params=PARAMS, generator=torch.Generator())
    assert "\n" not in str(error.value)
    out, local = remote_and_local(actor, remote, prompts)
    assert_same_rollout(out, local)


@pytest.mark.slow
def test_a_dead_child_is_an_error_and_close_leaves_no_child(config, prompts):
    remote = RemoteRollout(Qwen2_5_VL(config))
    os.kill(remote.pid, signal.SIGKILL)
    with pytest.raises(RuntimeError, match=r"rollout process (died|is gone)"):
        remote(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator())
    remote.close()
    remote.close()
    assert not remote.alive
    with pytest.raises(RuntimeError, match="closed"):
        remote.start(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=torch.Generator())


@pytest.mark.slow
def test_close_stops_a_live_child_and_the_actor_keeps_its_weights(shared, prompts):
    actor, _, _ = shared
    other = copy.deepcopy(actor)
    remote = RemoteRollout(other)
    assert remote.alive
    remote.close()
    assert not remote.alive
    with torch.no_grad():
        assert torch.equal(other(prompts), actor(prompts))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernels", ["cublas", "rollplex"])  # the child decodes with the parent's setting
def test_on_a_gpu_the_child_samples_from_the_actors_vmm_pages(config, prompts, kernels):
    from rollplex.rollout.engine import RolloutEngine
    from rollplex.rollout.weights import BY_NAME

    torch.manual_seed(0)
    actor = Qwen2_5_VL(config, device="cuda")
    with RemoteRollout(actor, kernels=kernels) as remote:
        outs = []
        for step in range(2):
            seeded = torch.Generator("cuda").manual_seed
            outs.append(remote(prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=seeded(7)))
            here = RolloutEngine(actor, kernels=BY_NAME[kernels]).generate(
                prompts, num_samples=NUM_SAMPLES, params=PARAMS, generator=seeded(draw_seed(seeded(7)))
            )
            assert torch.equal(outs[-1].responses, here.responses)
            assert torch.equal(outs[-1].response_lens, here.response_lens)
            torch.testing.assert_close(outs[-1].logprobs, here.logprobs, atol=1e-5, rtol=1e-5)
            assert remote.stats() is not None and remote.stats().num_steps > 0
            if step == 0:
                with torch.no_grad():
                    for p in actor.parameters():
                        p.add_(0.5 * torch.randn_like(p))
        assert not torch.equal(outs[0].logprobs, outs[1].logprobs), "the child read the update in place"


def test_the_child_takes_the_parents_attention_and_determinism_choices(config):
    from rollplex.rollout.remote import _apply_flags, _Setup

    setup = _Setup(config, torch.float32, "cpu", 0, (), cudnn_attention=False, deterministic=True)
    try:
        _apply_flags(setup)
        assert not torch.backends.cuda.cudnn_sdp_enabled() and torch.are_deterministic_algorithms_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)
        torch.use_deterministic_algorithms(False)
