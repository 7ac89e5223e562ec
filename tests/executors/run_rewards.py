"""A reward for runs in subprocesses (torchrun): importable as `run_rewards:char_share` with this folder on
PYTHONPATH. It differs between random responses, so advantages (and gradients) are not zero."""


def char_share(text: str, example) -> float:
    return sum(c in "aeiou0123456789" for c in text) / max(len(text), 1)
