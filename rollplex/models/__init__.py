"""Qwen2.5-VL for rollplex: configuration (pure Python) and the torch model (import it from its modules)."""
