"""What the task is, as a spec names it: the tokenizer, rollout's sampling and the rewards (`engines.build_engines`
puts them beside the models)."""

from __future__ import annotations

from rollplex.data.rewards import RewardTerms, reward_terms
from rollplex.data.tokenizer import CharTokenizer, HFTokenizer, Tokenizer
from rollplex.graph.load import LoadedSpec
from rollplex.graph.spec_files import model_dir
from rollplex.models.sampling import SamplingParams


def make_tokenizer(loaded: LoadedSpec) -> Tokenizer:
    """The checkpoint's own tokenizer when it has one; otherwise the character tokenizer on the model's ids."""
    directory = model_dir(loaded)
    if (directory / "tokenizer.json").is_file():
        return HFTokenizer.from_dir(directory)
    t = loaded.model.tokens
    return CharTokenizer.for_model(t.eos, t.vision_start, t.vision_end, t.image, t.video)


def sampling_params(loaded: LoadedSpec) -> SamplingParams:
    """Rollout's sampling: the algorithm's temperature and top-p, up to the workload's response tokens or a stop id
    of the model."""
    a = loaded.spec.algorithm
    return SamplingParams(
        temperature=a.temperature,
        top_p=a.top_p,
        max_tokens=loaded.spec.workload.response_tokens,
        stop_token_ids=loaded.model.tokens.stop_ids,
    )


def make_reward(loaded: LoadedSpec) -> RewardTerms:
    """The spec's rewards, each with its weight; a `module:function` name is imported."""
    return reward_terms([(r.name, r.weight) for r in loaded.spec.algorithm.rewards])
