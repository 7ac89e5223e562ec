"""Qwen2.5-VL for rollplex: configuration (pure Python) and the torch model (import it from its modules).

config.py, inputs.py       ModelConfig (no torch); Prompt / Visual, the input contract
model.py                   Qwen2_5_VL: forward (unsplit), prefix -> Boundary, suffix -> SuffixOut
boundary.py, scores.py     Boundary (state at the first response position); SuffixOut
generate.py, sampling.py   rollout over a shared prompt boundary; SamplingParams, top-p
checkpoint.py              HF safetensors load / save (single file or sharded), load_pretrained
vision.py, decoder.py      the two towers; layers.py, rotary.py, positions.py, vision_layout.py their parts
attention.py, cache.py     causal and shared-prefix (log-sum-exp merged) attention; decode KV cache
"""
