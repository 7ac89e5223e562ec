"""`sharing.update_beside_prefix`: the plan holds the update's workspace and the gradients it reads into the next
step's actor prefix and prices the update beside that prefix; the runtime defers the step, the prefix's modules
wait for their own chunks, everything else for all of it, and a step's metrics line waits for its weights'
digest. On the CPU an update is never in flight, so a stand-in keeps it in flight until `finish`: the run must
then train and log exactly as without."""

from __future__ import annotations

import json
import time

import pytest
import torch
from run_testkit import ROOT, spec_text, train_fresh

from rollplex.executors import runtime
from rollplex.executors.engines import build_engines
from rollplex.executors.loop import RunOptions, train
from rollplex.executors.metrics import Fingerprints
from rollplex.graph.ir import Part, Phase, Role
from rollplex.graph.levers import step_seconds
from rollplex.graph.load import parse_spec
from rollplex.graph.memobject import GIB, PROMPT_INPUTS
from rollplex.graph.plan import compile_plan
from rollplex.graph.timeplan import time_plan
from rollplex.memory.optimizer import ChunkedAdamW

SEVEN = (ROOT / "specs/qwen2_5_vl_7b_h200.yaml").read_text()


class InFlight:
    """A deferred update's stand-in: counts how often the run asks it to enqueue more (`keep_streaming`)."""

    def __init__(self) -> None:
        self.pumps = 0

    def pump(self) -> None:
        self.pumps += 1


def beside(text: str, value: str = "true") -> str:
    return (
        text.replace("sharing:\n", f"sharing:\n  update_beside_prefix: {value}\n")
        if "sharing:\n" in text
        else (text + f"\nsharing: {{update_beside_prefix: {value}}}\n")
    )


def saved_on_host(text: str) -> str:
    """The spec with the prefix's saved tensors on the host, as auto places them for the 7B with the update ending
    its step (with the update beside the prefix the two placements' bounds are a tie, which the one moving fewer
    bytes over the link wins)."""
    return text.replace("memory:\n", "memory:\n  prefix_saved: host\n", 1)


def same_chunks(text: str) -> str:
    """The spec with the chunk beside the prefix forced for both settings: the update's own chunk size would
    otherwise differ (`BESIDE_PREFIX_CHUNK`), and with it the whole chunks of state kept in HBM."""
    if "memory: {" in text:
        return text.replace("memory: {", "memory: {optimizer_chunk_mib: 128, ", 1)
    return text.replace("memory:\n", "memory:\n  optimizer_chunk_mib: 128\n", 1)


def test_the_plan_holds_the_update_into_the_next_actor_prefix_and_prices_it_beside_that_prefix():
    seven = saved_on_host(same_chunks(SEVEN))
    off, on = compile_plan(parse_spec(beside(seven, "false"))), compile_plan(parse_spec(beside(seven)))
    assert on.decisions.update_beside_prefix and not off.decisions.update_beside_prefix
    (first,) = on.residency.update_beside  # the actor prefix's step, alone before decode
    grads = sum(o.bytes for o in on.residency.objects if o.role == "actor" and o.component == "FP32 gradients")
    (inputs,) = [o for o in on.residency.objects if o.name == PROMPT_INPUTS]  # the prefix copies its inputs first
    assert inputs.live == {first} and 0.5 * GIB < inputs.bytes < 1 * GIB  # the 7B's patches in FP32, mostly
    assert not [o for o in off.residency.objects if o.name == PROMPT_INPUTS]
    held = on.residency.step_bytes[first] - off.residency.step_bytes[first]
    assert held == grads + on.residency.optimizer.workspace_bytes + inputs.bytes
    phase1 = lambda plan: next(p.peak_bytes for p in plan.residency.phases if p.phase is Phase.ROLLOUT)  # noqa: E731
    assert phase1(on) > phase1(off) and on.residency.fits
    was, now = ({r.timer: r for r in time_plan(plan)} for plan in (off, on))
    assert now["update"].bound_s < 0.1 < was["update"].bound_s  # the grad norm is all its step waits for
    assert now["actor_prefix"].cost.host_bytes == was["actor_prefix"].cost.host_bytes + was["update"].cost.host_bytes
    assert step_seconds(on)[0] < step_seconds(off)[0] - 0.5  # the update's link time, largely under the prefix's
    prefilling = compile_plan(parse_spec(beside(SEVEN) + "run: {rollout_prefill: rollout}\n"))
    assert not prefilling.decisions.update_beside_prefix and prefilling.residency.update_beside == ()


