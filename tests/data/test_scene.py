import math

import numpy as np

from rollplex.data.scene import COLOURS, Scene, Shape, Thing, render, sample_scene, trajectories


def folded(p0: float, v: float, t: int, lo: float, hi: float) -> tuple[float, int]:
    """Closed form of straight motion between two mirrors: the unfolded line folded into [lo, hi], and
    the number of mirrors it crossed."""
    span = hi - lo
    u = p0 - lo + v * t
    k = math.floor(u / span)
    r = u - k * span
    return lo + (r if k % 2 == 0 else span - r), abs(k)


def test_trajectories_and_bounces_equal_the_closed_form_of_reflected_motion():
    rng = np.random.default_rng(0)
    for height, width in [(56, 84), (252, 364), (100, 100)]:
        scene = sample_scene(rng)
        num_frames = 60
        positions, bounces = trajectories(scene, num_frames, height, width)
        side = min(height, width)
        for i, thing in enumerate(scene.things):
            margins = (thing.radius * side / width, thing.radius * side / height)
            total = 0
            for axis in range(2):
                lo, hi = margins[axis], 1 - margins[axis]
                for t in range(num_frames):
                    expected, crossed = folded(thing.start[axis], thing.velocity[axis], t, lo, hi)
                    assert math.isclose(positions[t, i, axis], expected, abs_tol=1e-9)
                total += crossed
            assert bounces[i] == total


def test_scenes_have_distinct_colours_and_distinct_speeds():
    rng = np.random.default_rng(1)
    for _ in range(50):
        scene = sample_scene(rng)
        assert 3 <= len(scene.things) <= 6
        assert len({t.colour for t in scene.things}) == len(scene.things)
        assert len({round(t.speed, 9) for t in scene.things}) == len(scene.things)


def test_a_rendered_object_covers_its_area_in_its_colour():
    for shape, area in [(Shape.CIRCLE, math.pi * 20**2), (Shape.SQUARE, 40**2)]:
        thing = Thing(shape=shape, colour="red", radius=0.1, start=(0.5, 0.5), velocity=(0.0, 0.0))
        frames = render(Scene(things=(thing,), background=(0, 0, 0)), 2, 200, 300)
        painted = (frames[0] == COLOURS["red"]).all(axis=-1)
        assert abs(painted.sum() - area) / area < 0.05
        assert painted[100, 150] and not painted[0, 0]


def test_rendering_is_a_pure_function_of_the_scene():
    scene = sample_scene(np.random.default_rng(2))
    a = render(scene, 5, 56, 84)
    assert a.dtype == np.uint8 and a.shape == (5, 56, 84, 3)
    assert np.array_equal(a, render(scene, 5, 56, 84))
    assert not np.array_equal(a[0], a[-1])  # things move
