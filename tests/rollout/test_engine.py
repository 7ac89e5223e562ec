"""The graph-captured rollout engine against the plain-torch rollout and the model's own scoring."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise

import pytest
import torch
from arena_testkit import PoisoningArena

from rollplex.memory.vmm import RegionState
from rollplex.models.config import load_model_config
from rollplex.models.generate import generate
from rollplex.models.inputs import Prompt
from rollplex.models.model import Qwen2_5_VL
from rollplex.models.sampling import SamplingParams
from rollplex.rollout.beside import Beside
from rollplex.rollout.engine import RolloutEngine
from rollplex.rollout.graphs import StepGraphs
from rollplex.rollout.weights import BY_NAME, DecodeKernels

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_SAMPLES = 2


@pytest.fixture(scope="module")
def model() -> Qwen2_5_VL:
    torch.manual_seed(0)
    return Qwen2_5_VL(load_model_config("tiny"), device=DEVICE)


@pytest.fixture(scope="module")
def prompts() -> list[Prompt]:
    g = torch.Generator().manual_seed(5)
    return [Prompt(torch.randint(10, 100, (n,), generator=g)) for n in (7, 3, 12)]


def seeded(seed: int) -> torch.Generator:
    return torch.Generator(DEVICE).manual_seed(seed)


def engine_rollout(model, prompts, params, seed=0):
    engine = RolloutEngine(model)
    return engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(seed)), engine


SAMPLED = SamplingParams(temperature=1.0, max_tokens=4)  # the interpreter samples on the CPU: few tokens


@pytest.fixture(scope="module")
def sampled(model, prompts):
    """One plain engine's SAMPLED rollouts of seeds 0 and 1 (the engine is returned too, its stats those of the
    two rollouts): what the tests that change how the engine runs compare with."""
    engine = RolloutEngine(model)
    runs = [engine.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(s)) for s in (0, 1)]
    return runs, engine


@pytest.fixture(scope="module")
def planned_kv_bytes() -> int:
    """The rollout KV bytes the plan of these prompts' workload puts aside."""
    from rollplex.graph.load import parse_spec
    from rollplex.graph.plan import compile_plan

    text = f"""
model: tiny
cluster: {{hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 3, group_size: {NUM_SAMPLES}, prompt_tokens: 12, response_tokens: 4, visual_tokens: 1}}
run: {{dtype: float32}}
"""
    return compile_plan(parse_spec(text)).decisions.rollout_kv_bytes


@pytest.fixture(scope="module")
def paged(model, prompts, planned_kv_bytes):
    """An engine whose KV lives in a poisoning arena of the plan's size, after its SAMPLED rollouts of seeds 0 and 1."""
    arena = PoisoningArena(DEVICE, planned_kv_bytes)
    engine = RolloutEngine(model, kv_arena=arena)
    runs = [engine.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(s)) for s in (0, 1)]
    return runs, engine, arena


@pytest.mark.slow
def test_greedy_rollout_equals_the_plain_torch_rollout(model, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    out, _ = engine_rollout(model, prompts, params)
    expected = generate(model, prompts, num_samples=NUM_SAMPLES, params=params, generator=torch.Generator(DEVICE))
    assert torch.equal(out.responses, expected.responses) and torch.equal(out.response_lens, expected.response_lens)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "kernels", [BY_NAME["rollplex"], DecodeKernels(triton_gemm=True, fused=True)], ids=["rollplex", "fused"]
)
@pytest.mark.slow
def test_decode_through_our_gemms_equals_the_plain_torch_rollout(model, prompts, kernels):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    engine = RolloutEngine(model, kernels=kernels)
    out = engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(0))
    expected = generate(model, prompts, num_samples=NUM_SAMPLES, params=params, generator=torch.Generator(DEVICE))
    assert torch.equal(out.responses, expected.responses) and torch.equal(out.response_lens, expected.response_lens)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=1e-4)


