"""The recovery ladder as the planner sees it: failure kinds, where ranks sit, which rung takes
an event, and what each rung costs.

Placement (stated, not measured): ranks fill nodes in order (``accelerators_per_node`` each),
nodes fill racks in order; replica group ``r`` holds ranks ``[r G, (r + 1) G)`` and rank
``r G + s`` holds shard ``s``. Erasure-coded memory groups are formed across nodes: the
``k + m`` members of a group sit on different nodes, and on different racks when the job spans
at least ``k + m`` racks (same slot in consecutive racks); otherwise on consecutive nodes. Rank
``i`` of a node belongs to the group of rank ``i`` of its group's other nodes.

Rungs, fastest first (a strategy uses a subset, :func:`rungs`):

    peer     a live replica holds every lost shard: the lost replica groups heal from it while
             the others train (throughput (R - g) / R for the heal's time); the step in flight
             is discarded. Needs R >= 2 and not every holder of some shard lost.
    memory   erasure-coded snapshot in peers' host memory: every rank rolls back to it; the
             lost members are rebuilt from k survivors. Needs <= m lost members in every group
             since the snapshot was taken.
    disk     local disk: every rank rolls back to its own file. Needs no host lost since the
             snapshot (a lost host takes its disk).
    remote   remote storage: always there.

Silent data corruption never takes the peer rung: replicas average their gradients, so the
corruption reached every replica by the time a digest check finds it; everyone rolls back to a
snapshot taken before it.
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from stalwart.plan.config import PlanInputs
from stalwart.plan.inputs import Strategy

__all__ = [
    "RUNGS",
    "TIERS",
    "Kind",
    "Layout",
    "Loss",
    "RungCosts",
    "mean_heal_debt_s",
    "rates_per_s",
    "room_gb",
    "rungs",
]

RUNGS = ("peer", "memory", "disk", "remote")
TIERS = ("memory", "disk", "remote")
"""The rungs that hold snapshots (and have intervals)."""


class Kind(enum.StrEnum):
    """A failure kind (its value: the name in lower case); its rate comes from
    :class:`~stalwart.plan.inputs.Fleet`."""

    CRASH = enum.auto()
    HANG = enum.auto()
    NODE = enum.auto()
    RACK = enum.auto()
    SDC = enum.auto()


def rungs(strategy: Strategy, inputs: PlanInputs | None = None) -> tuple[str, ...]:
    """The rungs a strategy climbs down, fastest first; with ``inputs``, without the memory or
    disk tier when its ``capacity_gb`` cannot hold two snapshots (:func:`room_gb`)."""
    names = {
        Strategy.CHECKPOINT_RESTART: ("remote",),
        Strategy.NO_MEMORY: ("peer", "disk", "remote"),
        Strategy.LADDER: RUNGS,
    }[Strategy(strategy)]
    if inputs is None:
        return names
    return tuple(n for n in names if n in ("peer", "remote") or room_gb(inputs, n) is None)


def room_gb(inputs: PlanInputs, tier: str) -> float | None:
    """None when ``tier`` holds two snapshots (with parity) per rank, else the room it needs."""
    t = getattr(inputs.tiers, tier)
    need = 2 * inputs.job.state_gb * t.redundancy
    return None if t.capacity_gb is None or t.capacity_gb >= need else need


@dataclass(frozen=True)
class Loss:
    """What one failure took: whole nodes (their ranks, host memory and disk) or one rank's
    process (crash, hang: the host and its disk stay)."""

    kind: Kind
    nodes: tuple[int, ...] = ()
    rank: int | None = None


@dataclass(frozen=True)
class Layout:
    """Where ranks, nodes, racks, replicas and erasure-coded groups sit (module docstring)."""

    accelerators: int
    per_node: int
    nodes_per_rack: int
    group_size: int
    ec_members: int  # k + m
    ec_parity: int  # m

    @classmethod
    def of(cls, inputs: PlanInputs) -> Layout:
        job, mem = inputs.job, inputs.tiers.memory
        members = mem.data_shards + mem.parity_shards
        return cls(
            job.accelerators,
            job.accelerators_per_node,
            inputs.fleet.nodes_per_rack,
            job.group_size,
            members,
            mem.parity_shards,
        )

    @property
    def nodes(self) -> int:
        return -(-self.accelerators // self.per_node)

    @property
    def racks(self) -> int:
        return -(-self.nodes // self.nodes_per_rack)

    @property
    def replicas(self) -> int:
        return self.accelerators // self.group_size

    def units(self, kind: Kind) -> int:
        """How many places an event of ``kind`` can strike (ranks, nodes or racks)."""
        return {Kind.NODE: self.nodes, Kind.RACK: self.racks}.get(kind, self.accelerators)

    def loss(self, kind: Kind, where: int) -> Loss:
        """The loss of an event of ``kind`` striking unit ``where`` (a rank, node or rack)."""
        if kind is Kind.NODE:
            return Loss(kind, nodes=(where,))
        if kind is Kind.RACK:
            first = where * self.nodes_per_rack
            return Loss(
                kind, nodes=tuple(range(first, min(first + self.nodes_per_rack, self.nodes)))
            )
        return Loss(kind, rank=where)

    def ranks(self, loss: Loss) -> Iterable[int]:
        for n in loss.nodes:
            yield from range(n * self.per_node, min((n + 1) * self.per_node, self.accelerators))
        if loss.rank is not None:
            yield loss.rank

    def groups_out(self, loss: Loss) -> int:
        """Replica groups that lose a member."""
        return len({r // self.group_size for r in self.ranks(loss)})

    def all_holders_lost(self, losses: Iterable[Loss]) -> bool:
        """Whether some shard has lost every live replica (no peer can heal it)."""
        lost = {r for loss in losses for r in self.ranks(loss)}
        if not lost:
            return False
        if self.replicas == 1 or len(lost) < self.replicas:
            return self.replicas == 1
        holders = Counter(r % self.group_size for r in lost)
        return max(holders.values()) >= self.replicas

    def ec_group(self, node: int) -> tuple[int, int]:
        """The erasure-coded group of a node's ranks (rank i of the node: member i)."""
        g = self.ec_members
        if self.racks >= g:  # one member per rack: same slot in g consecutive racks
            rack, slot = divmod(node, self.nodes_per_rack)
            return slot, min(rack // g, self.racks // g - 1)
        return 0, min(node // g, max(self.nodes // g - 1, 0))

    def ec_overflow(self, losses: Iterable[Loss]) -> bool:
        """Whether some erasure-coded group lost more than m members (the snapshot is gone)."""
        losses = list(losses)
        if not losses:
            return False
        if self.ec_parity == 0 or self.nodes < self.ec_members:
            return True  # no parity, or groups cannot span nodes: any loss is fatal
        lost_nodes = {n for loss in losses for n in loss.nodes}
        per_group = Counter(self.ec_group(n) for n in lost_nodes)
        crashed: Counter[tuple[tuple[int, int], int]] = Counter()
        for loss in losses:
            if loss.rank is not None and loss.rank // self.per_node not in lost_nodes:
                node, i = divmod(loss.rank, self.per_node)
                crashed[(self.ec_group(node), i)] += 1
        worst = Counter(dict(per_group))
        for (group, _), n in crashed.items():
            worst[group] = max(worst[group], per_group[group] + n)
        return max(worst.values(), default=0) > self.ec_parity

    def first_rung(self, ladder: tuple[str, ...], loss: Loss) -> str:
        """The rung of ``ladder`` an isolated event takes (no other loss in flight)."""
        for rung in ladder:
            usable = {
                "peer": loss.kind is not Kind.SDC and not self.all_holders_lost([loss]),
                "memory": loss.kind is Kind.SDC or not self.ec_overflow([loss]),
                "disk": not loss.nodes,
                "remote": True,
            }[rung]
            if usable:
                return rung
        raise AssertionError("every ladder ends with remote")


@dataclass(frozen=True)
class RungCosts:
    """Seconds each part of a save or a recovery takes, for one strategy and one job.

    ``save_s[t]``: training time lost per snapshot of tier ``t`` (stall + background);
    ``lag_s[t]``: from the stall's end to the snapshot's commit (the background write);
    ``restore_s[t]``: from detection to training again after a rollback to ``t``;
    ``detect_s[kind]``; ``peer_stall_s``: detection to the survivors' next commit;
    ``heal_s``: a lost group's heal (start + bytes over the network), during which it is out;
    ``start_s``: the launch part of a restore (every process started again: ``restart_s``, or
    torchrun's restart).
    """

    save_s: dict[str, float]
    lag_s: dict[str, float]
    restore_s: dict[str, float]
    detect_s: dict[Kind, float]
    resume_s: float
    heal_s: float
    spare_s: float
    verify_every_steps: int | None
    start_s: float = 0.0

    @classmethod
    def of(cls, inputs: PlanInputs, strategy: Strategy) -> RungCosts:
        job, c, t, fleet = inputs.job, inputs.costs, inputs.tiers, inputs.fleet
        gb = job.state_gb
        baseline = Strategy(strategy) is Strategy.CHECKPOINT_RESTART
        save = {
            "memory": gb * (c.memory_stall_s_per_gb + c.memory_background_s_per_gb),
            "disk": gb * (c.disk_stall_s_per_gb + c.disk_background_s_per_gb),
            "remote": gb * (c.remote_stall_s_per_gb + c.remote_background_s_per_gb),
        }
        start = c.torchrun_restart_s if baseline else c.restart_s
        rebuild = gb * t.memory.data_shards / fleet.network_gbps  # k shards cross the network
        restore = {
            "memory": start + rebuild + gb / t.memory.read_gbps,
            "disk": start + gb / t.disk.read_gbps,
            "remote": start + gb / t.remote.read_gbps,
        }
        if baseline:
            save["remote"] = gb * (c.torchrun_stall_s_per_gb + c.torchrun_background_s_per_gb)
        hang = c.torchrun_hang_detect_s if baseline else c.hang_detect_s
        return cls(
            save_s=save,
            lag_s={name: gb / getattr(t, name).write_gbps for name in TIERS},
            restore_s=restore,
            detect_s={
                Kind.CRASH: c.crash_detect_s,
                Kind.HANG: hang,
                Kind.NODE: c.node_detect_s,
                Kind.RACK: c.node_detect_s,
                Kind.SDC: c.crash_detect_s,
            },
            resume_s=c.resume_s,
            heal_s=c.heal_s + gb / fleet.network_gbps,
            spare_s=c.spare_s,
            start_s=start,
            verify_every_steps=None if baseline else c.verify_every_steps or None,
        )

    def stall_s(self, kind: Kind, rung: str) -> float:
        """Wall time the whole job stands still for an event of ``kind`` taken by ``rung``."""
        if rung == "peer":
            return self.detect_s[kind] + self.resume_s
        spare = self.spare_s if kind in (Kind.NODE, Kind.RACK) else 0.0
        return self.detect_s[kind] + spare + self.restore_s[rung]

    def heal_time_s(self, kind: Kind) -> float:
        """How long a lost replica group is out after a peer-rung event."""
        return self.heal_s + (self.spare_s if kind in (Kind.NODE, Kind.RACK) else 0.0)


def rates_per_s(inputs: PlanInputs) -> dict[Kind, float]:
    """Job-wide event rate of each kind, per second."""
    f, lay = inputs.fleet, Layout.of(inputs)
    per_unit = {Kind.CRASH: f.crash_per_hour, Kind.HANG: f.hang_per_hour,
                Kind.NODE: f.node_loss_per_hour, Kind.RACK: f.rack_loss_per_hour,
                Kind.SDC: f.sdc_per_hour}  # fmt: skip
    return {k: per_unit[k] * lay.units(k) / 3600.0 for k in Kind}


def mean_heal_debt_s(inputs: PlanInputs, costs: RungCosts, kind: Kind) -> float:
    """Training lost to a peer heal, charged as full-job seconds: heal time x g / R."""
    lay = Layout.of(inputs)
    return costs.heal_time_s(kind) * lay.groups_out(lay.loss(kind, 0)) / lay.replicas
