"""What the planner is told: the job, the fleet it runs on, the tiers it saves to, stalwart's
costs, and which recovery strategy to model.

Every input is a frozen, keyword-only dataclass checked when it is made; every default comes from
:mod:`stalwart.plan.sources`, which names its source (a public report or one of our benches).
Units are in the names: ``_s`` seconds, ``_gb`` 10^9 bytes, ``_gbps`` GB per second per rank,
``_per_hour`` events per hour per accelerator (``node_loss`` per node, ``rack_loss`` per rack).
:mod:`stalwart.plan.config` bundles them (``PlanInputs``) and reads them from files.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from stalwart.errors import ConfigError
from stalwart.plan.sources import META_RSC, META_RSC_FAILURES_PER_1000_NODE_DAYS, defaults

__all__ = ["Costs", "Fleet", "Job", "Strategy", "Tier", "Tiers"]

_D = {key: cited.value for key, cited in defaults().items()}


class Strategy(str, enum.Enum):
    """How a job recovers from a failure (docs/plan.md draws each one).

    - ``checkpoint-restart``: torchrun with asynchronous DCP saves to remote storage only; any
      failure stops the whole job, which restarts and loads the last remote checkpoint.
    - ``stalwart-no-memory``: elastic survival (a live replica heals the lost group while the
      others train), then local disk, then remote; no erasure-coded memory snapshots.
    - ``stalwart-ladder``: the full ladder: live peer, erasure-coded peers' memory, local
      disk, remote.
    """

    CHECKPOINT_RESTART = "checkpoint-restart"
    NO_MEMORY = "stalwart-no-memory"
    LADDER = "stalwart-ladder"


def _check(owner: str, name: str, value: Any, *, low: float = 0.0, integer: bool = False,
           strict: bool = False, hint: str = "") -> None:  # fmt: skip
    bad = not isinstance(value, (int, float)) or isinstance(value, bool)
    infinite = not bad and not _finite(value)  # inf is no size, rate nor time to plan with
    bad = bad or infinite or (integer and not float(value).is_integer())
    bad = bad or (value <= low if strict else value < low)
    if bad:
        want = "an integer" if integer else "a number"
        op = ">" if strict else ">="
        hint = "; ".join(h for h in ("give a finite value" if infinite else "", hint) if h)
        raise ConfigError(
            f"{owner}.{name} must be {want} {op} {low:g}, got {value!r}"
            + (f"; {hint}" if hint else "")
        )


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond every float
        return False


@dataclass(frozen=True, kw_only=True)
class Job:
    """The training job."""

    accelerators: int = int(_D["job.accelerators"])
    """Ranks (one accelerator each)."""
    group_size: int = int(_D["job.group_size"])
    """Ranks that together hold one full copy of the state (a model-parallel replica); the
    other replicas hold the same shards. ``group_size == accelerators``: no live replica."""
    state_gb: float = _D["job.state_gb"]
    """Training state per rank (weights, optimizer, everything a checkpoint holds), GB."""
    step_s: float = _D["job.step_s"]
    """Seconds per training step when nothing fails and nothing is saved."""
    accelerators_per_node: int = int(_D["job.accelerators_per_node"])

    def __post_init__(self) -> None:
        for name in ("accelerators", "group_size", "accelerators_per_node"):
            _check("Job", name, getattr(self, name), low=1, integer=True)
        _check("Job", "state_gb", self.state_gb, strict=True)
        _check("Job", "step_s", self.step_s, strict=True)
        if self.accelerators % self.group_size:
            raise ConfigError(
                f"Job.group_size ({self.group_size}) must divide accelerators "
                f"({self.accelerators}): every replica spans group_size ranks"
            )

    @property
    def replicas(self) -> int:
        """Full copies of the state held live (1: none to heal from)."""
        return self.accelerators // self.group_size

    @property
    def nodes(self) -> int:
        return -(-self.accelerators // self.accelerators_per_node)


@dataclass(frozen=True, kw_only=True)
class Fleet:
    """How often things fail, by kind, and how the hardware is grouped."""

    crash_per_hour: float = _D["fleet.crash_per_hour"]
    """A process dies (a software bug); its host and local disk survive. Per accelerator."""
    hang_per_hour: float = _D["fleet.hang_per_hour"]
    """A process stops making progress without dying. Per accelerator."""
    sdc_per_hour: float = _D["fleet.sdc_per_hour"]
    """Silent data corruption: a rank's state turns wrong, found at the next digest check."""
    node_loss_per_hour: float = _D["fleet.node_loss_per_hour"]
    """A host leaves the job with its memory and local disk. Per node."""
    rack_loss_per_hour: float = _D["fleet.rack_loss_per_hour"]
    """Every node of a rack leaves at once (a switch, power). Per rack."""
    nodes_per_rack: int = int(_D["fleet.nodes_per_rack"])
    network_gbps: float = _D["fleet.network_gbps"]
    """Network bandwidth per accelerator between peers (heals and erasure rebuilds)."""

    def __post_init__(self) -> None:
        for name in ("crash", "hang", "sdc", "node_loss", "rack_loss"):
            _check("Fleet", f"{name}_per_hour", getattr(self, f"{name}_per_hour"))
        _check("Fleet", "nodes_per_rack", self.nodes_per_rack, low=1, integer=True)
        _check("Fleet", "network_gbps", self.network_gbps, strict=True)

    @classmethod
    def llama3(cls) -> Fleet:
        """Llama 3's interruption rates (the defaults)."""
        return cls()

    @classmethod
    def meta_rsc(cls, cluster: str = "rsc1") -> Fleet:
        """Node failures only, at the fitted rate r_f of one of Meta's research clusters
        (``rsc1``: 6.50, ``rsc2``: 2.34 failures per 1000 node-days; Kokolis et al.)."""
        if cluster not in META_RSC_FAILURES_PER_1000_NODE_DAYS:
            raise ConfigError(f"Fleet.meta_rsc({cluster!r}): use 'rsc1' or 'rsc2' ({META_RSC})")
        r_f = META_RSC_FAILURES_PER_1000_NODE_DAYS[cluster] / 1000 / 24
        return cls(crash_per_hour=0.0, hang_per_hour=0.0, sdc_per_hour=0.0, node_loss_per_hour=r_f)


