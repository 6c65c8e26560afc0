"""``ElasticSampler``: each sample of an epoch is consumed exactly once by the committed steps.

The data of an elastic job is a stream of *global* batches, one per committed step, split
among whoever is a member when the step runs::

    sampler = ElasticSampler(len(dataset), batch_size=256, seed=17)
    while job.step < total:
        optimizer.zero_grad()
        share = sampler.share(job.step, job.rank, job.size)   # this member's sample ids
        x, y = collate(dataset[i] for i in share.indices)
        (loss_fn(model(x), y, reduction="sum") * share.loss_scale).backward()
        optimizer.step()

**The cursor is the committed step.** Data epoch ``e`` is a seeded permutation of the sample
ids; it is cut into ``steps_per_epoch = ceil(num_samples / batch_size)`` global batches of
``batch_size`` samples, the last one holding the rest (``num_samples mod batch_size``, never
dropped, never padded). Step ``s`` (the step trained while ``job.step == s``) takes batch
``s mod steps_per_epoch`` of epoch ``s // steps_per_epoch``. So the position in the data,
(epoch, cursor = samples of the epoch consumed by committed steps), is a pure function of the
committed step count and the sampler's identity (seed, ``num_samples``, ``batch_size``).

This is the robust choice, rather than a cursor object advanced by a commit hook: the job's
committed step already survives every path a step can take, and the sampler inherits all of
them for free. A discarded step leaves ``job.step`` unchanged, so the same batch is trained
again; a rollback moves ``job.step`` back, so the rolled-back batches are replayed; a
newcomer healed from a peer receives the peer's step, so it takes the peer's next batch; a
resume from the checkpoint tiers sets the step of the checkpoint
(:mod:`stalwart.elastic.ladder`). A separate cursor would have to be copied, digested, sent
and rolled back in step with ``job.step`` on each of those paths, and any path that missed it
would skip or repeat data silently.

**The split follows the live membership.** The global batch is fixed; member ``rank`` of
``size`` takes the contiguous slice ``[b * rank // size, b * (rank + 1) // size)`` of the
step's ``b`` samples: shares differ by at most one sample, their union is the global batch and
no two overlap, whatever ``size`` is at that step. A member may get no sample (``b < size``).
Because :class:`~stalwart.elastic.Job` averages gradients over members, a member weighs the
*sum* of its per-sample losses by :attr:`Share.loss_scale` (``size / b``), so the committed
update is the gradient of the global batch's mean loss for uneven shares too.

**What rides in the committed state.** :meth:`ElasticSampler.state_dict` holds the identity
of the stream (seed, ``num_samples``, ``batch_size``); put the sampler in the checkpointed tree
(``ckpt.save(step, {"train": state, "data": sampler})``) so that a resume refuses a sampler
built differently, which would break exactly-once. :meth:`ElasticSampler.position` gives the
(epoch, cursor) of a step for logs and reports.

The permutation is an argsort of a counter-based hash (SplitMix64 of seed, epoch and sample
id), not a library RNG stream: it is the same on every member, every platform and every numpy
or torch version, so a resume on another machine continues the same epoch. It costs
``8 * num_samples`` bytes and one sort per epoch (the two newest epochs are cached).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from stalwart.errors import ConfigError, StateMismatchError

__all__ = ["SAMPLER_FORMAT", "ElasticSampler", "SamplerPosition", "Share"]

SAMPLER_FORMAT = 1
"""Version of :meth:`ElasticSampler.state_dict` (1: SplitMix64 permutation, contiguous split)."""

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_CACHED_EPOCHS = 2


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finalizer over a uint64 array (wraps modulo 2**64, by design)."""
    z = x + np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _mix(*words: int) -> int:
    """One 64-bit word from a few integers (seed, epoch), each folded through SplitMix64."""
    acc = 0
    for w in words:
        acc = int(_splitmix64(np.array([(acc ^ w) & _MASK], dtype=np.uint64))[0])
        acc = (acc + _GOLDEN) & _MASK
    return acc


@dataclass(frozen=True)
class SamplerPosition:
    """Where the data stream stands after ``step`` committed steps.

    Attributes:
        step: committed steps.
        epoch: the data epoch the next step reads from.
        cursor: samples of ``epoch`` consumed by the committed steps (0 .. num_samples - 1).
    """

    step: int
    epoch: int
    cursor: int


@dataclass(frozen=True)
class Share:
    """One member's part of one step's global batch.

    Attributes:
        step: the step (committed steps before it).
        epoch: the data epoch of the step's batch.
        rank: the member's rank in the step's membership.
        size: members in the step's membership.
        indices: the member's sample ids (int64; may be empty when the batch is smaller
            than the membership).
        global_size: samples in the step's global batch (``batch_size``, or the rest at the
            end of an epoch).
    """

    step: int
    epoch: int
    rank: int
    size: int
    indices: np.ndarray
    global_size: int

    @property
    def loss_scale(self) -> float:
        """Weight of the *sum* of this member's per-sample losses: ``size / global_size``.

        The job averages gradients over the ``size`` members, so every member's weighted sum
        adds up to the global batch's mean loss, whatever the shares' sizes.
        """
        return self.size / self.global_size


