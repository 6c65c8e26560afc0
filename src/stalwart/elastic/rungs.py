"""The rungs of the recovery ladder: what one checkpoint tier holds on this member, and loading.

A rung is one tier seen from one member (:class:`Rung`): the steps it holds for this member,
and loading one of them into the member's state, verified. :func:`rungs_of` turns a
:class:`~stalwart.checkpoint.Checkpointer` (one durable rung) or a
:class:`~stalwart.checkpoint.TieredCheckpointer` (its memory tier, then its durable tiers in
the order given) into the rungs :class:`~stalwart.elastic.ladder.RecoveryLadder` climbs.

* :class:`MemoryRung`: the memory tier's snapshots, in this process or mapped back from a
  tmpfs ``keep_in`` folder by a restarted process; a load checks the snapshot's XXH3 digest
  before anything is copied into the state.
* :class:`DurableRung`: a checkpointer's committed steps; a load checks every chunk it reads
  against its content hash.

Both raise :class:`~stalwart.errors.CheckpointError` (or a storage error) for a copy that is
missing or damaged, which the ladder climbs past, and
:class:`~stalwart.errors.StateMismatchError` for a state that does not fit, which it does not.
"""

from __future__ import annotations

from typing import Any, Protocol

from stalwart.checkpoint import Checkpointer, TieredCheckpointer
from stalwart.checkpoint.memory.erasure_records import ProtectedSnapshot
from stalwart.errors import CheckpointNotFoundError

__all__ = ["DurableRung", "MemoryRung", "Rung", "rungs_of"]


class Rung(Protocol):
    """One tier of the ladder, on this member."""

    name: str
    """The tier's name, in reports (``memory``, ``local``, ``remote``, ``durable``)."""

    def steps(self) -> list[int]:
        """The steps this tier holds for this member (may raise a storage error)."""
        ...

    def load(self, step: int, state: Any) -> None:
        """Load ``step`` into ``state`` in place, verified; raise when it does not verify."""
        ...


class MemoryRung:
    """A TieredCheckpointer's memory snapshots on this member (digest-checked on load)."""

    def __init__(self, name: str, tiered: TieredCheckpointer) -> None:
        self.name, self.tiered = name, tiered

    def steps(self) -> list[int]:
        """The kept snapshots' steps."""
        return self.tiered.memory.steps()

    def load(self, step: int, state: Any) -> None:
        """Check the snapshot of ``step`` against its digest, then copy it into ``state``."""
        held = self.tiered.memory.find(step)
        if held is None:  # evicted since it was listed
            raise CheckpointNotFoundError(f"no memory snapshot of step {step} any more")
        snap = held.snapshot if isinstance(held, ProtectedSnapshot) else held
        snap.verify()
        snap.restore_into(state)


class DurableRung:
    """A checkpointer's committed steps (every chunk read is checked against its hash)."""

    def __init__(self, name: str, checkpointer: Checkpointer) -> None:
        self.name, self.checkpointer = name, checkpointer

    def steps(self) -> list[int]:
        """The committed steps under the checkpointer's root."""
        return self.checkpointer.steps()

    def load(self, step: int, state: Any) -> None:
        """Load ``step`` (strict: keys, shapes and dtypes must match)."""
        self.checkpointer.load(state, step)


def rungs_of(checkpoint: Checkpointer | TieredCheckpointer) -> list[Rung]:
    """The rungs of ``checkpoint``, fastest first.

    Raises:
        TypeError: ``checkpoint`` is neither a Checkpointer nor a TieredCheckpointer.
    """
    if isinstance(checkpoint, Checkpointer):
        return [DurableRung("durable", checkpoint)]
    if not isinstance(checkpoint, TieredCheckpointer):
        raise TypeError(
            f"the recovery ladder needs a Checkpointer or a TieredCheckpointer, got "
            f"{type(checkpoint).__name__}"
        )
    rungs: list[Rung] = []
    for tier in checkpoint.tiers:
        if tier.is_memory:
            rungs.append(MemoryRung(tier.name, checkpoint))
        else:
            rungs.append(DurableRung(tier.name, checkpoint.durable[tier.name]))
    return rungs
