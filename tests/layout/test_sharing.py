"""The layout algebra of weight sharing, checked on its own terms for TP up to 8 and against the paper."""

from itertools import product

import pytest

from rollplex.layout.shapes import Sharding, family_params_per_rank, llm_families
from rollplex.layout.sharing import (
    Case,
    Segment,
    classify,
    merge,
    per_rank_components,
    qkv_megatron,
    qkv_vllm,
    sharing_report,
)
from rollplex.models.config import TextConfig, load_model_config

TEXT = TextConfig(
    vocab_size=1024,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=2,
    num_attention_heads=32,
    num_key_value_heads=8,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    mrope_section=(2, 3, 3),
    tie_word_embeddings=False,
    max_position_embeddings=64,
)
PAIRS = [(t, r) for t in (1, 2, 4, 8) for r in (1, 2, 4, 8) if t % r == 0]


def rows(segments):
    return [(s.component, i) for s in segments for i in range(s.start, s.stop)]


def test_merge_joins_only_continuing_runs_of_one_component():
    segs = [Segment("q", 0, 4), Segment("q", 4, 8), Segment("k", 0, 2), Segment("q", 8, 9)]
    assert merge(segs) == (Segment("q", 0, 8), Segment("k", 0, 2), Segment("q", 8, 9))


@pytest.mark.parametrize(("layout", "tp"), list(product([qkv_megatron, qkv_vllm], [1, 2, 4, 8])))
def test_each_qkv_layout_covers_every_row_exactly_once_over_the_ranks(layout, tp):
    covered = sorted(r for rank in range(tp) for r in rows(layout(TEXT, tp, rank)))
    d = TEXT.head_dim
    expected = sorted([("q", i) for i in range(32 * d)] + [(c, i) for c in "kv" for i in range(8 * d)])
    assert covered == expected


@pytest.mark.parametrize(("t", "r"), PAIRS)
def test_a_rollout_shard_holds_exactly_the_rows_of_its_q_training_shards(t, r):
    q = t // r
    for k in range(r):
        bound = [x for j in range(q) for x in rows(qkv_megatron(TEXT, t, k * q + j))]
        assert sorted(bound) == sorted(rows(qkv_vllm(TEXT, r, k)))  # same rows: nested sharding
        gate_up = {"gate": 1536, "up": 1536}
        bound = [x for j in range(q) for x in rows(per_rank_components(gate_up, t, k * q + j))]
        assert sorted(bound) == sorted(rows(per_rank_components(gate_up, r, k)))


@pytest.mark.parametrize(("t", "r"), PAIRS)
def test_cases_follow_sharding_axis_and_head_order(t, r):
    by_name = {f.name: classify(f, TEXT, t, r).case for f in llm_families(TEXT)}
    assert by_name["norms"] is Case.SHARED and by_name["embed_tokens"] is Case.SHARED
    assert by_name["gate_up"] is Case.SHARED and by_name["lm_head"] is Case.SHARED
    row = Case.SHARED if t == r else Case.TRANSPOSED
    assert by_name["o_proj"] is row and by_name["down_proj"] is row
    one_group_per_rollout_rank = TEXT.num_key_value_heads // r == 1
    assert (by_name["qkv.weight"] is Case.SHARED) == one_group_per_rollout_rank


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    t = load_model_config("qwen2_5_vl_3b").text  # 16 heads, 2 KV heads
    d = t.head_dim
    assert qkv_vllm(t, 4, 3) == (Segment("q", 12 * d, 16 * d), Segment("k", d, 2 * d), Segment("v", d, 2 * d))
    qkv = next(f for f in llm_families(t) if f.name == "qkv.weight")
    assert family_params_per_rank(qkv, t, 4) == (4 + 2) * d * t.hidden_size * t.num_hidden_layers


def test_qwen2_5_vl_32b_tp8_to_tp4_reproduces_the_paper():
    report = sharing_report(load_model_config("qwen2_5_vl_32b").text, 8, 4)
    params = [report.case_params[c] / 1e9 for c in (1, 2, 3)]
    assert params == pytest.approx([19.7, 10.7, 2.4], abs=0.1)
    assert [report.percent(c) for c in (1, 2, 3)] == pytest.approx([60.0, 32.8, 7.2], abs=0.3)
    assert report.case3_buffer_bytes_per_gpu / 2**30 == pytest.approx(1.1, abs=0.1)


@pytest.mark.parametrize(("t", "r"), PAIRS)
def test_read_in_place_the_shared_storage_is_the_whole_rollout_shard_and_nothing_is_copied(t, r):
    report = sharing_report(TEXT, t, r, in_place=True)
    at = lambda f, tp: family_params_per_rank(f, TEXT, tp) * 2  # noqa: E731
    assert report.shared_bytes_per_gpu == sum(at(e.family, r) for e in report.entries)
    assert report.case3_buffer_bytes_per_gpu == 0


@pytest.mark.parametrize(("t", "r"), PAIRS)
def test_shared_storage_is_the_rollout_shard_plus_case3_training_shards(t, r):
    report = sharing_report(TEXT, t, r)
    at = lambda f, tp: family_params_per_rank(f, TEXT, tp) * 2  # noqa: E731
    case3 = [e.family for e in report.entries if e.case is Case.COPIED]
    rest = [e.family for e in report.entries if e.case is not Case.COPIED]
    assert report.shared_bytes_per_gpu == sum(at(f, r) for f in rest) + sum(at(f, t) for f in case3)
    assert report.case3_buffer_bytes_per_gpu == sum(at(f, r) for f in case3)
    assert report.total_params == sum(f.params for f in llm_families(TEXT))
    assert all(e.family.sharding is not Sharding.ROW or e.case is not Case.COPIED for e in report.entries)


@pytest.mark.parametrize(("t", "r"), PAIRS)
def test_publishing_moves_the_peers_regions_of_every_sharded_tensor_and_nothing_at_matched_degrees(t, r):
    report = sharing_report(TEXT, t, r)
    at = lambda f, tp: family_params_per_rank(f, TEXT, tp) * 2  # noqa: E731
    sharded = [e.family for e in report.entries if e.family.sharding is not Sharding.REPLICATED]
    assert report.exchange_bytes_per_gpu == sum(at(f, r) * (t // r - 1) // (t // r) for f in sharded)
    assert (report.exchange_bytes_per_gpu == 0) == (t == r)


def test_the_3b_exchange_at_tp_2_to_1_is_what_the_h200_pair_moved():
    report = sharing_report(load_model_config("qwen2_5_vl_3b").text, 2, 1, in_place=True)
    # bench/results/tp_sharing_3b_h200x2.json: a 6,171,578,368-byte storage, half of it from the peer
    assert report.exchange_bytes_per_gpu == pytest.approx(6_171_578_368 / 2, rel=1e-3)