class ElasticSampler:
    """The global batches of an elastic job, and each member's share of them.

    Args:
        num_samples: samples in the dataset (one data epoch).
        batch_size: samples per global batch, the same at every membership size.
        seed: the permutation's seed; the same on every member.
        shuffle: False keeps ids in order within every epoch (for tests and evaluation).

    Raises:
        ConfigError: ``num_samples`` or ``batch_size`` below 1, or a seed that is negative.
    """

    def __init__(
        self, num_samples: int, batch_size: int, *, seed: int = 0, shuffle: bool = True
    ) -> None:
        if num_samples < 1 or batch_size < 1 or seed < 0:
            raise ConfigError(
                f"ElasticSampler(num_samples={num_samples}, batch_size={batch_size}, "
                f"seed={seed}): give at least one sample, a batch of at least one sample, "
                "and a seed >= 0"
            )
        self.num_samples = int(num_samples)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self._perms: OrderedDict[int, np.ndarray] = OrderedDict()

    def __repr__(self) -> str:
        return (
            f"ElasticSampler(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"seed={self.seed}, shuffle={self.shuffle})"
        )

    @property
    def steps_per_epoch(self) -> int:
        """Global batches per data epoch, the last one partial when the sizes do not divide."""
        return -(-self.num_samples // self.batch_size)

    # -- the stream ----------------------------------------------------------------------

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the sample ids in data epoch ``epoch`` (int64, read-only)."""
        if epoch < 0:
            raise ConfigError(f"permutation(epoch={epoch}): epochs count from 0")
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                ids = np.arange(self.num_samples, dtype=np.uint64)
                keys = _splitmix64(ids ^ np.uint64(_mix(self.seed, epoch)))
                perm = np.argsort(keys, kind="stable").astype(np.int64)
            else:
                perm = np.arange(self.num_samples, dtype=np.int64)
            perm.flags.writeable = False
            self._perms[epoch] = perm
            while len(self._perms) > _CACHED_EPOCHS:
                self._perms.popitem(last=False)
        return perm

    def position(self, step: int) -> SamplerPosition:
        """The data epoch and cursor after ``step`` committed steps."""
        _check_step(step)
        epoch, batch = divmod(step, self.steps_per_epoch)
        return SamplerPosition(step, epoch, batch * self.batch_size)

    def global_batch(self, step: int) -> np.ndarray:
        """The sample ids of step ``step``'s global batch (every member's shares together).

        A fresh writable array (``torch.from_numpy`` takes it without a copy or a warning).
        """
        pos = self.position(step)
        stop = min(pos.cursor + self.batch_size, self.num_samples)
        return self.permutation(pos.epoch)[pos.cursor : stop].copy()

    def share(self, step: int, rank: int, size: int) -> Share:
        """Member ``rank`` of ``size``'s part of step ``step``'s global batch.

        Raises:
            ConfigError: ``size`` below 1 or ``rank`` outside ``0 .. size - 1``.
        """
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(
                f"share(rank={rank}, size={size}): rank must be in 0 .. size - 1 (pass "
                "job.rank and job.size)"
            )
        batch = self.global_batch(step)
        b = len(batch)
        lo, hi = b * rank // size, b * (rank + 1) // size
        return Share(step, self.position(step).epoch, rank, size, batch[lo:hi], b)

    def indices(self, step: int, rank: int, size: int) -> np.ndarray:
        """Member ``rank`` of ``size``'s sample ids for step ``step`` (see :meth:`share`)."""
        return self.share(step, rank, size).indices

    # -- the identity that rides in checkpoints ------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The identity of the stream: with the committed step, it fixes every batch."""
        return {
            "format": SAMPLER_FORMAT,
            "seed": self.seed,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Check that the saved stream is this sampler's: a different one breaks exactly-once.

        Raises:
            StateMismatchError: a saved field differs from this sampler's, or the format is
                newer than this stalwart reads.
        """
        fmt = int(state_dict.get("format", 0))
        if fmt > SAMPLER_FORMAT:
            raise StateMismatchError(
                f"the saved sampler state has format {fmt}, newer than this stalwart reads "
                f"({SAMPLER_FORMAT}); upgrade stalwart"
            )
        mine = self.state_dict()
        differ = {
            k: (state_dict.get(k), mine[k])
            for k in mine
            if k != "format" and state_dict.get(k) != mine[k]
        }
        if differ:
            found = ", ".join(f"{k}: saved {s!r}, here {h!r}" for k, (s, h) in differ.items())
            raise StateMismatchError(
                f"the checkpoint was trained on another data stream ({found}); resuming with "
                "this sampler would repeat or skip samples. Build the ElasticSampler with the "
                "saved values, or start a new run"
            )


def _check_step(step: int) -> None:
    if step < 0:
        raise ConfigError(f"step {step}: steps count committed steps, from 0 (pass job.step)")
