import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rollplex.graph.ir import Phase, Step, TensorClass, steps
from rollplex.graph.load import load_spec
from rollplex.graph.plan import compile_plan
from rollplex.memory.backends import CpuBackend, vmm_backend
from rollplex.memory.manager import MappingInUse, Move, ResidencyManager, object_name
from rollplex.memory.objects import MemObject, Residency
from rollplex.memory.residency import HostPlan, ResidencyPlan

SPECS = Path(__file__).resolve().parents[2] / "specs"
MiB = 2**20
REF, SAVED, SNAPSHOT, KV, GRADS = (
    "reference weights (BF16)",
    "actor prefix saved tensors",
    "actor weights (BF16)",
    "rollout KV cache",
    "actor FP32 gradients",
)


def hand_plan(unit: int = MiB) -> tuple[ResidencyPlan, tuple[Step, ...]]:
    """Four steps, one object per kind of move:
    reference weights  HBM  host HBM  host   (frozen: paged in and out)
    saved tensors       -   HBM  host HBM    (evicted and restored)
    actor weights      HBM  HBM  drop HBM    (dropped, regenerated)
    KV cache           HBM  HBM   -    -     (released)
    gradients           -    -   HBM  HBM    (mapped fresh)
    master weights     host host host host   (never in HBM: not managed)"""
    everywhere = frozenset(range(4))
    R, P, H, D, A = (
        TensorClass.REGENERABLE,
        TensorClass.PHASE_LOCAL,
        Residency.HOST,
        Residency.DROPPED,
        Residency.ABSENT,
    )
    objects = (
        MemObject("reference", "weights (BF16)", R, 4 * unit, frozenset({0, 2}), H, False, 4 * unit, everywhere),
        MemObject(
            "actor", "prefix saved tensors", P, 3 * unit, frozenset({1, 3}), H, False, 3 * unit, frozenset({1, 2, 3})
        ),
        MemObject("actor", "weights (BF16)", R, 2 * unit, frozenset({0, 1, 3}), D, window=everywhere),
        MemObject("rollout", "KV cache", P, 5 * unit, frozenset({0, 1}), A),
        MemObject("actor", "FP32 gradients", P, 6 * unit, frozenset({2, 3}), A),
        MemObject("actor", "FP32 master weights", TensorClass.PERMANENT, unit, frozenset(), H, False, unit),
    )
    step_bytes = tuple(sum(o.bytes for o in objects if s in o.live) for s in range(4))
    plan = ResidencyPlan(objects, step_bytes, (), None, HostPlan(0, 0, 0), 64 * unit)
    phases = (Phase.ROLLOUT, Phase.ROLLOUT, Phase.TRAIN, Phase.UPDATE)
    return plan, tuple(Step(i, p, ()) for i, p in enumerate(phases))


