"""Synthetic scenes: coloured circles and squares moving in straight lines and bouncing off the frame edges.

Positions live in the unit square (x right, y down); an object's radius is a fraction of the shorter frame
side, so a wall is hit when the object's edge, not its centre, reaches it. Motion is simulated frame by
frame (position += velocity, reflected at the walls), so speeds are constant and bounces are counted
exactly. Everything here is a pure function of its arguments; questions are asked in `synthetic`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (40, 80, 230),
    "yellow": (235, 215, 40),
    "purple": (150, 60, 190),
    "orange": (245, 140, 30),
    "cyan": (40, 205, 215),
    "white": (245, 245, 245),
}
SPEEDS = np.linspace(0.01, 0.08, 8)  # per frame, in frame widths/heights: distinct, so "fastest" is unique


class Shape(StrEnum):
    CIRCLE = "circle"
    SQUARE = "square"


@dataclass(frozen=True)
class Thing:
    """One moving object. Colours are unique within a scene, so a colour names an object."""

    shape: Shape
    colour: str
    radius: float  # fraction of the shorter frame side
    start: tuple[float, float]
    velocity: tuple[float, float]

    @property
    def speed(self) -> float:
        return float(np.hypot(*self.velocity))


@dataclass(frozen=True)
class Scene:
    things: tuple[Thing, ...]
    background: tuple[int, int, int]


def sample_scene(
    rng: np.random.Generator,
    num_things: tuple[int, int] = (3, 6),
    palette: int = len(COLOURS),
    radius: tuple[float, float] = (0.06, 0.12),
) -> Scene:
    """A random scene: distinct colours (among the first `palette` of COLOURS), distinct speeds, random shapes,
    directions and starts, radii in `radius` (fractions of the shorter frame side)."""
    n = int(rng.integers(num_things[0], num_things[1] + 1))
    colours = rng.choice(list(COLOURS)[:palette], size=n, replace=False)
    speeds = rng.choice(SPEEDS, size=n, replace=False)
    things = []
    for colour, speed in zip(colours, speeds, strict=True):
        angle = rng.uniform(0, 2 * np.pi)
        things.append(
            Thing(
                shape=Shape(rng.choice([s.value for s in Shape])),
                colour=str(colour),
                radius=float(rng.uniform(*radius)),
                start=(float(rng.uniform(0.2, 0.8)), float(rng.uniform(0.2, 0.8))),
                velocity=(float(speed * np.cos(angle)), float(speed * np.sin(angle))),
            )
        )
    background = tuple(int(c) for c in rng.integers(20, 70, size=3))
    return Scene(things=tuple(things), background=background)


def _margins(thing: Thing, height: int, width: int) -> np.ndarray:
    """Half-extent of the object in unit-square coordinates, (x, y)."""
    side = min(height, width)
    return np.array([thing.radius * side / width, thing.radius * side / height])


def trajectories(scene: Scene, num_frames: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Centres [T, n, 2] (x, y in the unit square) and the number of wall bounces [n] of each object."""
    positions = np.zeros((num_frames, len(scene.things), 2))
    bounces = np.zeros(len(scene.things), dtype=np.int64)
    for i, thing in enumerate(scene.things):
        low = _margins(thing, height, width)
        high = 1 - low
        p = np.clip(np.array(thing.start), low, high)
        v = np.array(thing.velocity)
        for t in range(num_frames):
            positions[t, i] = p
            if t + 1 == num_frames:
                break  # count only the bounces between the first and the last frame
            p = p + v
            hit_low, hit_high = p < low, p > high
            p = np.where(hit_low, 2 * low - p, np.where(hit_high, 2 * high - p, p))
            v = np.where(hit_low | hit_high, -v, v)
            bounces[i] += int((hit_low | hit_high).sum())
    return positions, bounces


def render(scene: Scene, num_frames: int, height: int, width: int) -> np.ndarray:
    """[T, H, W, 3] uint8 frames: a shaded background and the objects drawn in order (later on top)."""
    shade = np.linspace(0, 30, height)[:, None, None]
    background = np.clip(np.array(scene.background)[None, None, :] + shade, 0, 255).astype(np.uint8)
    frames = np.broadcast_to(background, (num_frames, height, width, 3)).copy()
    positions, _ = trajectories(scene, num_frames, height, width)
    side = min(height, width)
    for t in range(num_frames):
        for thing, (x, y) in zip(scene.things, positions[t], strict=True):
            _draw(frames[t], thing, x * width, y * height, thing.radius * side)
    return frames


def _draw(frame: np.ndarray, thing: Thing, cx: float, cy: float, r: float) -> None:
    """Paints one object into frame [H, W, 3] in place, touching only its bounding box."""
    height, width = frame.shape[:2]
    y0, y1 = max(0, int(cy - r)), min(height, int(np.ceil(cy + r)) + 1)
    x0, x1 = max(0, int(cx - r)), min(width, int(np.ceil(cx + r)) + 1)
    ys = np.arange(y0, y1)[:, None] + 0.5
    xs = np.arange(x0, x1)[None, :] + 0.5
    if thing.shape is Shape.CIRCLE:
        mask = (xs - cx) ** 2 + (ys - cy) ** 2 <= r * r
    else:
        mask = (np.abs(xs - cx) <= r) & (np.abs(ys - cy) <= r)
    frame[y0:y1, x0:x1][mask] = COLOURS[thing.colour]
