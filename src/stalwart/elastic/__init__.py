"""Elastic data-parallel training: survivors keep training, newcomers heal from peers.

    stalwart run --nproc 3 train.py          # coordinator (a TCPStore) + 3 workers

    state = stalwart.TrainingState(model=model, optimizer=opt)
    job = stalwart.elastic.Job(state, min_size=1)
    model = job.data_parallel(model)
    optimizer = job.optimizer(opt)
    while job.step < total:
        optimizer.zero_grad()                  # step boundary: a due epoch change and heal
        loss_fn(model(batch(job.step, job.rank, job.size))).backward()
        optimizer.step()                       # commits, or discards the step after a fault
    job.close()                                # agree on the final step (also run at exit)

How it holds together:

* **Coordinator** (:mod:`~stalwart.elastic.coordinator`): torch's ``TCPStore``, hosted by
  the launcher, which alone publishes membership epochs.
* **Epochs** (:mod:`~stalwart.elastic.membership`): membership changes only at step
  boundaries; each epoch gets a fresh gloo group on ``PrefixStore(f"epoch{n}", store)``.
* **Commit or discard** (:mod:`~stalwart.elastic.job`, :mod:`~stalwart.elastic.ledger`): the
  job's ``StepLedger`` owns the committed step; ``Job.commit`` hands each step to one commit
  strategy, by default one all-reduce carrying the gradients, floating-point buffers, votes
  and a change flag (:mod:`~stalwart.elastic.commit`), or backup workers. A failed
  collective discards the step on that member (parameters, optimizer state, buffers, RNG as
  before it); the next boundary joins the next epoch without the dead member.
* **Partial results.** When a member dies inside the all-reduce, some survivors may have
  received the complete result (and committed) while others got an error (and discarded).
  Parity policy (:mod:`~stalwart.elastic.parity`): in the next epoch, members all-gather
  (committed step, digest); the members **ahead** win (their step is a valid step of the old
  membership), then a strict majority; everyone else receives the winner's state peer to
  peer. With no majority (two members, two digests) every member rolls back to its copy of
  the last agreed state and the loop recomputes: the choice rests on evidence, never rank.
  So after every reconfiguration all members hold the same step and the same bytes.
* **Verified parity**: digests (xxh3-128 over parameters, optimizer state, RNG and step) are
  compared after every heal and every ``verify_every`` steps; a mismatch is logged as an
  event with the rule that decided, and repaired before the next commit.
* **Events** (:mod:`~stalwart.elastic.events`): JSON lines per worker; the launcher's
  summary (restarts, discarded steps, heals, goodput) is computed from them.
* **Hangs and stragglers** (:mod:`~stalwart.elastic.heartbeat`, :mod:`~stalwart.elastic.stats`):
  a heartbeat thread per worker; the launcher kills a worker silent for the hang timeout
  (which also fails the survivors' pending collective) and reports a member persistently
  slower than the others.
* **Replica groups** (``stalwart run --group-size G``; :mod:`~stalwart.elastic.groups`,
  :mod:`~stalwart.elastic.roster`): each replica is a group of G ranks with FSDP2 or tensor
  parallel inside (``job.shard_mesh``); the commit and the parity checks run across groups,
  a rank's death takes its group out, and a new group heals shard by shard from a live one.
  The backend follows the device (gloo on CPU, NCCL on CUDA, aborted on a fault), and one
  timeout gives the others (:mod:`~stalwart.elastic.timeouts`).
* **Sharded state** (:mod:`~stalwart.elastic.sharded`): state only one member holds is
  protected by erasure-coded pieces on its peers; a replacement takes over the dead member's
  slot and rebuilds it from the survivors' memory, and every member returns to that step.

Replicated state means replicated RNG: every member must draw the same random numbers
(seed them alike); per-member randomness belongs in the data function of (step, rank, size).
"""

from stalwart.elastic.async_outer import Buffered
from stalwart.elastic.backup import Dynamic, Static
from stalwart.elastic.diloco import DiLoCo, Nesterov
from stalwart.elastic.events import read_events, summarize
from stalwart.elastic.job import Job
from stalwart.elastic.ladder import RecoveryLadder
from stalwart.elastic.launcher import LaunchResult, launch
from stalwart.elastic.optimizer import ElasticOptimizer
from stalwart.elastic.recovery import recoveries
from stalwart.elastic.sampler import ElasticSampler
from stalwart.elastic.sharded import ShardedState
from stalwart.moved import moved_getattr

__all__ = [
    "Buffered",
    "DiLoCo",
    "Dynamic",
    "ElasticOptimizer",
    "ElasticSampler",
    "Job",
    "LaunchResult",
    "launch",
    "Nesterov",
    "read_events",
    "recoveries",
    "RecoveryLadder",
    "ShardedState",
    "Static",
    "summarize",
]

MOVED = {"JobSummary": "stalwart.elastic.events", "Recovery": "stalwart.elastic.recovery"}
"""Results that left this front door (still found here, with a DeprecationWarning, until the
next release)."""


__getattr__ = moved_getattr(__name__, MOVED)
