"""The actor's training pass against oracles computed from scratch: every response scored over its whole sequence
with a plain forward, the GRPO loss, KL and entropy summed over real tokens only; at a sampling temperature other
than 1; and with several mini-batches. The rollouts stop at different lengths and the reference differs from the
actor, so that a mask, a normaliser, a temperature or a KL direction gone wrong changes a number compared here."""

import pytest
import torch
from run_testkit import run, spec_text
from training_testkit import recorded_iteration

from rollplex.graph.ir import Schedule
from rollplex.models.inputs import Prompt


def sequence_scores(model, prompt: Prompt, tokens: torch.Tensor, temperature: float) -> tuple:
    """Log-probs and entropies [L] of one response's tokens [L] from a forward over prompt ++ response."""
    ids = torch.cat([prompt.input_ids, tokens])
    with torch.no_grad():
        logits = model([Prompt(ids, prompt.visuals, response_start=prompt.num_tokens)])[0]
    rows = torch.log_softmax(logits[prompt.num_tokens - 1 : -1].double() / temperature, dim=-1)
    return rows.gather(-1, tokens[:, None])[:, 0], -(rows.exp() * rows).sum(-1)


def oracle(engines, record, examples, temperature: float = 1.0, swap_kl: bool = False) -> dict[str, float]:
    """The step's loss, KL and entropy at ratio 1 (token_mean), from scratch."""
    rewards = record.rewards.double()
    advantages = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)
    beta = engines.grpo.kl_coef
    loss = kl = entropy = 0.0
    num_tokens = int(record.response_lens.sum())
    for p, example in enumerate(examples):
        for n in range(record.responses.shape[1]):
            tokens = record.responses[p, n, : int(record.response_lens[p, n])]
            lp, ent = sequence_scores(engines.actor, example.prompt, tokens, temperature)
            ref, _ = sequence_scores(engines.reference, example.prompt, tokens, temperature)
            delta = (lp - ref) if swap_kl else (ref - lp)
            k3 = delta.exp() - delta - 1
            loss += float((-advantages[p, n] + beta * k3).sum())
            kl, entropy = kl + float(k3.sum()), entropy + float(ent.sum())
    return {"loss": loss / num_tokens, "kl": kl / num_tokens, "entropy": entropy / num_tokens}


def test_the_rollouts_of_the_tests_stop_at_different_lengths():
    _, record, _ = recorded_iteration(Schedule.ROLLPLEX)
    lens = record.response_lens.flatten().tolist()
    assert len(set(lens)) >= 3 and max(lens) == 6 and min(lens) < 6
    stops = [int(record.responses[p, n, lens[p * 3 + n] - 1]) for p in range(2) for n in range(3)]
    assert sum(s == 2 for s in stops) >= 2  # <|im_end|> ends several of them


@pytest.mark.parametrize("schedule", [Schedule.ROLLPLEX, Schedule.UNSPLIT])
def test_loss_kl_and_entropy_are_means_over_real_tokens_of_the_textbook_terms(schedule):
    engines, record, examples = recorded_iteration(schedule)
    expected = oracle(engines, record, examples)
    for key, value in expected.items():
        assert record.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert expected["kl"] > 1e-4  # the reference differs from the actor
    swapped = oracle(engines, record, examples, swap_kl=True)
    assert abs(swapped["kl"] - record.stats["kl"]) > 1e-3 * expected["kl"]  # the test tells the directions apart


def test_at_a_temperature_other_than_one_the_trainer_scores_each_token_as_the_rollout_sampled_it():
    text = spec_text().replace("lr: 1.0e-2,", "lr: 1.0e-2, temperature: 0.6,")
    engines, record, examples = recorded_iteration(Schedule.ROLLPLEX, text)
    assert engines.temperature == 0.6
    assert record.stats["logprob_diff_max"] < 1e-5  # the rollout's log-probs against the trainer's first scoring
    expected = oracle(engines, record, examples, temperature=0.6)
    for key, value in expected.items():  # kl sums k3 ~ delta^2 / 2: float32 noise in delta shows at ~1e-5 of it
        assert record.stats[key] == pytest.approx(value, rel=5e-5 if key == "kl" else 1e-5, abs=1e-7), key
    at_one = oracle(engines, record, examples, temperature=1.0)
    assert abs(at_one["entropy"] - expected["entropy"]) > 0.05  # temperature 1 would be told apart


def test_the_rollout_and_the_trainer_agree_on_the_cpu_in_float32(tmp_path):
    records = run(tmp_path, "rollplex", 2)
    for r in records:
        assert 0.0 <= r["logprob_diff_mean"] <= r["logprob_diff_max"] < 1e-5


def minibatch_text(num: int, schedule: str = "rollplex") -> str:
    return (
        spec_text()
        .replace("prompts_per_step: 2", "prompts_per_step: 4")
        .replace("rewards:", f"minibatches_per_step: {num}, clip_ratio: 0.05, rewards:")
    )


