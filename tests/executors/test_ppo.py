"""PPO with a critic: GAE, whitening and the clipped value loss against their textbook definitions; the tiny PPO
run with serial == rollplex bitwise, split against unsplit within float32 rounding, and resume."""

import json
import subprocess
import sys

import pytest
import torch
from run_testkit import ROOT, loaded, spec_text
from training_testkit import GradRecorder, perturb_reference

from rollplex.data.source import batch_at, open_dataset
from rollplex.errors import SpecError
from rollplex.executors.engines import build_engines
from rollplex.executors.grpo import LossScale
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.ppo import PpoConfig, gae, token_rewards, value_loss, whiten
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Role, Schedule, roles
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan

CFG = PpoConfig(gamma=0.9, lam=0.8, value_clip=0.2)


def textbook_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """One response's advantages, step by step from its end: V after the last token is 0."""
    out, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(values) else 0.0
        running = rewards[t] + gamma * following - values[t] + gamma * lam * running
        out[t] = running
    return out


def test_gae_matches_the_textbook_recursion_for_responses_of_different_lengths():
    lens = torch.tensor([[5, 2], [1, 4]])
    mask = torch.arange(5) < lens[..., None]
    rewards = torch.tensor([[1.0, -0.5], [2.0, 0.25]])
    values = torch.randn(2, 2, 5, generator=torch.Generator().manual_seed(0))
    steps = token_rewards(rewards, mask)
    advantages, returns = gae(CFG, steps, values, mask)
    for p in range(2):
        for n in range(2):
            k = int(lens[p, n])
            assert steps[p, n, : k - 1].eq(0).all() and steps[p, n, k - 1] == rewards[p, n]
            expected = textbook_gae(steps[p, n, :k].tolist(), values[p, n, :k].tolist(), CFG.gamma, CFG.lam)
            assert advantages[p, n, :k].tolist() == pytest.approx(expected, rel=1e-6, abs=1e-6)
            assert returns[p, n, :k].tolist() == pytest.approx((advantages + values)[p, n, :k].tolist())
            assert advantages[p, n, k:].eq(0).all() and returns[p, n, k:].eq(0).all()


def test_whitening_centres_and_scales_the_real_tokens_only():
    mask = torch.tensor([[True, True, False], [True, False, False]])
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, -100.0, 7.0]])
    w = whiten(x, mask)
    real = w[mask]
    assert real.mean().abs() < 1e-6 and real.var(unbiased=False) == pytest.approx(1.0, rel=1e-5)
    assert w[~mask].eq(0).all()


def test_the_value_loss_is_half_the_squared_error_and_clips_a_value_that_moved_too_far():
    returns, old, mask = torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 0.0]), torch.tensor([True, True, False])
    scale = LossScale(num_tokens=2, num_sequences=1)
    near = torch.tensor([0.1, 0.0, 5.0])  # within the clip: 0.5 (V - R)^2; the padding token counts nothing
    assert value_loss(CFG, scale, near, old, returns, mask) == pytest.approx(0.5 * (0.81 + 1.0) / 2)
    far = torch.tensor([0.9, 0.0, 0.0], requires_grad=True)  # moved 0.9 > 0.2: the clipped error (0.8^2) is larger
    loss = value_loss(CFG, scale, far, old, returns, mask)
    assert float(loss.detach()) == pytest.approx(0.5 * (0.64 + 1.0) / 2)
    loss.backward()
    assert far.grad[0] == 0 and far.grad[1] != 0  # the clipped term has no gradient towards the return


def ppo_spec(kl: float = 0.1):
    text = spec_text(kl=kl)
    assert "algorithm: {kl_coef:" in text
    return parse_spec(text.replace("algorithm: {kl_coef:", "algorithm: {name: ppo, critic_lr: 1.0e-2, kl_coef:"))