def test_kernel_options_that_cannot_run_are_refused_in_one_line(model):
    if DEVICE.type == "cuda":
        pytest.skip("checks the refusal on a machine without a GPU")
    with pytest.raises(ValueError, match="pdl: programmatic dependent launch needs a Hopper or newer GPU"):
        RolloutEngine(model, kernels=BY_NAME["rollplex_pdl"])


def test_every_decode_kernels_name_a_spec_takes_is_a_setting():
    from typing import get_args

    from rollplex.graph.spec import RunSpec

    assert set(get_args(RunSpec.model_fields["decode_kernels"].annotation)) == {"auto", *BY_NAME}
    assert BY_NAME["cublas"] == DecodeKernels() and BY_NAME["rollplex_pdl"].pdl and BY_NAME["rollplex"].triton_gemm
    assert BY_NAME["rollplex_fused"] == DecodeKernels(triton_gemm=True, pdl=True, fused=True)
    assert BY_NAME["rollplex_ahead"] == replace(BY_NAME["rollplex_fused"], ahead=True)
    with pytest.raises(AssertionError, match="fused decode kernels run on our GEMMs"):
        DecodeKernels(fused=True)
    with pytest.raises(AssertionError, match="ahead launches chain the fused kernels"):
        DecodeKernels(triton_gemm=True, pdl=True, ahead=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9, reason="needs Hopper")
@pytest.mark.parametrize("shapes", ["tiny", "3b"])
def test_on_a_gpu_dependent_launches_and_fused_kernels_change_no_rollout(model, prompts, shapes):
    """Our kernels launched plainly, as programmatic dependents (a kernel that read before the one before it had
    written would change a token or a log-prob), fused (splits summed by the norm and rotary kernels, silu inside
    the gate_up GEMM, rounded as the unfused kernels round), and ahead (each kernel letting the next launch before
    it waits, the GEMMs prefetching their weights): the sampled rollout is bitwise the same. At 3B shapes (two
    layers, bf16) down_proj splits K."""
    if shapes == "3b":
        config = load_model_config("qwen2_5_vl_3b")
        torch.manual_seed(0)
        model = Qwen2_5_VL(replace(config, text=replace(config.text, num_hidden_layers=2)), torch.bfloat16, DEVICE)
    params = SamplingParams(temperature=1.0, max_tokens=24)
    plain, *others = (
        RolloutEngine(model, kernels=BY_NAME[name]).generate(
            prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(3)
        )
        for name in ("rollplex", "rollplex_pdl", "rollplex_fused", "rollplex_ahead")
    )
    for other in others:
        assert torch.equal(plain.responses, other.responses) and torch.equal(plain.logprobs, other.logprobs)


@pytest.mark.parametrize(
    ("top_p", "stop", "fused"),
    [
        (1.0, tuple(range(20, 36)), True),  # sampled in the graph
        (0.95, tuple(range(20, 110)), False),  # top-p: sampled by torch between replays
    ],
)
@pytest.mark.slow
def test_sampled_logprobs_equal_the_models_scores_while_the_batch_shrinks(model, prompts, top_p, stop, fused):
    # many stop tokens: lengths spread over 1..max_tokens and the batch compacts
    params = SamplingParams(temperature=1.5, top_p=top_p, max_tokens=10, stop_token_ids=stop)
    out, engine = engine_rollout(model, prompts, params)
    assert engine.graphs.step.shape.fused_sampling == fused
    assert len(set(out.response_lens.flatten().tolist())) > 2
    assert engine.stats.batch_sizes[0] == len(prompts) * NUM_SAMPLES
    assert list(engine.stats.batch_sizes) == sorted(engine.stats.batch_sizes, reverse=True)
    assert engine.stats.batch_sizes[-1] < engine.stats.batch_sizes[0]
    boundary = model.prefix(prompts, attached=False)
    scores = model.suffix(boundary, out.responses, out.response_lens, temperature=1.5)  # the sampling temperature's
    torch.testing.assert_close(out.logprobs, scores.logprobs, atol=1e-4, rtol=1e-4)
    at_one = model.suffix(boundary, out.responses, out.response_lens)
    assert (out.logprobs - at_one.logprobs).abs().max() > 0.05
    for response, length in zip(out.responses.flatten(0, 1), out.response_lens.flatten(), strict=True):
        assert (response[length:] == 0).all() and (length == 10 or response[length - 1] in stop)
        assert not torch.isin(response[: length - 1], torch.tensor(stop, device=DEVICE)).any()


