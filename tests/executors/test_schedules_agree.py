"""The schedules train alike on the tiny model: serial and rollplex give bitwise the same weights and losses (on
the CPU, on a GPU with the graph-captured rollout, in prefix chunks of one prompt, with the rollout decoding from
the actor's prefix), and only rollplex runs its prefixes beside decode; unsplit gives the same losses and every
parameter the same gradient within float32 rounding; a graph without a reference trains alike in each of them."""

import pytest
import torch
from run_testkit import ROOT, loaded, run, spec_text
from training_testkit import gradients

from rollplex.data.source import batch_at, open_dataset
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.runtime import run_iteration
from rollplex.graph.ir import Schedule
from rollplex.graph.load import parse_spec
from rollplex.graph.pipeline import compile_graph
from rollplex.graph.plan import compile_plan


def test_serial_and_rollplex_give_bitwise_identical_weights_and_losses(tmp_path):
    a, b = run(tmp_path, "serial", 3), run(tmp_path, "rollplex", 3)
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b]
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert len({r["param_digest"] for r in a}) == 3  # the weights do move


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_serial_and_rollplex_train_identically_with_the_graph_captured_rollout(tmp_path):
    a, b = run(tmp_path, "serial", 3, device="cuda"), run(tmp_path, "rollplex", 3, device="cuda")
    assert [r["param_digest"] for r in a] == [r["param_digest"] for r in b]
    assert [r["reward_mean"] for r in a] == [r["reward_mean"] for r in b]
    assert len({r["param_digest"] for r in a}) == 3
    for r in a + b:  # the driver's view of the device, per phase: at least the CUDA context and the weights
        assert set(r["peak_gib_by_phase"]) == {"1", "2", "3"} and min(r["peak_gib_by_phase"].values()) > 0.1


def test_prefix_chunks_of_one_prompt_keep_serial_and_rollplex_bitwise_identical(tmp_path):
    spec = parse_spec(spec_text(kl=0.1, device="cpu") + "sharing: {prompts_per_chunk: 1, layers_per_chunk: 2}\n")
    runs = [
        train(compile_plan(spec, Schedule(s)), RunOptions(2, tmp_path / s, progress=False, tensorboard=False))
        for s in ("serial", "rollplex")
    ]
    assert [r["param_digest"] for r in runs[0]] == [r["param_digest"] for r in runs[1]]
    assert runs[1][0]["prefix_beside_decode"] > 0.5


def test_prefix_work_held_for_the_rollouts_tail_keeps_serial_and_rollplex_bitwise_identical(tmp_path):
    text = spec_text(kl=0.1, device="cpu") + "sharing: {prompts_per_chunk: 1, tail_rows: 2}\n"
    spec = parse_spec(text)
    runs = [
        train(compile_plan(spec, Schedule(s)), RunOptions(2, tmp_path / s, progress=False, tensorboard=False))
        for s in ("serial", "rollplex")
    ]
    assert [r["param_digest"] for r in runs[0]] == [r["param_digest"] for r in runs[1]]
    whole = run(tmp_path, "rollplex", 2, name="from_the_first_step")
    assert [r["param_digest"] for r in whole] == [r["param_digest"] for r in runs[1]]
    assert all(r["prefix_beside_decode"] < w["prefix_beside_decode"] for r, w in zip(runs[1], whole, strict=True))


def test_rollplex_runs_its_prefixes_beside_decode_and_serial_does_not(tmp_path):
    a, b = run(tmp_path, "serial", 1), run(tmp_path, "rollplex", 1)
    # 6 decode steps against 2 prompts x (vision blocks + decoder layers) of one-prompt chunks: a part fits
    assert a[0]["prefix_beside_decode"] == 0.0 and b[0]["prefix_beside_decode"] > 0.25
    # the reference's inside the rollout's time; the actor's runs before decode, which reads its boundary
    assert b[0]["time_s"]["ref_prefix"] == 0.0 < b[0]["time_s"]["actor_prefix"]


def test_unsplit_textbook_grpo_gives_the_same_losses(tmp_path):
    split, unsplit = run(tmp_path, "rollplex"), run(tmp_path, "unsplit")
    for s, u in zip(split, unsplit, strict=True):
        assert s["reward_mean"] == u["reward_mean"]
        assert s["loss"] == pytest.approx(u["loss"], rel=1e-5)
        assert s["loss"] != 0.0


