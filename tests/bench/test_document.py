"""`document.beyond_ideal`: a bench whose speedup exceeds Eq. 1's ideal is noted with what it owes the excess to."""

from rollplex.bench.document import beyond_ideal


def test_a_speedup_above_eq_1s_ideal_is_noted_with_what_it_owes_its_excess_to():
    def result(speedup: float, after: float) -> dict:
        return {"speedup": speedup, "ideal_speedup": 1.05, "step_balance_s": {"after_rollout_longer": after}}

    assert beyond_ideal(result(1.05, 0.0)) is None and beyond_ideal(result(1.07, -0.1)) is None  # within 2 %
    note = beyond_ideal(result(1.935, -3.25))
    assert (
        note.startswith("the speedup 1.935x is above Eq. 1's ideal 1.050x")
        and "took 3.25 s less under rollplex than under serial" in note
    )