def scaled(plan: ResidencyPlan, factor: int) -> ResidencyPlan:
    """The same plan with every object `factor` times smaller."""
    objects = tuple(replace(o, bytes=o.bytes // factor, host_bytes=o.host_bytes // factor) for o in plan.objects)
    step_bytes = tuple(sum(o.bytes for o in objects if s in o.live) for s in range(len(plan.step_bytes)))
    return replace(plan, objects=objects, step_bytes=step_bytes)


def real_plan(factor: int = 2**12, qkv_sharing: str = "in_place", tmp: Path | None = None, host_gib: int = 100):
    """The 7B one-H200 plan, scaled down; with qkv_sharing "copy" (written next to `tmp`) the paper's Case-3 copy;
    with more `host_gib` than its 100, room in the host pool for the reference's weights between their steps."""
    path = SPECS / "qwen2_5_vl_7b_h200.yaml"
    if qkv_sharing != "in_place" or host_gib != 100:
        text = path.read_text().replace("  rollout_tp: 1\n", f"  rollout_tp: 1\n  qkv_sharing: {qkv_sharing}\n")
        path = tmp / "spec.yaml"
        path.write_text(text.replace("host_gib: 100", f"host_gib: {host_gib}"))
    plan = compile_plan(load_spec(path))
    return scaled(plan.residency, factor), steps(plan.graph)


class FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def test_after_each_step_of_a_real_plan_the_backend_holds_exactly_that_steps_bytes():
    plan, order = real_plan()
    backend = CpuBackend()
    manager = ResidencyManager(plan, order, backend)
    for step in [*range(len(order)), *range(len(order))]:  # two iterations: the last step wraps to step 0
        manager.enter(step)
        assert backend.mapped_bytes == plan.step_bytes[step]
        for name in manager.names:
            assert backend.is_mapped(name) == (manager.residency(name) is Residency.HBM)


def test_frees_run_before_takes_so_a_barrier_never_exceeds_the_larger_of_its_two_steps():
    plan, order = real_plan()
    backend = CpuBackend()
    manager = ResidencyManager(plan, order, backend)
    manager.enter(len(order) - 1)
    take_first_would_exceed = False
    for step, before in zip(range(len(order)), [len(order) - 1, *range(len(order) - 1)], strict=True):
        moves = manager.transitions(step)
        taken = sum(t.num_bytes for t in moves if not t.move.frees)
        take_first_would_exceed |= backend.mapped_bytes + taken > max(plan.step_bytes[before], plan.step_bytes[step])
        assert [t.move.frees for t in moves] == sorted((t.move.frees for t in moves), reverse=True)
        backend.reset_peak()
        manager.enter(step)
        assert backend.peak_bytes <= max(plan.step_bytes[before], plan.step_bytes[step])
    assert take_first_would_exceed, "the plan has a barrier where the order matters"


def test_the_real_plan_pages_the_reference_weights_and_drops_the_case3_buffer(tmp_path):
    plan, order = real_plan(qkv_sharing="copy", tmp=tmp_path, host_gib=128)
    assert "rollout Case-3 buffer" not in ResidencyManager(real_plan()[0], order, CpuBackend()).names  # in place
    manager = ResidencyManager(plan, order, CpuBackend())
    buffer = "rollout Case-3 buffer"
    moves = [{t.name: t.move for t in manager.enter(s)} for s in range(len(order))]
    for weights in ("reference weights (BF16)", "reference vision weights (BF16)"):  # together, as one pager
        assert moves[0][weights] is Move.RESTORE and moves[1][weights] is Move.PAGE_OUT
    assert moves[2][buffer] is Move.DROP and moves[6][buffer] is Move.MAP
    assert "actor FP32 master weights" not in manager.names, "never in HBM: the optimizer streams it"


def test_evicted_contents_come_back_at_the_same_address():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    manager.enter(0)
    manager.enter(1)
    saved = manager.tensor(SAVED, torch.float32, (1024, 768))
    saved.copy_(torch.randn(1024, 768))
    expected, address = saved.clone(), saved.data_ptr()
    assert {t.name: t.move for t in manager.enter(2)}[SAVED] is Move.EVICT
    assert not torch.equal(saved, expected), "the released pages no longer hold the bytes"
    assert torch.equal(manager.host_tensor(SAVED, torch.float32, (1024, 768)), expected)
    assert {t.name: t.move for t in manager.enter(3)}[SAVED] is Move.RESTORE
    assert saved.data_ptr() == address and torch.equal(saved, expected)


def test_frozen_weights_page_in_from_the_host_pool_and_page_out_without_a_copy():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    assert manager.residency(REF) is Residency.HOST
    weights = torch.randn(1024, 1024)
    manager.host_tensor(REF, torch.float32, (1024, 1024)).copy_(weights)
    for step in range(4):
        manager.enter(step)
        if step in (0, 2):
            assert torch.equal(manager.tensor(REF, torch.float32, (1024, 1024)), weights)
    per_step = manager.stats.steps
    assert per_step[1].bytes_to_host == 0 and per_step[3].bytes_to_host == 0, "page-outs copy nothing"
    assert per_step[0].bytes_to_device == 4 * MiB


def test_dropped_released_and_fresh_objects_get_pages_without_contents():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    manager.enter(0)
    snapshot = manager.tensor(SNAPSHOT, torch.uint8, (2 * MiB,))
    snapshot.fill_(1)
    manager.enter(1)
    moves = {t.name: t.move for t in manager.enter(2)}
    assert moves[SNAPSHOT] is Move.DROP and moves[KV] is Move.RELEASE and moves[GRADS] is Move.MAP
    assert manager.residency(SNAPSHOT) is Residency.DROPPED and manager.residency(KV) is Residency.ABSENT
    assert {t.name: t.move for t in manager.enter(3)}[SNAPSHOT] is Move.MAP
    assert not snapshot.eq(1).any(), "a dropped object is rebuilt by its producer, not copied back"
    assert manager.stats.bytes_to_host == 3 * MiB, "only the saved tensors were copied out"


def test_a_reader_in_flight_makes_the_transition_refuse_and_change_nothing():
    plan, order = hand_plan()
    backend = CpuBackend()
    manager = ResidencyManager(plan, order, backend)
    manager.enter(0)
    manager.enter(1)
    event = FakeEvent()
    manager.reading(KV, event)
    manager.reading(SNAPSHOT, FakeEvent())
    with pytest.raises(MappingInUse, match=r"cannot enter step 2 \(Phase 2.*release 'rollout KV cache'.*wait=True"):
        manager.enter(2)
    assert manager.residency(KV) is Residency.HBM and backend.mapped_bytes == plan.step_bytes[1]
    event.done = True
    with pytest.raises(MappingInUse, match="drop 'actor weights"):
        manager.enter(2)


def test_enter_with_wait_synchronizes_the_readers_first():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    manager.enter(0)
    manager.enter(1)
    event = FakeEvent()
    manager.reading(KV, event)
    manager.enter(2, wait=True)
    assert event.done and manager.residency(KV) is Residency.ABSENT


def test_a_reader_block_records_an_event_on_the_current_stream():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    manager.enter(0)
    with manager.reader(KV):
        manager.tensor(KV, torch.float32, (16,)).sum()
    manager.enter(1)
    manager.enter(2)  # the CPU backend's events complete at once: nothing in flight
    with pytest.raises(ValueError, match="'rollout KV cache' is ABSENT, not in HBM"):
        manager.reading(KV, FakeEvent())


def test_stats_count_bytes_each_way_and_seconds_per_step_and_phase():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    for step in [0, 1, 2, 3, 0]:
        manager.enter(step)
    stats = manager.stats
    assert stats.steps[0].num_entries == 2 and stats.steps[3].num_entries == 1
    assert stats.bytes_to_device == 3 * 4 * MiB + 3 * MiB, "the reference weights three times, the saved tensors once"
    assert stats.bytes_to_host == 3 * MiB
    assert stats.steps[2].num_transitions == 5 and stats.steps[2].bytes_to_host == 3 * MiB
    seconds = stats.phase_seconds()
    assert set(seconds) == {Phase.ROLLOUT, Phase.TRAIN, Phase.UPDATE}
    assert seconds[Phase.ROLLOUT] == pytest.approx(stats.steps[0].seconds + stats.steps[1].seconds)
    assert stats.seconds == pytest.approx(sum(seconds.values())) and stats.seconds > 0
    with pytest.raises(AttributeError):
        stats.steps = ()


def test_unknown_names_and_steps_are_clear_errors():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend())
    with pytest.raises(ValueError, match=r"no object named 'rollout KV cash'.*did you mean 'rollout KV cache'"):
        manager.tensor("rollout KV cash", torch.float32, (1,))
    with pytest.raises(ValueError, match="'actor FP32 master weights' is in the plan but never in HBM"):
        manager.tensor("actor FP32 master weights", torch.float32, (1,))
    with pytest.raises(ValueError, match="no object named 'nope'"):
        manager.reading("nope", FakeEvent())
    with pytest.raises(ValueError, match="has no host block"):
        manager.host_tensor(KV, torch.float32, (1,))
    with pytest.raises(ValueError, match=r"step 4 is not in the plan: steps are 0\.\.3"):
        manager.enter(4)
    with pytest.raises(ValueError, match="needs 4194308 bytes"):
        manager.tensor(REF, torch.float32, (4 * MiB // 4 + 1,))
    assert object_name(plan.objects[0]) == REF


def test_only_objects_in_hbm_somewhere_get_a_region_and_only_those_visiting_the_host_a_block():
    plan, order = hand_plan()
    manager = ResidencyManager(plan, order, CpuBackend(), exclude=frozenset({KV}))
    assert set(manager.names) == {REF, SAVED, SNAPSHOT, GRADS}
    manager.host_tensor(SAVED, torch.uint8, (3 * MiB,))
    with pytest.raises(ValueError, match="has no host block"):
        manager.host_tensor(GRADS, torch.uint8, (1,))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_addresses_and_contents_survive_every_move_of_the_vmm_backend():
    plan, order = hand_plan(unit=64 * MiB)
    manager = ResidencyManager(plan, order, vmm_backend(plan))
    try:
        n = 4 * 64 * MiB // 2
        weights = torch.randn(n, dtype=torch.bfloat16)
        manager.host_tensor(REF, torch.bfloat16, (n,)).copy_(weights)
        start, views = time.perf_counter(), {}
        for step in [0, 1, 2, 3, 0, 1, 2, 3]:
            moves = manager.enter(step, wait=True)  # the reader of the step before may still be running
            if step == 0:  # views made once the pages exist; they must keep their address from here on
                views.setdefault(REF, manager.tensor(REF, torch.bfloat16, (n,)))
            if step == 1:
                views.setdefault(SAVED, manager.tensor(SAVED, torch.uint8, (3 * 64 * MiB,))).fill_(8)
            if step == 3:
                assert views[SAVED].eq(8).all().item(), "evicted at step 2, restored at step 3"
            if manager.residency(REF) is Residency.HBM:
                ref = manager.tensor(REF, torch.bfloat16, (n,))
                assert torch.equal(ref.cpu(), weights), "paged in from the host pool"
                with manager.reader(REF):
                    ref.float().sum()
            assert all(t.move is not Move.EVICT or t.name == SAVED for t in moves), "frozen weights page out"
        seconds = time.perf_counter() - start
        for name, view in views.items():
            assert manager.tensor(name, view.dtype, tuple(view.shape)).data_ptr() == view.data_ptr()
        s = manager.stats
        moved = s.bytes_to_device + s.bytes_to_host
        print(
            f"\nmanager: {moved / MiB:.0f} MiB moved ({s.bytes_to_device / MiB:.0f} to device, "
            f"{s.bytes_to_host / MiB:.0f} to host) in {s.seconds:.3f} s of barriers "
            f"({moved / max(s.seconds, 1e-9) / 2**30:.1f} GiB/s; loop {seconds:.3f} s); per phase "
            + ", ".join(f"{p.name} {t * 1e3:.1f} ms" for p, t in s.phase_seconds().items())
        )
    finally:
        manager.close()
