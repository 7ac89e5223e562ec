"""Prefix chunks beside decode: in order whatever the batch; under `green:adaptive` in the partition the live
decode batch picks; under `sharing.tail_rows` only from the rollout's tail on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rollplex.rollout.beside import AdaptivePartition, Beside, adaptive_sms

SIZES = (33, 66, 99)
SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_half_the_sms_at_the_full_batch_and_more_as_the_batch_drains():
    assert adaptive_sms(64, 64, SIZES, 132) == 66
    assert adaptive_sms(32, 64, SIZES, 132) == 99  # target 99
    assert adaptive_sms(1, 64, SIZES, 132) == 99  # never above the largest partition
    assert adaptive_sms(0, 0, SIZES, 132) == 99  # nothing seen yet: the largest
    assert adaptive_sms(64, 64, (80, 100), 132) == 80  # none fits the target: the smallest


def test_the_full_batch_is_the_largest_seen_so_far():
    streams = {99: "s99", 33: "s33", 66: "s66"}  # stand-ins: the policy only picks among them
    choose = AdaptivePartition(streams, 132)
    picked = [choose(rows) for rows in (64, 48, 16, 1)]
    assert picked == ["s66", "s66", "s99", "s99"]  # 48 of 64: target 82.5 -> 66
    assert choose.full_rows == 64


def test_inline_beside_runs_jobs_in_order_whatever_the_batch():
    def job(k, log):
        for i in range(3):
            log.append((k, i))
            yield
        return k

    log = []
    beside = Beside([job(0, log), job(1, log)])
    for rows in (8, 4, 2):
        beside(rows)
    assert beside.finish() == [0, 1]
    assert log == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_under_tail_rows_the_first_chunk_waits_for_a_batch_that_small_and_the_rest_follow():
    def job(log):
        for i in range(4):
            log.append(i)
            yield
        return "done"

    log = []
    beside = Beside([job(log)], tail_rows=8)
    for rows in (64, 48, 16):
        beside(rows)
    assert log == [] and beside.num_chunks == 0  # the batch is wider than the tail
    beside(8)
    beside(16)  # begun: the next chunk follows whatever the batch (a batch only drains)
    assert log == [0, 1]
    assert beside.finish() == ["done"] and log == [0, 1, 2, 3]
    late = Beside([job([])], tail_rows=4)
    for rows in (64, 8):
        late(rows)
    assert late.num_chunks == 0 and late.finish() == ["done"]  # decode ended first: all of it after


def test_tail_rows_reaches_the_prefix_streams_and_is_refused_under_mps():
    from rollplex.errors import SpecError
    from rollplex.executors.policies import make_prefix_streams
    from rollplex.graph.load import parse_spec
    from rollplex.graph.plan import compile_plan

    text = (SPECS / "tiny_cpu.yaml").read_text()
    plan = compile_plan(parse_spec(text + "sharing: {tail_rows: 8}\n"))
    streams = make_prefix_streams(plan.decisions.sharing, torch.device("cpu"))
    assert streams.tail_rows == 8 and streams.beside([]).tail_rows == 8
    with pytest.raises(SpecError, match=r"sharing\.tail_rows: tail_rows needs decode in this process"):
        parse_spec(text + "sharing: {tail_rows: 8, policy: mps}\n")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_chunks_moving_between_green_partitions_stay_in_order():
    from rollplex.executors.policies import make_prefix_streams
    from rollplex.graph.decisions import Sharing

    streams = make_prefix_streams(Sharing.of("green", "adaptive"), torch.device("cuda"))
    x = torch.ones(1 << 20, device="cuda")

    def job():
        for _ in range(20):
            x.mul_(2).div_(2).add_(1)  # order matters: any reordering changes the sum
            yield
        return float(x[0])

    beside = streams.beside([job()])
    rows = 64
    while not beside.done:
        beside(rows)
        rows = max(rows - 7, 1)
    assert beside.finish() == [21.0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_what_is_left_after_decode_runs_on_the_callers_stream_after_the_chunk_in_flight():
    from rollplex.executors.policies import make_prefix_streams
    from rollplex.graph.decisions import Sharing

    streams = make_prefix_streams(Sharing.of("green", 66), torch.device("cuda"))
    x, seen = torch.ones(1 << 22, device="cuda"), []

    def job():
        for _ in range(6):
            seen.append(torch.cuda.current_stream())
            x.mul_(3).div_(3).add_(1)  # order matters: any reordering changes the value
            yield
        return float(x[0])

    beside = streams.beside([job()])
    beside(64)  # one chunk beside "decode", on the partition
    assert beside.finish() == [7.0]
    caller = torch.cuda.current_stream()
    assert seen[0] == streams.stream and seen[0] != caller and all(s == caller for s in seen[1:])