def run(tmp_path, schedule: str, steps: int = 2, **kw):
    opts = RunOptions(steps, tmp_path / schedule, progress=False, tensorboard=False, **kw)
    return train(compile_plan(ppo_spec(), Schedule(schedule)), opts)


@pytest.mark.slow
def test_serial_and_rollplex_train_actor_and_critic_bitwise_alike(tmp_path):
    serial, rollplex = run(tmp_path, "serial", 3), run(tmp_path, "rollplex", 3)
    for key in ("param_digest", "critic_digest", "loss", "value_loss"):
        assert [r[key] for r in serial] == [r[key] for r in rollplex], key
    assert len({r["critic_digest"] for r in serial}) == 3 and len({r["param_digest"] for r in serial}) == 3
    for records in (serial, rollplex):  # the critic's seconds under timers of its own, not the actor's
        assert all(r["time_s"]["critic_suffix_backward"] > 0 for r in records)
    assert all(r["time_s"]["critic_prefix"] > 0 for r in serial)  # rollplex runs it beside decode: in the rollout's


def iteration_grads(schedule: Schedule) -> tuple[dict, dict, float]:
    """One iteration (reference perturbed): the actor's and the critic's gradients, and the value loss."""
    plan = compile_plan(ppo_spec(), schedule)
    engines = build_engines(plan)
    perturb_reference(engines)
    engines.optimizer = GradRecorder(engines.actor, engines.optimizer)
    engines.critic_optimizer = GradRecorder(engines.critic, engines.critic_optimizer)
    examples = batch_at(open_dataset(plan.loaded.spec.workload.dataset, engines.tokenizer, 3), 0, 2)
    record = run_iteration(plan.graph, engines, examples)
    return engines.optimizer.grads, engines.critic_optimizer.grads, record.stats["value_loss"]


def test_split_gives_every_actor_and_critic_parameter_the_unsplit_gradient():
    split, unsplit = iteration_grads(Schedule.ROLLPLEX), iteration_grads(Schedule.UNSPLIT)
    assert split[2] == pytest.approx(unsplit[2], rel=1e-5)
    for mine, oracle in zip(split[:2], unsplit[:2], strict=True):
        assert mine.keys() == oracle.keys() and any(n.startswith("model.visual.") for n in mine)
        whole = torch.cat([g.flatten() for g in oracle.values()])
        difference = torch.cat([(mine[n] - g).flatten() for n, g in oracle.items()])
        assert difference.norm() <= 1e-5 * whole.norm()
        for name, g in oracle.items():  # float32 sums in another order: q and k carry ~1e-5 of the whole gradient
            assert g.norm() > 0, name
            assert (mine[name] - g).norm() <= 1e-3 * g.norm(), name
    assert "lm_head.weight" in split[1] and split[1]["lm_head.weight"].shape == (1, 64)  # the value head


def test_resume_continues_actor_and_critic_as_an_uninterrupted_run(tmp_path):
    whole = run(tmp_path, "rollplex", 3)
    opts = dict(checkpoint_every=1)
    first = train(compile_plan(ppo_spec(), Schedule.ROLLPLEX),
                  RunOptions(1, tmp_path / "part", progress=False, tensorboard=False, **opts))  # fmt: skip
    as_grpo = RunOptions(3, tmp_path / "part", progress=False, tensorboard=False, resume=True)
    with pytest.raises(SpecError, match=r"was written with algorithm\.name: 'ppo', the spec has 'grpo'"):
        train(compile_plan(loaded(), Schedule.ROLLPLEX), as_grpo)
    state = tmp_path / "part" / "checkpoints" / "step-000001" / "state.json"
    written = state.read_text()
    state.write_text(json.dumps({k: v for k, v in json.loads(written).items() if k != "run"}))  # an older checkpoint
    (state.parent / "files.json").unlink()  # which listed no files either
    with pytest.raises(SpecError, match="holds a critic: it was written by a PPO run"):
        train(compile_plan(loaded(), Schedule.ROLLPLEX), as_grpo)
    state.write_text(written)
    moments = state.parent / "critic-optimizer"
    moments.rename(moments.with_name("elsewhere"))  # a hand-edited checkpoint: the critic's fresh Adam state
    with pytest.raises(SpecError, match=r"critic-optimizer covers 0 of the critic optimizer's \d+ parameters"):
        train(compile_plan(ppo_spec(), Schedule.ROLLPLEX), as_grpo)
    moments.with_name("elsewhere").rename(moments)
    rest = train(compile_plan(ppo_spec(), Schedule.ROLLPLEX),
                 RunOptions(3, tmp_path / "part", progress=False, tensorboard=False, resume=True))  # fmt: skip
    for key in ("param_digest", "critic_digest"):
        assert [r[key] for r in first + rest] == [r[key] for r in whole], key


