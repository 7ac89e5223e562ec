"""The spec variants a bench runs and the labels of their policies."""

import pytest

from rollplex.bench.variants import parse_policy, policy_label
from rollplex.graph.spec import SharingSpec


def test_the_policy_label_names_the_partition_or_the_trainer_percentage():
    class Spec:  # policy_label reads only `sharing`
        def __init__(self, **sharing) -> None:
            self.sharing = SharingSpec(**sharing)

    assert policy_label(Spec(policy="green", prefix_sms=66)) == "green:66"
    assert policy_label(Spec(policy="green", prefix_sms="adaptive")) == "green:adaptive"
    assert policy_label(Spec(policy="mps", mps_trainer_percent=50)) == "mps:50"
    assert policy_label(Spec(policy="mps")) == "mps"


@pytest.mark.parametrize("text", ["green:0", "streams:4", "mps:101", "fast", "green:x"])
def test_a_policy_outside_the_named_ones_or_their_ranges_is_refused_with_the_usage(text):
    with pytest.raises(ValueError, match="use inline, streams, green"):
        parse_policy(text)
