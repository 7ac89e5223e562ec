"""The GPU rollout engine: prompt prefill once per prompt, then decode of N samples per prompt with a response
KV cache, fused kernels and CUDA-graph-captured steps for a set of batch sizes, the batch shrinking as
sequences finish.

- `batch.py`: which sequences are live and how they map onto the rows of a captured batch (host side).
- `step.py`: one decode step's computation over static buffers (capturable).
- `graphs.py`: a captured graph per batch size on CUDA; plain calls elsewhere.
- `engine.py`: `RolloutEngine.generate`, the loop that samples, retires and compacts.

The reference implementation of the same rollout is `rollplex.models.generate` (plain torch, any device).
"""
