"""Plot runs' accuracy and reward per step from their metrics.jsonl (a moving mean over 20 steps), and their
held-out evaluations' accuracy from eval.jsonl where they have one (markers):
`python bench/plot_metrics.py OUT.png LABEL=RUN_DIR [LABEL=RUN_DIR ...]`."""

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

WINDOW = 20


def moving_mean(values: list[float]) -> list[float]:
    return [sum(values[max(0, i - WINDOW + 1) : i + 1]) / len(values[max(0, i - WINDOW + 1) : i + 1])
            for i in range(len(values))]  # fmt: skip


def main(out: str, runs: list[str]) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    for run in runs:
        label, _, directory = run.partition("=")
        records = [json.loads(line) for line in (Path(directory) / "metrics.jsonl").read_text().splitlines()]
        steps = [r["step"] for r in records]
        (line,) = left.plot(steps, moving_mean([r["accuracy"] for r in records]), label=label)
        right.plot(steps, moving_mean([r["reward_mean"] for r in records]), label=label)
        held_out = Path(directory) / "eval.jsonl"
        if held_out.is_file() and held_out.stat().st_size:
            evals = [json.loads(line) for line in held_out.read_text().splitlines()]
            left.plot([e["step"] for e in evals], [e["accuracy"] for e in evals], marker="o", markersize=3,
                      linestyle="none", color=line.get_color(), label=f"{label}, held-out prompts")  # fmt: skip
    left.axhline(0.25, color="grey", linestyle=":", linewidth=1, label="chance")
    left.set(xlabel="step", ylabel="accuracy", ylim=(0, 1.3), title="accuracy (moving mean of 20 steps)")
    right.set(xlabel="step", ylabel="reward", title="reward_mean (moving mean of 20 steps)")
    left.legend(loc="upper left", fontsize=7)
    left.set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    right.legend(loc="lower right")
    fig.suptitle("tiny Qwen2.5-VL, GRPO from random weights on the CPU (synthetic:colour@tiny)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