@pytest.mark.slow
def test_a_seed_gives_one_rollout_and_the_engine_reuses_its_graphs(model, prompts):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=5)
    engine = RolloutEngine(model)
    runs = [engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(0))]
    graphs = engine.graphs  # the later rollouts (other generators) replay the graphs of the first
    runs += [engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(s)) for s in (0, 1)]
    assert torch.equal(runs[0].responses, runs[1].responses) and torch.equal(runs[0].logprobs, runs[1].logprobs)
    assert not torch.equal(runs[0].responses, runs[2].responses)
    assert engine.graphs is graphs


@pytest.mark.slow
def test_a_share_of_the_prompts_samples_for_its_rows_what_the_whole_step_samples(model, prompts, sampled):
    """Data parallelism: a rank holding the step's last prompt (rows 4 and 5 of 6), keying its draws by its rows
    in the step's whole batch, samples the whole rollout's tokens for them."""
    whole = sampled[0][0]  # seed 0, all three prompts
    part = RolloutEngine(model).generate(
        prompts[2:], num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0), rows=([4, 5], 6)
    )
    width = part.responses.shape[-1]
    assert torch.equal(part.response_lens, whole.response_lens[2:])
    assert torch.equal(part.responses, whole.responses[2:, :, :width])
    torch.testing.assert_close(part.logprobs, whole.logprobs[2:, :, :width], atol=1e-5, rtol=1e-5)
    for rows in (([4], 6), ([4, 4], 6), ([5, 6], 6)):  # too few, repeated, outside the batch
        with pytest.raises(ValueError, match="distinct rows of the batch"):
            RolloutEngine(model).generate(prompts[2:], num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0),
                                          rows=rows)  # fmt: skip
    with pytest.raises(ValueError, match="top_p 1"):
        RolloutEngine(model).generate(
            prompts[:1], num_samples=NUM_SAMPLES, params=replace(SAMPLED, top_p=0.9), generator=seeded(0),
            rows=([0, 1], 6),
        )  # fmt: skip


@pytest.mark.slow
def test_length_budgets_end_sequences_at_their_budget(model, prompts):
    budgets = torch.tensor([[1, 6], [2, 2], [5, 3]], device=DEVICE)
    engine = RolloutEngine(model)
    out = engine.generate(
        prompts, num_samples=NUM_SAMPLES, params=SamplingParams(max_tokens=6), generator=seeded(0), max_lens=budgets
    )
    assert torch.equal(out.response_lens, budgets)
    assert list(engine.stats.batch_sizes) == sorted(engine.stats.batch_sizes, reverse=True)


@pytest.mark.slow
def test_a_batch_whose_live_sequences_span_fewer_prompts_is_laid_out_again_and_decodes_the_same(
    model, prompts, monkeypatch
):
    """Prompt 2's samples end after 1 and 3 tokens: 8 then 6 sequences live, the batch stays at 8 rows but its
    rows span 2 prompts, so the attention reads 2 prompts' keys; the rollout is the plain one's."""
    cases = []
    run = StepGraphs.run
    monkeypatch.setattr(StepGraphs, "run", lambda self, rows, n: cases.append((rows, n)) or run(self, rows, n))
    budgets = torch.tensor([[6, 6, 6], [6, 6, 6], [1, 3, 3]], device=DEVICE)
    params = SamplingParams(temperature=0.0, max_tokens=6)
    out = RolloutEngine(model).generate(prompts, num_samples=3, params=params, generator=seeded(0), max_lens=budgets)
    expected = generate(
        model, prompts, num_samples=3, params=params, generator=torch.Generator(DEVICE), max_lens=budgets
    )
    assert torch.equal(out.responses, expected.responses) and torch.equal(out.response_lens, budgets)
    torch.testing.assert_close(out.logprobs, expected.logprobs, atol=1e-4, rtol=1e-4)
    assert list(dict.fromkeys(cases)) == [(9, 3), (8, 3), (8, 2)], cases