def run_text(tmp_path, text: str, schedule: str, steps: int = 2) -> list[dict]:
    from rollplex.executors.loop import RunOptions, train
    from rollplex.graph.load import parse_spec
    from rollplex.graph.plan import compile_plan

    opts = RunOptions(steps, tmp_path / schedule, progress=False, tensorboard=False)
    return train(compile_plan(parse_spec(text), Schedule(schedule)), opts)


@pytest.mark.slow
def test_mini_batches_update_once_each_and_serial_equals_rollplex_bitwise(tmp_path):
    one = run_text(tmp_path / "one", minibatch_text(1), "rollplex")
    serial = run_text(tmp_path / "two", minibatch_text(2), "serial")
    rollplex = run_text(tmp_path / "two", minibatch_text(2), "rollplex")
    assert [r["param_digest"] for r in serial] == [r["param_digest"] for r in rollplex]
    assert [r["loss"] for r in serial] == [r["loss"] for r in rollplex]
    assert one[0]["param_digest"] != rollplex[0]["param_digest"]  # two updates are not one
    assert one[0]["clip_frac"] == 0.0 < rollplex[0]["clip_frac"]  # the second mini-batch's ratio is clipped


def test_mini_batches_split_against_unsplit_give_the_same_losses(tmp_path):
    split = run_text(tmp_path, minibatch_text(2), "rollplex")
    unsplit = run_text(tmp_path, minibatch_text(2), "unsplit")
    for s, u in zip(split, unsplit, strict=True):
        assert s["reward_mean"] == u["reward_mean"]
        for key in ("loss", "kl", "clip_frac"):
            assert s[key] == pytest.approx(u[key], rel=1e-4, abs=1e-6), key


def test_each_mini_batch_backpropagates_through_its_own_prompts_prefix_with_the_unsplit_gradients(monkeypatch):
    """The step's prefix keeps the graph of mini-batch 1's prompts only (the others' rows it scores without
    gradients), a later mini-batch reruns its own; each mini-batch's gradients are the unsplit ones."""
    from rollplex.models.model import Qwen2_5_VL

    text = minibatch_text(2)  # (its checkpoint is trained before the spy)
    calls = []  # (prompts, attached, attached_prompts) of each prefix
    real = Qwen2_5_VL.prefix_chunks

    def spied(self, prompts, **kw):
        calls.append((len(prompts), kw["attached"], kw.get("attached_prompts")))
        return real(self, prompts, **kw)

    monkeypatch.setattr(Qwen2_5_VL, "prefix_chunks", spied)
    split, _, _ = recorded_iteration(Schedule.ROLLPLEX, text)
    assert sorted(c for c in calls if c[1]) == [(2, True, None), (4, True, 2)]  # the rerun of mini-batch 2, the step's
    unsplit, _, _ = recorded_iteration(Schedule.UNSPLIT, text)
    assert len(split.optimizer.history) == len(unsplit.optimizer.history) == 2
    for s, u in zip(split.optimizer.history, unsplit.optimizer.history, strict=True):
        assert s.keys() == u.keys() and any(n.startswith("model.visual.") for n in s)
        largest = max(g.norm() for g in u.values())
        for name, g in u.items():  # a key bias shifts all of a query's scores alike: its gradient is rounding
            scale = 1e-3 * largest if name.endswith("k_proj.bias") else g.norm()
            assert g.norm() > 0, name
            assert (s[name] - g).norm() <= 1e-4 * scale, name


@pytest.mark.parametrize("cap", [4, 1000])
def test_a_capped_microbatch_scores_in_other_batches_and_gives_the_same_gradients(monkeypatch, cap):
    """`memory.microbatch_tokens`: the packed batches hold at most that many tokens (a longer response alone), fewer
    than a group's (more batches) or more (fewer); the loss and every gradient are the uncapped ones."""
    import rollplex.executors.training as training
    from rollplex.models.generate import Rollout

    budgets = []
    real = training.row_batches
    monkeypatch.setattr(
        training, "row_batches", lambda r, max_tokens: budgets.append(max_tokens) or real(r, max_tokens)
    )
    whole, whole_record, _ = recorded_iteration(Schedule.ROLLPLEX)
    capped, capped_record, _ = recorded_iteration(
        Schedule.ROLLPLEX, spec_text() + f"memory: {{microbatch_tokens: {cap}}}\n"
    )
    lens = whole_record.response_lens.flatten().tolist()
    assert lens == capped_record.response_lens.flatten().tolist() and max(lens) > 4 and sum(lens) < 1000
    assert budgets == [3 * max(lens), cap]
    rollout = Rollout(whole_record.responses, whole_record.response_lens, torch.zeros(whole_record.responses.shape))
    uncapped = len(real(rollout, 3 * max(lens)))
    assert len(real(rollout, cap)) > uncapped if cap == 4 else len(real(rollout, cap)) == 1 < uncapped
    assert capped_record.stats["loss"] == pytest.approx(whole_record.stats["loss"], rel=1e-5)
    largest = max(g.norm() for g in whole.optimizer.grads.values())
    for name, g in whole.optimizer.grads.items():  # float32 sums in another order, as split against unsplit
        assert (capped.optimizer.grads[name] - g).norm() <= 1e-4 * max(g.norm(), 1e-3 * largest), name
