"""Plot reward (and its spread) per step from a run's metrics.jsonl: `python bench/plot_metrics.py IN OUT.png`."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

with open(sys.argv[1]) as f:
    records = [json.loads(line) for line in f]
steps = [r["step"] for r in records]
mean = [r["reward_mean"] for r in records]
std = [r["reward_std"] for r in records]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, mean, label="reward_mean")
ax.fill_between(
    steps,
    [m - s for m, s in zip(mean, std, strict=True)],
    [m + s for m, s in zip(mean, std, strict=True)],
    alpha=0.2,
    label="± std",
)
ax.set_xlabel("step")
ax.set_ylabel("reward")
ax.set_title("tiny Qwen2.5-VL, GRPO from random weights (CPU)")
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[2], dpi=120)