@pytest.mark.slow
def test_prefix_work_beside_decode_changes_neither_the_rollout_nor_the_boundaries(model, prompts, sampled):
    alone = sampled[0][0]  # seed 0, nothing beside
    jobs = [model.prefix_chunks(prompts[:2], attached=False), model.prefix_chunks(prompts, attached=True)]
    beside = Beside(jobs)
    engine = RolloutEngine(model)
    together = engine.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0), beside=beside)
    ref, actor = beside.finish()
    assert beside.num_chunks > 0
    spans = engine.stats.step_spans  # timed because work ran beside: one (start, end, rows) per step, in order
    assert [rows for _, _, rows in spans] == list(engine.stats.batch_sizes)
    assert all(s < e <= s2 for (s, e, _), (s2, _, _) in pairwise(spans))
    assert torch.equal(alone.responses, together.responses) and torch.equal(alone.logprobs, together.logprobs)
    assert torch.equal(ref.keys[0], model.prefix(prompts[:2], attached=False).keys[0])
    assert actor.keys[-1].requires_grad
    assert torch.equal(actor.first_logprobs, model.prefix(prompts, attached=True).first_logprobs)


def test_a_rollout_from_the_actor_prefixs_boundary_prefills_nothing_and_samples_the_same(
    model, prompts, sampled, monkeypatch
):
    alone = sampled[0][0]  # seed 0, its own prefill
    boundary = model.prefix(prompts, attached=True).detached()  # as the actor prefix leaves it
    monkeypatch.setattr(model, "prefix", lambda *a, **kw: pytest.fail("the engine prefilled again"))
    engine = RolloutEngine(model)
    given = engine.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0), boundary=boundary)
    assert torch.equal(alone.responses, given.responses)
    torch.testing.assert_close(alone.logprobs, given.logprobs)


@pytest.mark.slow
def test_kv_pages_released_between_rollouts_and_mapped_again_change_no_rollout(paged, sampled):
    runs, engine, arena = paged  # released after each rollout, mapped again for the next
    plain, _ = sampled  # seeds 0 and 1, without an arena
    for ours, theirs in zip(runs, plain, strict=True):
        assert torch.equal(ours.responses, theirs.responses)
        torch.testing.assert_close(ours.logprobs, theirs.logprobs, atol=1e-5, rtol=1e-5)
    region = engine.kv_region
    assert arena.calls == [("allocate", region), ("release", region), ("map", region), ("release", region)]
    assert arena.state(region) is RegionState.RELEASED  # nothing of the KV stays resident after a rollout


@pytest.mark.slow
def test_the_plans_rollout_kv_holds_the_engines_caches_and_a_smaller_arena_refuses_the_rollout(
    model, prompts, planned_kv_bytes, paged
):
    runs, _, arena = paged  # two rollouts in an arena of the plan's size (an engine needing more refuses, below)
    assert arena.num_bytes == planned_kv_bytes and len(runs) == 2
    with pytest.raises(ValueError, match=r"more than the plan's .* raise memory.rollout_kv_gib or leave it unset"):
        RolloutEngine(model, kv_arena=PoisoningArena(DEVICE, planned_kv_bytes - 1)).generate(
            prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0)
        )