def test_split_with_prefix_sharing_gives_every_parameter_the_unsplit_gradient():
    split, unsplit = gradients(Schedule.ROLLPLEX), gradients(Schedule.UNSPLIT)
    assert split.keys() == unsplit.keys()
    assert any(n.startswith("model.visual.") for n in split)
    # float32 sums in another order, held to 1e-4 of each parameter's gradient plus 1e-8 of the whole gradient's
    # norm: q and k carry ~1e-5 of it, and a key bias's gradient is zero but for rounding (softmax ignores a shift
    # shared by every key), so theirs are mostly rounding
    whole = torch.cat([g.flatten() for g in unsplit.values()]).norm()
    for name, g in unsplit.items():
        assert g.norm() > 0, name
        assert (split[name] - g).norm() <= 1e-4 * g.norm() + 1e-8 * whole, name


def test_kl_coefficient_zero_runs_without_a_reference_model(tmp_path):
    engines = build_engines(compile_plan(loaded(kl=0.0)))
    assert engines.reference is None
    records = train(
        compile_plan(loaded(kl=0.0), Schedule.ROLLPLEX), RunOptions(1, tmp_path, progress=False, tensorboard=False)
    )
    assert not any(key.startswith("ref_") for key in records[0]["time_s"]) and records[0]["kl"] == 0.0


def test_the_shipped_graph_without_a_reference_trains_alike_in_every_schedule(tmp_path):
    spec = parse_spec((ROOT / "specs/grpo_no_reference_tiny.yaml").read_text())
    runs = {
        s: train(compile_plan(spec, Schedule(s)), RunOptions(2, tmp_path / s, progress=False, tensorboard=False))
        for s in ("serial", "rollplex", "unsplit")
    }
    assert [r["param_digest"] for r in runs["serial"]] == [r["param_digest"] for r in runs["rollplex"]]
    for s, u in zip(runs["rollplex"], runs["unsplit"], strict=True):
        # at the first step the ratio is 1 and each group's advantages sum to zero: the loss is rounding about
        # zero (~1e-5), so it is held to 1e-7 besides 1e-5 of itself
        assert s["kl"] == 0.0 and s["loss"] != 0.0 and s["loss"] == pytest.approx(u["loss"], rel=1e-5, abs=1e-7)


def step_noting_prefills(spec, schedule: Schedule):
    """One step of `spec`: its record, whether each rollout was handed a prefill, and the updated weights."""
    engines = build_engines(compile_plan(spec, schedule))
    dataset = open_dataset(spec.spec.workload.dataset, engines.tokenizer, 3)
    prefills, rollout = [], engines.rollout
    engines.rollout = lambda *a, **kw: prefills.append("boundary" in kw) or rollout(*a, **kw)
    record = run_iteration(compile_graph(spec.spec, schedule=schedule), engines, batch_at(dataset, 0, 2))
    return record, prefills, [p.detach().clone() for p in engines.actor.parameters()]


def test_a_rollout_from_the_actors_prefix_samples_and_trains_as_its_own_prefill_does():
    """The actor prefix computes the prompts' KV and first-token log-probs on the rollout's weights, so the
    rollout decoding from it samples the same tokens and the step trains the same weights as the rollout's own
    prefill (to rounding: the two prefill in other batches); serial and rollplex stay bitwise alike with it."""
    text = spec_text(kl=0.1, device="cpu")
    assert "run: {seed: 3," in text
    own = parse_spec(text.replace("run: {seed: 3,", "run: {seed: 3, rollout_prefill: rollout,"))
    shared = parse_spec(text)  # auto: the actor's prefix, as the spec allows it
    a, own_prefills, wa = step_noting_prefills(own, Schedule.SERIAL)
    b, serial_prefills, wb = step_noting_prefills(shared, Schedule.SERIAL)
    c, rollplex_prefills, wc = step_noting_prefills(shared, Schedule.ROLLPLEX)
    assert own_prefills == [False] and serial_prefills == rollplex_prefills == [True]
    assert torch.equal(a.responses, b.responses) and torch.equal(a.rewards, b.rewards)
    for key, value in a.stats.items():
        assert b.stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    for p, q in zip(wa, wb, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    assert all(c.stats[k] == v for k, v in b.stats.items())  # rollplex also says how its prefixes overlapped
    assert all(torch.equal(p, q) for p, q in zip(wb, wc, strict=True))