def test_auto_runs_a_streamed_update_beside_the_next_prefix_where_that_lowers_the_step_bound():
    """`update_beside_prefix: auto` (the default): the 7B's FP32 state streams, so its update (the link's time)
    runs under the next actor prefix (compute) and the dry-run says why; the 3B keeps its state in HBM and its
    update ends its step, unless its state is sent to the host; where decode does not read the actor prefix there
    is nothing to run beside."""
    auto, on = compile_plan(parse_spec(SEVEN)), compile_plan(parse_spec(saved_on_host(beside(SEVEN))))
    assert auto.decisions == on.decisions and auto.residency == on.residency
    assert (
        auto.chosen.splitlines()[-1].startswith("sharing.update_beside_prefix auto: true") and "against" in auto.chosen
    )
    assert auto.loaded.spec.sharing.update_beside_prefix is True  # the plan carries the choice to plan.json
    assert step_seconds(auto)[0] < step_seconds(compile_plan(parse_spec(beside(SEVEN, "false"))))[0] - 0.5
    three = (ROOT / "specs/qwen2_5_vl_3b_h200.yaml").read_text()
    assert not compile_plan(parse_spec(three)).decisions.update_beside_prefix  # in HBM: nothing to hide
    streamed = compile_plan(parse_spec(three.replace("memory:\n", "memory:\n  optimizer_state: host\n")))
    assert streamed.decisions.update_beside_prefix and "update_beside_prefix auto" in streamed.chosen
    prefilling = compile_plan(parse_spec(SEVEN + "run: {rollout_prefill: rollout}\n"))
    assert not prefilling.decisions.update_beside_prefix and "update_beside_prefix" not in prefilling.chosen
    ppo = (ROOT / "specs/ppo_critic_7b_h200.yaml").read_text().replace("qwen2_5_vl_7b", "qwen2_5_vl_3b")
    kept = compile_plan(parse_spec(ppo.replace("hbm_gib: 139", "hbm_gib: 120")))  # only the critic's state streams
    assert kept.decisions.optimizer_kept_bytes > 0 and not kept.decisions.update_beside_prefix


def test_a_critics_update_stays_in_its_step_when_the_actors_runs_beside_the_next_prefix():
    """PPO: only the actor's optimizer defers its step; the critic's update is priced where it runs."""
    text = same_chunks((ROOT / "specs/ppo_critic_7b_h200.yaml").read_text())
    off, on = (compile_plan(parse_spec(beside(text, v))) for v in ("false", "true"))
    was, now = ({r.timer: r for r in time_plan(plan)} for plan in (off, on))
    assert on.decisions.update_beside_prefix
    moved = now["actor_prefix"].cost.host_bytes - was["actor_prefix"].cost.host_bytes
    assert 0 < moved < was["update"].cost.host_bytes  # the actor's state, not the critic's
    assert now["update"].cost.host_bytes == pytest.approx(was["update"].cost.host_bytes - moved)


def test_the_engines_gate_each_layer_block_and_other_module_with_parameters_on_its_chunks():
    """Decoder layers and vision blocks wait for all of theirs at once (`gate_modules`' `whole`); every other
    module with parameters of its own (embeddings, merger, norms, head) for its own."""
    counts = []
    for text in (spec_text(), beside(spec_text())):
        engines = build_engines(compile_plan(parse_spec(text)))
        counts.append(sum(len(m._forward_pre_hooks) for m in engines.actor.modules()))
    model = engines.actor.model
    units = [*model.visual.blocks, *model.language_model.layers]
    inside = {id(m) for unit in units for m in unit.modules()}
    owners = [m for m in engines.actor.modules() if id(m) not in inside and list(m.parameters(recurse=False))]
    assert engines.update_beside_prefix and counts[1] - counts[0] == len(units) + len(owners) and owners


def ppo_text() -> str:
    return (ROOT / "specs/ppo_critic_tiny.yaml").read_text()


