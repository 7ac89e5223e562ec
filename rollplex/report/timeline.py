"""The bench's timeline PNG: one iteration of each schedule, one lane per stream of work (rollout decode,
prefix work, trainer), ops as bars on a shared time axis."""

from __future__ import annotations

from pathlib import Path

LANES = ("rollout", "prefix stream", "trainer")
COLORS = {"rollout": "#c44e52", "prefix stream": "#55a868", "trainer": "#4c72b0"}


def plot_timeline(timelines: dict[str, list[tuple[str, str, float, float]]], path: str | Path, title: str) -> None:
    """timelines: schedule name -> spans (lane, label, start s, end s) of one iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.2 + 1.1 * len(timelines) * len(LANES) / 2),
                             sharex=True, squeeze=False)  # fmt: skip
    for ax, (name, spans) in zip(axes[:, 0], timelines.items(), strict=True):
        for row, lane in enumerate(LANES):
            bars = [(start, end - start) for span_lane, _, start, end in spans if span_lane == lane]
            ax.broken_barh(bars, (row - 0.35, 0.7), color=COLORS[lane], edgecolor="white", linewidth=0.3)
        end = max((s[3] for s in spans), default=0.0)
        ax.set_yticks(range(len(LANES)), LANES)
        ax.set_ylim(-0.6, len(LANES) - 0.4)
        ax.invert_yaxis()
        ax.set_title(f"{name}: {end:.3f} s", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("seconds from the start of the iteration")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