@pytest.mark.slow
def test_decode_shapes_hold_the_plans_prompt_budget_so_longer_prompts_keep_the_graphs(model, prompts):
    """A plan for prompts of up to 40 tokens: its engine decodes the 12-token prompts and then 30-token ones in one
    shape (captured once) and samples what an engine sized for each rollout samples; an arena too small for the
    budget's shape takes each rollout's own."""
    from rollplex.graph.load import parse_spec
    from rollplex.graph.plan import compile_plan

    text = f"""
model: tiny
cluster: {{hbm_gib: 16, host_gib: 8}}
workload: {{prompts_per_step: 3, group_size: {NUM_SAMPLES}, prompt_tokens: 40, response_tokens: 4, visual_tokens: 1}}
run: {{dtype: float32}}
"""
    d = compile_plan(parse_spec(text)).decisions
    assert d.rollout_prompt_tokens == 64  # 40 rounded up as the engine rounds a capacity
    g = torch.Generator().manual_seed(6)
    longer = [Prompt(torch.randint(10, 100, (n,), generator=g)) for n in (30, 21, 9)]
    budgeted = RolloutEngine(model, kv_arena=PoisoningArena(DEVICE, d.rollout_kv_bytes), prompt_tokens=64)
    own = RolloutEngine(model, kv_arena=PoisoningArena(DEVICE, d.rollout_kv_bytes))
    shapes, first = [], None
    for batch in (prompts, longer):
        runs = [
            e.generate(batch, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0)) for e in (budgeted, own)
        ]
        assert torch.equal(runs[0].responses, runs[1].responses)
        torch.testing.assert_close(runs[0].logprobs, runs[1].logprobs, atol=1e-5, rtol=1e-5)
        shapes.append(
            (budgeted.graphs, budgeted.graphs.step.shape.max_prompt_len, own.graphs.step.shape.max_prompt_len)
        )
        first = first or runs[1]
    assert shapes[0][0] is shapes[1][0] and shapes[0][1] == shapes[1][1] == 64
    assert (shapes[0][2], shapes[1][2]) == (16, 32)  # sized for each rollout: a new shape for the longer prompts
    small = RolloutEngine(model, kv_arena=PoisoningArena(DEVICE, d.rollout_kv_bytes // 2), prompt_tokens=64)
    out = small.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0))
    assert small.graphs.step.shape.max_prompt_len == 16 and torch.equal(out.responses, first.responses)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_released_kv_pages_are_free_device_memory_and_rollouts_do_not_change(model, prompts):
    from rollplex.memory.vmm import VmmArena

    params = SamplingParams(temperature=1.0, max_tokens=6)
    with VmmArena(1 << 34) as arena:
        engine = RolloutEngine(model, kv_arena=arena)
        ours = [engine.generate(prompts, num_samples=NUM_SAMPLES, params=params, generator=seeded(s)) for s in (0, 1)]
        released = torch.cuda.mem_get_info()[0]
        arena.map(engine.kv_region)
        mapped = torch.cuda.mem_get_info()[0]
        arena.release(engine.kv_region)
        assert released - mapped >= engine.kv_region.num_bytes  # what a training phase gets back
    plain = [engine_rollout(model, prompts, params, seed=s)[0] for s in (0, 1)]
    for a, b in zip(ours, plain, strict=True):
        assert torch.equal(a.responses, b.responses) and torch.equal(a.logprobs, b.logprobs)


@pytest.mark.slow
def test_steps_are_timed_without_work_beside_when_asked(model, prompts, sampled):
    _, plain = sampled  # an engine not asked, after its rollouts
    timed = RolloutEngine(model, time_steps=True)
    timed.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(2))
    assert plain.stats.step_spans == ()
    assert [rows for _, _, rows in timed.stats.step_spans] == list(timed.stats.batch_sizes)


def test_a_prefill_made_by_the_engine_is_freed_once_its_kv_is_loaded(model, prompts, sampled, monkeypatch):
    import gc
    import weakref

    engine, made, seen = RolloutEngine(model), [], []
    prefill, steps = engine._prefill, engine._steps
    monkeypatch.setattr(engine, "_prefill", lambda p: made.append(weakref.ref(b := prefill(p))) or b)
    monkeypatch.setattr(engine, "_steps", lambda *a: seen.append(gc.collect() >= 0 and made[0]() is None) or steps(*a))
    out = engine.generate(prompts, num_samples=NUM_SAMPLES, params=SAMPLED, generator=seeded(0))
    assert len(made) == 1 and seen == [True]  # gone before the first decode step
    again = sampled[0][0]  # seed 0 on an engine left as it is
    assert torch.equal(out.responses, again.responses)
