"""`model.freeze_vision`: the vision tower is not trained, the reference reads the actor's, and each prompt's vision
output is computed once per step for both prefixes; the schedules still train alike."""

import pytest
import torch
from run_testkit import spec_text

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.plan import compile_plan
from rollplex.models.vision import VisionEncoder


def spec(frozen: bool = True, minibatches: int = 1, prefill: str = "auto"):
    text = spec_text(kl=0.1)
    assert "run: {seed: 3," in text
    text = text.replace("run: {seed: 3,", f"run: {{seed: 3, rollout_prefill: {prefill},")
    line = next(x for x in text.splitlines() if x.startswith("model: "))
    text = text.replace(line, f"model: {{name: {line[7:]}, freeze_vision: {str(frozen).lower()}}}")
    rewards = "rewards: [{name: test_char_share}]"
    assert rewards in text
    return parse_spec(text.replace(rewards, f"{rewards}, minibatches_per_step: {minibatches}"))


def run(tmp_path, schedule: str, steps: int = 2, minibatches: int = 1):
    opts = RunOptions(steps, tmp_path / f"{schedule}{minibatches}", progress=False, tensorboard=False)
    return train(compile_plan(spec(minibatches=minibatches), Schedule(schedule)), opts)


def test_serial_and_rollplex_train_bitwise_alike_and_unsplit_gives_the_same_losses(tmp_path):
    serial, rollplex, unsplit = (run(tmp_path, s) for s in ("serial", "rollplex", "unsplit"))
    assert [r["param_digest"] for r in serial] == [r["param_digest"] for r in rollplex]
    assert len({r["param_digest"] for r in serial}) == 2  # the weights do move
    for s, u in zip(rollplex, unsplit, strict=True):
        assert s["reward_mean"] == u["reward_mean"] and s["loss"] != 0.0
        assert s["loss"] == pytest.approx(u["loss"], rel=1e-5)


def test_with_minibatches_the_schedules_still_agree(tmp_path):
    serial, rollplex = (run(tmp_path, s, 2, minibatches=2) for s in ("serial", "rollplex"))
    assert [r["param_digest"] for r in serial] == [r["param_digest"] for r in rollplex]
    assert [r["loss"] for r in serial] == [r["loss"] for r in rollplex]


def iteration(frozen: bool, monkeypatch, minibatches: int = 1, prefill: str = "auto"):
    """One rollplex iteration: the vision tower's runs (rollout's prefill included), the engines, and the actor's
    weights before it."""
    plan = compile_plan(spec(frozen, minibatches, prefill), Schedule.ROLLPLEX)  # its test checkpoint runs vision too
    calls = []
    real = VisionEncoder.chunks

    def counted(self, *args, **kw):
        calls.append(len(args[0]))
        return real(self, *args, **kw)

    monkeypatch.setattr(VisionEncoder, "chunks", counted)
    engines = build_engines(plan)
    before = {k: v.clone() for k, v in engines.actor.state_dict().items()}
    examples = batch_at(open_dataset(plan.loaded.spec.workload.dataset, engines.tokenizer, 3), 0, 2)
    run_iteration(plan.graph, engines, examples)
    return len(calls), engines, before


def test_the_tower_is_held_once_untrained_and_runs_once_per_prompt_for_both_prefixes(monkeypatch):
    trained, _, _ = iteration(False, monkeypatch)
    frozen, engines, before = iteration(True, monkeypatch)
    assert trained - frozen == 2  # two prompts in chunks of one: the reference's prefixes read the actor's output
    assert frozen == 2  # and the rollout decodes from the actor's prefix (`rollout_prefill: auto`): no prefill
    actor, reference = engines.actor, engines.reference
    assert reference.model.visual is actor.model.visual
    assert not any(p.requires_grad or p.grad is not None for p in actor.model.visual.parameters())
    visual = {id(p) for p in actor.model.visual.parameters()}
    assert not any(id(p) in visual for p in engines.optimizer.params)
    after = actor.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved and not any(k.startswith("model.visual.") for k in moved)


def test_a_later_minibatchs_prefix_rerun_reads_the_steps_vision_output(monkeypatch):
    one, _, _ = iteration(True, monkeypatch, prefill="rollout")
    two, _, _ = iteration(True, monkeypatch, minibatches=2)  # auto: the rollout prefills under mini-batches
    assert one == two == 3  # the second mini-batch's actor prefix runs again, its vision does not


def test_the_steps_vision_output_goes_once_the_last_prefix_has_read_it(monkeypatch):
    import weakref

    from rollplex.executors import runtime

    made = []

    class Watched(runtime.SharedVision):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            made.append(weakref.ref(self))

    monkeypatch.setattr(runtime, "SharedVision", Watched)
    plan = compile_plan(spec(), Schedule.ROLLPLEX)
    engines = build_engines(plan)
    alive = {}
    examples = batch_at(open_dataset(plan.loaded.spec.workload.dataset, engines.tokenizer, 3), 0, 2)
    run_iteration(plan.graph, engines, examples, before_op=lambda o: alive.setdefault(o.id, made[0]() is not None))
    prefixes = [o for o in alive if o.endswith("prefix")]
    assert prefixes and all(alive[o] for o in prefixes)
    assert alive["actor_backward"] is False  # the suffixes and the backward run without it
