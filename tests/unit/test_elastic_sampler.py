"""ElasticSampler: every sample of an epoch consumed exactly once by the committed steps.

The property tests drive a job's committed-step timeline through random membership changes,
discarded steps (the step count stays), rollbacks (it goes back, the rolled-back steps are
recomputed) and heals (a newcomer takes the step its peers hold), and check, from the shares
each member computed at each committed step, that every sample of every finished epoch was
consumed exactly once and that no sample of the epoch in progress was consumed twice.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stalwart.checkpoint import Checkpointer
from stalwart.elastic.sampler import ElasticSampler
from stalwart.errors import ConfigError, StateMismatchError

pytestmark = pytest.mark.timeout(120)


def _consumed(sampler: ElasticSampler, step: int, size: int) -> list[int]:
    """The ids every member of a ``size``-member epoch computes on at ``step``, checked."""
    shares = [sampler.share(step, r, size) for r in range(size)]
    ids = [int(i) for s in shares for i in s.indices]
    assert ids == [int(i) for i in sampler.global_batch(step)], "shares tile the global batch"
    lengths = [len(s.indices) for s in shares]
    assert max(lengths) - min(lengths) <= 1, "shares differ by at most one sample"
    return ids


# A timeline event: ("commit", size) | ("discard", size) | ("rollback", k) | ("heal", size)
_event = st.one_of(
    st.tuples(st.just("commit"), st.integers(1, 5)),
    st.tuples(st.just("discard"), st.integers(1, 5)),
    st.tuples(st.just("rollback"), st.integers(1, 4)),
    st.tuples(st.just("heal"), st.integers(1, 5)),
)


@settings(max_examples=200, deadline=None)
@given(
    num_samples=st.integers(1, 60),
    batch_size=st.integers(1, 17),
    seed=st.integers(0, 2**32),
    events=st.lists(_event, min_size=1, max_size=80),
)
def test_every_sample_is_consumed_once_through_faults(
    num_samples: int, batch_size: int, seed: int, events: list[tuple[str, int]]
) -> None:
    sampler = ElasticSampler(num_samples, batch_size, seed=seed)
    committed: list[list[int]] = []  # ids consumed by committed step i (index = step)
    size = 1
    for kind, arg in events:
        step = len(committed)  # job.step: the committed step count
        if kind in ("commit", "discard", "heal"):
            size = arg  # the membership of the epoch the step runs in
        if kind == "commit":
            committed.append(_consumed(sampler, step, size))
        elif kind == "discard":
            _consumed(sampler, step, size)  # computed, then thrown away: nothing recorded
        elif kind == "rollback":
            del committed[max(0, step - arg) :]  # back to the agreed step; recomputed later
        # "heal": a newcomer receives the committed step; it reads the same next batch
    per_epoch = sampler.steps_per_epoch
    for first in range(0, len(committed), per_epoch):
        counts = Counter(i for ids in committed[first : first + per_epoch] for i in ids)
        assert all(c == 1 for c in counts.values()), "no sample twice within an epoch"
        if first + per_epoch <= len(committed):  # a finished epoch: every sample once
            assert sorted(counts) == list(range(num_samples))
        pos = sampler.position(len(committed))
        assert pos.cursor == (len(committed) % per_epoch) * batch_size


def test_epoch_boundary_keeps_the_partial_batch_and_reshuffles() -> None:
    sampler = ElasticSampler(10, 4, seed=3)
    assert sampler.steps_per_epoch == 3
    sizes = [len(sampler.global_batch(s)) for s in range(6)]
    assert sizes == [4, 4, 2, 4, 4, 2], "the rest of the epoch is its last batch, not dropped"
    first = np.concatenate([sampler.global_batch(s) for s in range(3)])
    second = np.concatenate([sampler.global_batch(s) for s in range(3, 6)])
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist(), "each epoch has its own permutation"
    assert sampler.position(3) == sampler.position(3).__class__(3, 1, 0)
    assert sampler.position(2).cursor == 8


def test_permutation_is_pinned_across_versions_and_instances() -> None:
    # The format: a resumed run on another machine (another numpy) continues the same epoch.
    sampler = ElasticSampler(10, 4, seed=3)
    assert sampler.permutation(0).tolist() == [1, 7, 5, 3, 9, 6, 8, 0, 2, 4]
    assert sampler.permutation(1).tolist() == [4, 2, 0, 9, 3, 8, 5, 6, 1, 7]
    big = ElasticSampler(100_000, 512, seed=11)
    assert np.array_equal(big.permutation(5), ElasticSampler(100_000, 512, seed=11).permutation(5))
    assert not np.array_equal(
        big.permutation(5), ElasticSampler(100_000, 512, seed=12).permutation(5)
    )
    assert ElasticSampler(5, 2, shuffle=False).global_batch(1).tolist() == [2, 3]
    assert not big.permutation(0).flags.writeable


def test_a_batch_smaller_than_the_membership_leaves_some_members_idle() -> None:
    sampler = ElasticSampler(5, 2, seed=0)
    shares = [sampler.share(0, r, 3) for r in range(3)]
    assert [len(s.indices) for s in shares] == [0, 1, 1]
    assert all(s.loss_scale == 1.5 for s in shares)


def test_loss_scale_makes_the_averaged_gradient_the_global_batch_mean() -> None:
    # The job averages the members' gradients: with uneven shares, summed losses weighted by
    # size / b give exactly the gradient of the global batch's mean loss.
    torch.manual_seed(0)
    x, y = torch.randn(7, 3), torch.randn(7, 1)
    model = torch.nn.Linear(3, 1)
    sampler = ElasticSampler(7, 7, seed=1)

    def grad(loss: torch.Tensor) -> torch.Tensor:
        model.zero_grad()
        loss.backward()
        return model.weight.grad.clone()

    ids = torch.from_numpy(sampler.global_batch(0))
    want = grad(torch.nn.functional.mse_loss(model(x[ids]), y[ids]))
    for size in (2, 3, 4):
        total = torch.zeros_like(want)
        for rank in range(size):
            share = sampler.share(0, rank, size)
            i = torch.from_numpy(share.indices)
            loss = torch.nn.functional.mse_loss(model(x[i]), y[i], reduction="sum")
            total += grad(loss * share.loss_scale)
        torch.testing.assert_close(total / size, want)


def test_state_rides_in_a_checkpoint_and_refuses_another_stream(tmp_path: Path) -> None:
    ck = Checkpointer(tmp_path / "ck")
    ck.save(4, {"data": ElasticSampler(100, 8, seed=7), "w": torch.ones(2)})
    same = ElasticSampler(100, 8, seed=7)
    ck.load({"data": same, "w": torch.zeros(2)})
    other = ElasticSampler(100, 16, seed=7)
    with pytest.raises(StateMismatchError, match="batch_size: saved 8, here 16"):
        other.load_state_dict(same.state_dict())
    with pytest.raises(StateMismatchError, match="newer than this stalwart"):
        same.load_state_dict({**same.state_dict(), "format": 99})


@pytest.mark.parametrize(
    ("args", "kwargs"),
    [((0, 4), {}), ((10, 0), {}), ((10, 4), {"seed": -1})],
)
def test_bad_configuration_says_what_to_give(args: tuple[int, int], kwargs: dict) -> None:
    with pytest.raises(ConfigError, match="give at least one sample"):
        ElasticSampler(*args, **kwargs)


def test_bad_rank_or_step_says_what_to_pass() -> None:
    sampler = ElasticSampler(10, 4)
    with pytest.raises(ConfigError, match=r"job\.rank and job\.size"):
        sampler.share(0, 3, 3)
    with pytest.raises(ConfigError, match=r"pass job\.step"):
        sampler.global_batch(-1)
