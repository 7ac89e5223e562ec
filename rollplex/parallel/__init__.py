"""Tensor parallelism: Megatron-layout training shards, and the rollout replica bound over them (issue 6)."""
