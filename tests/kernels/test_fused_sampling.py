"""The fused sampler: greedy is the argmax, draws follow softmax(logits / T), log-probs are at the sampling
temperature (1 when greedy), and each token lands at its slot and column with the slot's stop flag."""

from __future__ import annotations

import pytest
import torch
from kernels_testkit import DEVICE

from rollplex.kernels.sampling import MAX_STOP_IDS, fused_sample


def draw(
    logits, slots, *, column=0, seed=0, temperature=1.0, stop=(), num_slots=None, max_tokens=3, max_lens=None,
    batch=None,
):  # fmt: skip
    """batch (rows, slots): each slot's row in a whole batch of that many slots (a data-parallel share)."""
    num_slots = num_slots or len(slots)
    tokens = torch.zeros(num_slots, max_tokens, dtype=torch.long, device=DEVICE)
    logprobs = torch.zeros(num_slots, max_tokens, device=DEVICE)
    last, done = (
        torch.zeros(num_slots, dtype=torch.long, device=DEVICE),
        torch.zeros(num_slots, dtype=torch.int8, device=DEVICE),
    )
    stop_ids = torch.full((MAX_STOP_IDS,), -1, dtype=torch.long)
    stop_ids[: len(stop)] = torch.tensor(stop, dtype=torch.long)
    max_lens = torch.full((num_slots,), max_tokens) if max_lens is None else torch.tensor(max_lens)
    scalar = lambda v, dtype: torch.tensor([v], dtype=dtype, device=DEVICE)  # noqa: E731
    keyed = () if batch is None else (torch.tensor(batch[0], device=DEVICE), scalar(batch[1], torch.long))
    fused_sample(
        logits.to(DEVICE), torch.as_tensor(slots, device=DEVICE), scalar(column, torch.long), scalar(seed, torch.long),
        scalar(temperature, torch.float32), stop_ids.to(DEVICE), tokens, logprobs, last, done,
        max_lens.to(DEVICE), *keyed, block=64,
    )  # fmt: skip
    return tokens.cpu(), logprobs.cpu(), last.cpu(), done.cpu()


def test_greedy_takes_the_argmax_and_records_its_temperature_one_logprob_at_slot_and_column():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0)) * 3
    slots = [4, 1, 2]
    tokens, logprobs, last, done = draw(
        logits, slots, column=2, temperature=0.0, num_slots=6, max_tokens=4, stop=(int(logits[1].argmax()),)
    )
    expected = logits.argmax(-1)
    assert tokens[slots, 2].tolist() == expected.tolist() and last[slots].tolist() == expected.tolist()
    torch.testing.assert_close(logprobs[slots, 2], logits.log_softmax(-1).gather(-1, expected[:, None])[:, 0])
    assert done.tolist() == [0, 1, 0, 0, 0, 0]
    assert not tokens[:, :2].any() and not tokens[[0, 3, 5]].any()


@pytest.mark.slow
def test_draws_follow_softmax_of_logits_over_temperature_and_a_seed_repeats_them():
    rows = 400  # the interpreter runs one program per row; 3 sigma of a frequency is at most 0.075
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0, 0.5] + [-30.0] * 3]).expand(rows, -1).contiguous()
    tokens, *_ = draw(logits, list(range(rows)), temperature=2.0, seed=7)
    freq = torch.bincount(tokens[:, 0], minlength=8)[:5].float() / rows
    torch.testing.assert_close(freq, (logits[0, :5] / 2.0).softmax(-1), atol=0.075, rtol=0)
    assert (tokens[:, 0] < 5).all()
    again, *_ = draw(logits[:16], list(range(16)), temperature=2.0, seed=7)  # rows drawn alike in a smaller batch
    other, *_ = draw(logits[:16], list(range(16)), temperature=2.0, seed=8)
    assert torch.equal(tokens[:16], again) and not torch.equal(tokens[:16], other)


def test_a_draws_logprob_is_at_the_sampling_temperature():
    logits = torch.randn(4, 200, generator=torch.Generator().manual_seed(1)) * 3
    tokens, logprobs, *_ = draw(logits, [0, 1, 2, 3], temperature=0.5, seed=3)
    expected = (logits / 0.5).log_softmax(-1).gather(-1, tokens[:, :1])[:, 0]
    torch.testing.assert_close(logprobs[:, 0], expected)


def test_a_sequence_is_done_once_it_reaches_its_length_budget():
    logits = torch.zeros(3, 50)
    *_, done = draw(logits, [0, 1, 2], column=1, max_lens=[2, 3, 1])  # token 1 is the 2nd token
    assert done.tolist() == [1, 0, 1]


def test_a_share_of_a_batch_draws_for_each_row_what_the_whole_batch_draws_for_it():
    """A data-parallel rank holds rows 4..7 and 1 of a batch of 8 (9 slots with the spare) in slots 0..4 of its own
    6: keyed by their rows in the whole batch, its draws are the whole batch's for those rows."""
    logits = torch.randn(8, 200, generator=torch.Generator().manual_seed(2))
    whole, whole_lp, *_ = draw(logits, list(range(8)), column=1, seed=11, num_slots=9)
    rows = [4, 5, 6, 7, 1]
    share, share_lp, *_ = draw(logits[rows], list(range(5)), column=1, seed=11, num_slots=6, batch=([*rows, 8], 9))
    assert torch.equal(share[:5, 1], whole[rows, 1])
    torch.testing.assert_close(share_lp[:5, 1], whole_lp[rows, 1])
    unkeyed, *_ = draw(logits[rows], list(range(5)), column=1, seed=11, num_slots=6)  # keyed by its own slots
    assert not torch.equal(unkeyed[:5, 1], whole[rows, 1])