@dataclass(frozen=True, kw_only=True)
class Tier:
    """A place snapshots go: its bandwidths per rank, its room and how often it is written."""

    write_gbps: float
    """Background write (and for memory: encode) bandwidth per rank; a snapshot commits
    state_gb / write_gbps after its stall."""
    read_gbps: float
    """Restore bandwidth per rank."""
    capacity_gb: float | None = None
    """Room per rank; a tier that cannot hold two snapshots (with parity) is not used."""
    interval_s: float | None = None
    """Seconds of training between snapshots; None: the planner chooses."""
    interval_cap_s: float = _D["tiers.interval_cap_s"]
    """Longest interval the planner chooses (a tier no failure kind lands on saves this often)."""
    data_shards: int = 1
    """Erasure coding across peers' memory: k data members ..."""
    parity_shards: int = 0
    """... and m parity members; a group survives the loss of up to m members."""

    def __post_init__(self) -> None:
        _check("Tier", "write_gbps", self.write_gbps, strict=True)
        _check("Tier", "read_gbps", self.read_gbps, strict=True)
        _check("Tier", "interval_cap_s", self.interval_cap_s, strict=True)
        _check("Tier", "data_shards", self.data_shards, low=1, integer=True)
        _check("Tier", "parity_shards", self.parity_shards, integer=True)
        for name in ("capacity_gb", "interval_s"):
            if getattr(self, name) is not None:
                _check("Tier", name, getattr(self, name), strict=True, hint="or leave it unset")

    @property
    def redundancy(self) -> float:
        """Bytes held per byte of state: (k + m) / k."""
        return (self.data_shards + self.parity_shards) / self.data_shards


def _memory() -> Tier:
    return Tier(write_gbps=_D["tiers.memory.write_gbps"], read_gbps=_D["tiers.memory.read_gbps"],
                data_shards=int(_D["tiers.memory.data_shards"]),
                parity_shards=int(_D["tiers.memory.parity_shards"]))  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """The snapshot tiers below the live replicas, fastest first."""

    memory: Tier = field(default_factory=_memory)
    disk: Tier = field(
        default_factory=lambda: Tier(
            write_gbps=_D["tiers.disk.write_gbps"], read_gbps=_D["tiers.disk.read_gbps"]
        )
    )
    remote: Tier = field(
        default_factory=lambda: Tier(
            write_gbps=_D["tiers.remote.write_gbps"], read_gbps=_D["tiers.remote.read_gbps"]
        )
    )

    def __post_init__(self) -> None:
        for name in ("memory", "disk", "remote"):
            if not isinstance(getattr(self, name), Tier):
                raise ConfigError(f"Tiers.{name} must be a Tier, got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class Costs:
    """What stalwart (and the torchrun baseline) costs: per GB saved, per failure.

    A snapshot of tier ``<t>`` (``memory``, ``disk``, ``remote``; ``torchrun`` for the
    baseline's save) stops training ``<t>_stall_s_per_gb`` seconds per GB, and its background
    work (copy, encode, digest, write) costs training another ``<t>_background_s_per_gb``.
    """

    memory_stall_s_per_gb: float = _D["costs.memory_stall_s_per_gb"]
    memory_background_s_per_gb: float = _D["costs.memory_background_s_per_gb"]
    disk_stall_s_per_gb: float = _D["costs.disk_stall_s_per_gb"]
    disk_background_s_per_gb: float = _D["costs.disk_background_s_per_gb"]
    remote_stall_s_per_gb: float = _D["costs.remote_stall_s_per_gb"]
    remote_background_s_per_gb: float = _D["costs.remote_background_s_per_gb"]
    crash_detect_s: float = _D["costs.crash_detect_s"]
    """From a process's death to the survivors knowing (also SDC's repair start)."""
    hang_detect_s: float = _D["costs.hang_detect_s"]
    node_detect_s: float = _D["costs.node_detect_s"]
    """A lost host or rack: no socket closes, heartbeats find it."""
    resume_s: float = _D["costs.resume_s"]
    """From detection to the survivors' next commit."""
    heal_s: float = _D["costs.heal_s"]
    """Fixed part of a replacement's start (launch to first commit), before its bytes move."""
    restart_s: float = _D["costs.restart_s"]
    """A rollback's launch: every process started again and the job formed anew, before it
    loads its snapshot (stalwart's strategies; checkpoint-restart: ``torchrun_restart_s``).
    Shorter than a heal where a replacement waits for the survivors' next step boundary."""
    verify_every_steps: int = int(_D["costs.verify_every_steps"])
    """Digests compared every this many steps: silent corruption is found at the next check."""
    spare_s: float = _D["costs.spare_s"]
    """Wait for a replacement host after a node or rack loss (every strategy)."""
    torchrun_restart_s: float = _D["costs.torchrun_restart_s"]
    """checkpoint-restart: relaunch every process and re-form the job, before loading."""
    torchrun_hang_detect_s: float = _D["costs.torchrun_hang_detect_s"]
    torchrun_stall_s_per_gb: float = _D["costs.torchrun_stall_s_per_gb"]
    torchrun_background_s_per_gb: float = _D["costs.torchrun_background_s_per_gb"]

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            _check("Costs", f.name, getattr(self, f.name), integer=f.name == "verify_every_steps")
