"""``tiling_problems``: shards that overlap are found by every path (pairwise for a few boxes,
numpy's grid for many), and exact tilings pass, against a brute-force check of every pair."""

from __future__ import annotations

import itertools
import random
from types import SimpleNamespace

import pytest

from stalwart.checkpoint.durable.integrity import tiling_problems


def _entry(shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> object:
    shards = []
    for offsets, sizes in boxes:
        n = 1
        for z in sizes:
            n *= z
        shards.append(SimpleNamespace(offsets=offsets, sizes=sizes, nbytes=4 * n))
    return SimpleNamespace(dtype="float32", shape=shape, shards=shards)


def _grid(rng: random.Random, shape: tuple[int, ...]) -> list[tuple[tuple[int, ...], ...]]:
    """An exact tiling: each dimension cut at random points, one box per cell."""
    cuts = []
    for d in shape:
        inner = sorted(rng.sample(range(1, d), rng.randint(0, min(d - 1, 5))))
        cuts.append([0, *inner, d])
    boxes: list[tuple[tuple[int, ...], ...]] = [((), ())]
    for c in cuts:
        boxes = [((*o, a), (*z, b - a)) for o, z in boxes for a, b in itertools.pairwise(c)]
    return boxes


def _overlaps(boxes: list[tuple[tuple[int, ...], ...]]) -> bool:
    return any(
        all(max(oa, ob) < min(oa + za, ob + zb) for oa, za, ob, zb in zip(*a, *b, strict=True))
        for k, a in enumerate(boxes)
        for b in boxes[k + 1 :]
    )


@pytest.mark.parametrize("seed", range(4))
def test_overlaps_are_found_and_exact_tilings_pass_with_few_or_many_shards(seed: int) -> None:
    rng = random.Random(seed)
    sizes_seen: set[bool] = set()
    for _ in range(150):
        shape = tuple(rng.randint(2, 12) for _ in range(rng.randint(1, 3)))
        boxes = _grid(rng, shape)
        sizes_seen.add(len(boxes) > 16)
        assert tiling_problems("w", _entry(shape, boxes)) == []
        if len(boxes) < 2:
            continue
        # Move one box so that it overlaps another but the element count stays the same:
        # the shards still "cover" the tensor by count, yet leave a gap.
        moved = list(boxes)
        k = rng.randrange(len(moved))
        o, z = moved[k]
        j = rng.randrange(len(o))
        shifted = (
            *o[:j],
            max(0, o[j] - 1) if o[j] else min(shape[j] - z[j], o[j] + 1),
            *o[j + 1 :],
        )
        moved[k] = (shifted, z)
        problems = tiling_problems("w", _entry(shape, moved))
        assert bool(problems) == _overlaps(moved), (shape, moved, problems)
        if problems:
            assert "overlap" in problems[0]
    assert sizes_seen == {False, True}  # both the pairwise and the grid path ran