def test_the_standard_ppo_graph_has_a_critic_and_a_critic_graph_needs_ppo():
    assert Role.CRITIC in roles(compile_plan(ppo_spec()).graph)
    text = (ROOT / "specs/ppo_critic_7b_h200.yaml").read_text()
    assert Role.CRITIC in roles(compile_plan(parse_spec(text)).graph)  # the shipped custom graph says ppo
    with pytest.raises(SpecError, match=r"set algorithm\.name: ppo"):
        parse_spec(text.replace("name: ppo", "name: grpo"))
    with pytest.raises(SpecError, match="minibatches_per_step"):
        parse_spec(spec_text().replace("algorithm: {kl_coef:", "algorithm: {name: ppo, minibatches_per_step: 2, "
                                                               "kl_coef:"))  # fmt: skip


@pytest.mark.slow
def test_the_tiny_ppo_spec_trains_from_the_cli(tmp_path):
    command = [sys.executable, "-m", "rollplex.cli", "run", str(ROOT / "specs/ppo_critic_tiny.yaml"), "--steps", "2",
               "--out", str(tmp_path), "--quiet", "--no-checkpoints"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert '"value_loss"' in (tmp_path / "metrics.jsonl").read_text()


def test_recomputing_the_critics_microbatch_as_the_plan_counts_it_changes_no_number():
    base = spec_text(kl=0.1).replace("algorithm: {kl_coef:", "algorithm: {name: ppo, critic_lr: 1.0e-2, kl_coef:")
    plans = [compile_plan(parse_spec(base + f"memory: {{recompute: {r}}}\n")) for r in ("none", "full")]
    kept, recomputed = (build_engines(p) for p in plans)
    critic = recomputed.critic
    with recomputed.critic_microbatch_memory() as wrapped:  # the critic's own layers, not the actor's
        assert wrapped == len(critic.model.language_model.layers) + len(critic.model.visual.blocks)
    with kept.critic_microbatch_memory() as nothing:
        assert nothing is None
    dataset = open_dataset(plans[0].loaded.spec.workload.dataset, kept.tokenizer, 3)
    a = run_iteration(plans[0].graph, kept, batch_at(dataset, 0, 2))
    b = run_iteration(plans[1].graph, recomputed, batch_at(dataset, 0, 2))
    assert a.stats["value_loss"] == b.stats["value_loss"]
    for (name, p), q in zip(kept.critic.named_parameters(), recomputed.critic.parameters(), strict=True):
        assert torch.equal(p, q), name


def test_compiled_layers_reach_the_critics_layers_and_blocks_too():
    base = spec_text(kl=0.1).replace("algorithm: {kl_coef:", "algorithm: {name: ppo, critic_lr: 1.0e-2, kl_coef:")
    engines = build_engines(compile_plan(parse_spec(base.replace("run: {", "run: {compiled_layers: true, "))))
    critic = engines.critic.model
    for unit in (*critic.visual.blocks, *critic.language_model.layers):
        assert unit.__dict__["before_attention"].__self__ is unit and "after_attention" in unit.__dict__