@pytest.mark.parametrize("text_of", [spec_text, ppo_text], ids=["grpo", "ppo"])
def test_a_deferred_update_trains_and_logs_as_a_joined_one(tmp_path, monkeypatch, text_of):
    """PPO too: the critic's update, in the step before the actor's, runs with none in flight, and the critic's
    digest (of weights the actor's update does not touch) is read at its step's end."""
    events, pumps = [], []
    step, finish = ChunkedAdamW.step, ChunkedAdamW.finish

    live, actor_digests = {}, []

    def deferred_step(self, defer=False):
        norm = step(self)
        if defer:
            self.in_flight, self.waited = InFlight(), 0  # the stand-in
            live["optimizer"] = self
        return norm

    def checked_fingerprints(model):  # the actor's: launched only once its update is done
        optimizer = live["optimizer"]
        if any(p is next(model.parameters()) for p in optimizer.params):
            assert optimizer.in_flight is None
            actor_digests.append(model)
        return fingerprints_of(model)

    def stand_in_wait(self, params):
        self.waited += len(list(params))

    def stand_in_finish(self):
        if self.in_flight is not None:
            events.append(self.waited)
            pumps.append(self.in_flight.pumps)
            self.in_flight = None
        finish(self)

    handler, decode, fingerprints_of = runtime._handler, runtime._decode, Fingerprints.of

    def checked(o):  # every op but the actor prefix starts with no update in flight
        def run(e, *args):
            assert e.optimizer.in_flight is None or (o.role, o.part) == (Role.ACTOR, Part.PREFIX), o.id
            return handler(o)(e, *args)

        return run

    def checked_decode(e, *args):
        assert e.optimizer.in_flight is None
        return decode(e, *args)

    records = []
    for name, text in (("joined", text_of()), ("deferred", beside(text_of()))):
        with monkeypatch.context() as m:
            if name == "deferred":
                m.setattr(ChunkedAdamW, "step", deferred_step)
                m.setattr(ChunkedAdamW, "wait_for", stand_in_wait)
                m.setattr(ChunkedAdamW, "finish", stand_in_finish)
                m.setattr(runtime, "_handler", checked)
                m.setattr(runtime, "_decode", checked_decode)
                m.setattr(Fingerprints, "of", staticmethod(checked_fingerprints))
            records.append(train(compile_plan(parse_spec(text)), RunOptions(3, tmp_path / name, progress=False,
                                                                          tensorboard=False)))  # fmt: skip
    joined, deferred = records
    assert [r["param_digest"] for r in deferred] == [r["param_digest"] for r in joined]
    assert [r["loss"] for r in deferred] == [r["loss"] for r in joined]
    assert len(actor_digests) == 3  # one a step, each after its update
    assert len(events) == 3 and all(waited > 0 for waited in events[:2])  # steps 2, 3's prefixes waited; the end
    assert all(n >= 3 for n in pumps[:2])  # between steps the update was asked for more, not left to the prefix
    lines = [json.loads(x) for x in (tmp_path / "deferred" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3] and [x["param_digest"] for x in lines] == [
        r["param_digest"] for r in joined
    ]
    # what a time plan's efficiency reads: whose actor prefix held the step before's update
    assert [x["update_beside_prefix"] for x in lines] == [False, True, True]
    assert [x["update_deferred"] for x in lines] == [True, True, True]
    assert not any(r["update_beside_prefix"] or r["update_deferred"] for r in joined)


def test_the_rest_of_a_deferred_update_after_the_actor_prefix_counts_as_the_updates_time(tmp_path, monkeypatch):
    """Where the actor prefix ends before the last step's update, the stream waits for the rest before decode: that
    wait is the update's, in the step whose prefix it follows (not a gap between the step's phases)."""
    rest_s, step = 0.3, ChunkedAdamW.step

    def deferred_step(self, defer=False):
        norm = step(self)
        if defer:
            self.in_flight = InFlight()  # the stand-in: its rest takes rest_s
        return norm

    def slow_finish(self):
        if self.in_flight is not None:
            time.sleep(rest_s)
            self.in_flight = None

    monkeypatch.setattr(ChunkedAdamW, "step", deferred_step)
    monkeypatch.setattr(ChunkedAdamW, "wait_for", lambda self, params: None)
    monkeypatch.setattr(ChunkedAdamW, "finish", slow_finish)
    records = train(compile_plan(parse_spec(beside(spec_text()))), RunOptions(3, tmp_path, progress=False,
                                                                              tensorboard=False))  # fmt: skip
    updates = [r["time_s"]["update"] for r in records]
    assert updates[0] < rest_s <= min(updates[1:]), updates  # steps 2 and 3 waited for the step before's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_a_deferred_update_trains_bitwise_as_a_joined_one(tmp_path):
    """The real thing: the update on the optimizer's streams while the next prefix runs (deterministic kernels),
    each run compiling as a process of its own would (`train_fresh`)."""
    text = spec_text(device="cuda").replace("device: cuda,", "device: cuda, deterministic: true,")
    records = []
    for name, spec in (("deferred", beside(text)), ("joined", text)):
        plan = compile_plan(parse_spec(spec))
        assert plan.decisions.update_beside_prefix is (name == "deferred")
        records.append(train_fresh(plan, RunOptions(3, tmp_path / name, progress=False, tensorboard=False)))
    deferred, joined = records
    assert [r["param_digest"] for r in deferred] == [r["param_digest"] for r in joined]
    assert [r["loss"] for r in deferred] == [r["loss"] for r in joined]
    assert len({r["param_digest"] for r in joined}) == 3


def test_a_gated_prefix_reads_no_parameter_before_its_gate_waited_for_it(monkeypatch):
    """Each decoder layer and vision block waits for all of its parameters in a forward pre-hook (`gate_modules`,
    as the engines gate the actor), its submodules carry no hook (for a compiled region to trace, and its packed
    projections run as one GEMM, not through their own forwards); every other module with parameters waits for its
    own: so a parameter must be read inside its own module's forward (the patch embedding's weight was read by its
    parent's)."""
    monkeypatch.syspath_prepend(str(ROOT / "tests/models"))
    from models_testkit import TinyInputs

    from rollplex.memory.in_flight import gate_modules
    from rollplex.models.chunks import drain
    from rollplex.models.config import load_model_config
    from rollplex.models.model import Qwen2_5_VL
    from rollplex.models.rerun import Rerun

    config = load_model_config("tiny")
    torch.manual_seed(0)
    model = Qwen2_5_VL(config)
    inputs = TinyInputs(config, torch.Generator().manual_seed(1234))
    prompts = [inputs.prompt(2, inputs.video((2, 8, 8), second_per_grid_t=1.5), 3), inputs.prompt(6)]
    names = {id(p): n for n, p in model.named_parameters()}

    class InFlight:  # an update in flight, as `ChunkedAdamW` is after `step(defer=True)`
        in_flight, waited = True, set()

        def wait_for(self, params):
            self.waited.update(id(p) for p in params)

    update = InFlight()
    units = [*model.model.visual.blocks, *model.model.language_model.layers]
    gate_modules(model, update, whole=units)
    assert [m for unit in units for m in unit.modules() if m._forward_pre_hooks] == units
    early, read = set(), set()

    class Reads(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") != "__get__":  # a .dtype or .device reads no data
                for a in (*args, *(kwargs or {}).values()):
                    if isinstance(a, torch.Tensor) and id(a) in names:
                        read.add(names[id(a)])
                        if id(a) not in update.waited:
                            early.add(names[id(a)])
            return func(*args, **(kwargs or {}))

    with Reads():
        drain(model.prefix_chunks(prompts, attached=True, rerun=Rerun()))
    assert "model.visual.patch_embed.proj.weight" in read and not early, early


def test_an_interrupt_beside_a_deferred_update_waits_until_the_next_prefix_has_joined_it(tmp_path, monkeypatch):
    """Ctrl-C while the next actor prefix drives a deferred update's chunks is held until that prefix has joined
    the update: a checkpoint never holds half an update (stand-in update on the CPU, as above)."""
    import os
    import signal

    step, finish = ChunkedAdamW.step, ChunkedAdamW.finish
    waits = {"after_interrupt": 0, "sent": False}

    def deferred_step(self, defer=False):
        norm = step(self)
        if defer:
            self.in_flight = InFlight()
        return norm

    def stand_in_wait(self, params):
        if waits["sent"]:
            waits["after_interrupt"] += 1
        elif self.num_steps == 2:  # step 2's update in flight: step 3's prefix is driving it
            waits["sent"] = True
            os.kill(os.getpid(), signal.SIGINT)

    def stand_in_finish(self):
        self.in_flight = None
        finish(self)

    monkeypatch.setattr(ChunkedAdamW, "step", deferred_step)
    monkeypatch.setattr(ChunkedAdamW, "wait_for", stand_in_wait)
    monkeypatch.setattr(ChunkedAdamW, "finish", stand_in_finish)
    plan = compile_plan(parse_spec(beside(spec_text())))
    with pytest.raises(KeyboardInterrupt):
        train(plan, RunOptions(4, tmp_path / "r", progress=False, tensorboard=False, checkpoint_every=100))
    assert waits["sent"] and waits["after_interrupt"] > 1  # the prefix went on through its gates
    assert sorted(p.name for p in (tmp_path / "r" / "checkpoints").iterdir()) == ["step-000002"]
    lines = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
