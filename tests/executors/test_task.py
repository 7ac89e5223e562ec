"""What a spec says the task is: the tokenizer (without a checkpoint's own, the characters on the model's ids),
rollout's sampling and the weighted rewards."""

from __future__ import annotations

from rollplex.data.tokenizer import CharTokenizer
from rollplex.executors.task import make_reward, make_tokenizer, sampling_params
from rollplex.graph.load import parse_spec

RANDOM = """
model: tiny
cluster: {nodes: 1, gpus_per_node: 1, hbm_gib: 16, host_gib: 8}
workload: {prompts_per_step: 2, group_size: 2, prompt_tokens: 64, response_tokens: 7, visual_tokens: 8}
algorithm: {temperature: 0.7, top_p: 0.9, rewards: [{name: answer_format, weight: 0.5}, {name: accuracy}]}
run: {device: cpu, dtype: float32}
"""


def test_a_spec_without_a_tokenizer_file_reads_characters_on_the_models_ids():
    spec = parse_spec(RANDOM)
    tokenizer = make_tokenizer(spec)
    assert isinstance(tokenizer, CharTokenizer)
    assert tokenizer.decode(tokenizer.encode("a b?")) == "a b?"


def test_sampling_follows_the_algorithm_and_the_workload_and_stops_at_the_models_ids():
    spec = parse_spec(RANDOM)
    params = sampling_params(spec)
    assert (params.temperature, params.top_p, params.max_tokens) == (0.7, 0.9, 7)
    assert tuple(params.stop_token_ids) == tuple(spec.model.tokens.stop_ids) and params.stop_token_ids


def test_rewards_keep_their_names_and_weights_in_the_specs_order():
    terms = make_reward(parse_spec(RANDOM))
    assert (terms.names, terms.weights) == (("answer_format", "accuracy"), (0.5, 1.0))
    assert len(terms.fns) == 2 and terms.fns[0] is not terms.fns[1]
