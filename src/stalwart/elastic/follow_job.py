"""The follower inside :class:`~stalwart.elastic.Job` (``Job(follow=True)``): a replacement
heals while the survivors commit, then joins with a verified state and nothing to send.

Without it, a replacement joins the next epoch and every member waits while the state is sent
to it (docs/elastic.md, "Heals peer to peer"). With it:

1. **The ask.** A replacement (a worker that starts when the job already committed steps)
   does not announce itself. It writes a token under ``job/follow/0`` (one follow at a time:
   the first writer wins; the others announce themselves and heal as before) and waits for
   the survivors.
2. **The start.** The survivors' rank 0, the *pusher*, looks at the key at each step
   boundary. Finding a token, it builds a group of two with the replacement
   (``PrefixStore(f"follow/{token}")``), copies its state of step ``s`` and lends the copy
   (:class:`~stalwart.elastic.catchup.Lender`), and connects a
   :class:`~stalwart.elastic.feed.Feed`. The other survivors take no part: they wait for
   rank 0 in the next all-reduce while it copies.
3. **The follow.** The survivors commit on; after each all-reduce the pusher pushes the
   reduced gradients, float buffers and hyper-parameters. The replacement builds its model and
   optimizer; when it wraps the optimizer (``job.optimizer``) it applies the copy and the
   pushed steps (:meth:`~stalwart.elastic.follow.Follower.follow`), and once it has applied
   every step it received, it announces itself.
4. **The promotion.** The coordinator publishes an epoch listing it, and the pusher's
   newer-epoch flag travels in step ``t``'s all-reduce. If the follower applied every step
   before ``t`` but one and the new epoch lists it, the pusher pushes ``t`` marked
   ``promote``; at the boundary it sends what a replay does not rebuild (RNG states, integer
   buffers, the optimizer's step counts: :func:`~stalwart.elastic.catchup.send_rest`) and its
   digest. Equal digests: the replacement takes step ``t`` as its own. Then everyone joins the
   new epoch, whose parity check finds every member agreed: nothing is sent.
5. **Every failure falls back to the heal at the epoch change.** No pusher answered in time,
   the feed broke (the follower fell behind, died, or refused another model), a survivor died
   (an epoch that does not list the follower), the survivors rolled back, or the digests
   differ: the pusher closes the feed, and the replacement announces itself (if it had not),
   keeps step 0 and is healed in full, as without ``follow``.

**Replica groups** (``--group-size G``): the follow runs per shard. Rank ``r`` of a
replacement group asks under ``job/follow/<r>`` once its group's process group exists, and the
group follows only if every rank was answered (else the answered ranks withdraw and the group
announces itself, to heal at the change as one group). The pusher of shard ``r`` is rank ``r``
of the survivors' first group: it lends its shard (DTensor leaves as local parts, rebuilt on
the follower's mesh) and pushes its reduced local gradients. The pushers see the newer-epoch
flag at the same step (their group agrees on it); a pair that does not promote leaves its
group's digests unequal, and the group is healed in full at the change.

Every step of a follow is written to the event log (``follow`` lines: role, what happened,
step, peer).
"""

from __future__ import annotations

import contextlib
import logging
import time
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import PrefixStore

from stalwart.elastic.catchup import Lender, send_rest, take_rest
from stalwart.elastic.events import EventKind
from stalwart.elastic.feed import Feed
from stalwart.elastic.follow import Follower
from stalwart.elastic.groups import agree, build_group
from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.membership import Epoch, Membership
from stalwart.elastic.parity import gather_digests
from stalwart.elastic.protocol import decode, keys
from stalwart.elastic.state import AgreedState, digest
from stalwart.elastic.timeouts import Timeouts
from stalwart.elastic.worlds import World, first_epoch
from stalwart.errors import ConfigError, DistributedError

__all__ = ["FollowHeal"]

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")  # the follow's sockets and its group of two carry host memory


class FollowHeal:
    """One worker's part in follows: a replacement asks once and follows; the survivors' rank 0
    pushes to one replacement at a time; anyone else does nothing.

    Args:
        state: the job's state.
        membership: this worker's coordinator client (a replacement's announce deferred).
        timeout: how long a replacement waits for the pusher; the group of two's timeout.

    Attributes:
        optimizer: the user's optimizer (set by ``Job.optimizer``): the pusher sends its
            hyper-parameters, the follower steps it.
    """

    def __init__(self, state: Any, membership: Membership, timeout: timedelta) -> None:
        self.state, self.membership, self.timeout = state, membership, timeout
        self.optimizer: torch.optim.Optimizer | None = None
        self._group: Any = None  # the follow's group of two: the pusher 0, the follower 1
        self._token = ""
        self._follower: Follower | None = None
        self._feed: Feed | None = None
        self._lender: Lender | None = None
        self._peer = -1  # the follower's worker id (the pusher's side)
        self._promote = False  # the last pushed step was marked promote

    def use(self, optimizer: torch.optim.Optimizer, ledger: StepLedger, *, backups: bool) -> None:
        """The job's optimizer (``Job.optimizer``, the last of the user's objects the job
        wraps). A replacement that follows does it here and joins the epoch, so that its
        training loop starts at the survivors' step (``job.step``), as after a heal in the
        job's constructor; wrap the model (``job.data_parallel``) before.

        Raises:
            ConfigError: with backup workers (a step commits without some members' gradients
                on a schedule the follower cannot see).
        """
        if backups:
            raise ConfigError("Job(follow=True) with backup workers: use one or the other")
        self.optimizer = optimizer
        if self._follower is not None:
            self.membership.warm_up(announce=False)  # while the copy arrives (it announces
            ledger.reconfigure()  # once caught up); the follow (before_change), the join

    @property
    def following(self) -> bool:
        """Whether this replacement asked, was answered and has not joined an epoch yet."""
        return self._follower is not None

    @property
    def _key(self) -> str:
        """The store key of this worker's shard rank: one follow per shard rank at a time."""
        return keys.follow(self.membership.layout.group_rank)

    def _pair(self, token: str, rank: int) -> Any:
        store = PrefixStore(f"follow/{token}", self.membership.store)
        return build_group(store, rank, 2, device=_CPU, timeout=self.timeout)

    # -- the replacement --------------------------------------------------------------------

    def first_epoch(self, world: World, membership: Membership | None,
                    group_size: int | None, device: torch.device, timeouts: Timeouts,
                    timeout_s: float | None) -> tuple[Epoch, Any]:  # fmt: skip
        """The job's first epoch and its replica group's process group, as
        :func:`~stalwart.elastic.worlds.first_epoch`'s, for a job that may follow. A
        replacement of a replicated state asks to follow and gets the placeholder epoch it
        starts in (it follows, then joins, in :meth:`use`); a replacement group asks once its
        process group exists (:meth:`ask_in_group`); anyone else announces itself and joins
        as usual."""
        m = self.membership
        m.device = device
        grouped = m.layout.group_size > 1 or group_size not in (None, 1)
        if not grouped and m.progress() > 0 and self.ask():
            return Epoch(0, (m.wid,), 0, None), None
        if not grouped:
            m.announce()
        first, shard_group = first_epoch(world, membership, group_size, device, timeouts,
                                         timeout_s)  # fmt: skip
        if shard_group is not None:
            self.ask_in_group(shard_group)
        return first, shard_group

    def ask_in_group(self, shard_group: Any) -> None:
        """Replica groups, at the job's start: every rank of a replacement group asks to
        follow the survivors' rank of its shard; the group follows only if every rank was
        answered (collective on ``shard_group``). Otherwise the answered ranks withdraw and
        the whole group announces itself: it heals at the epoch change, as one group."""
        m = self.membership
        asked = m.progress() > 0 and self.ask()
        try:
            everyone = agree(shard_group, [float(asked)])[0] >= shard_group.size()
        except RuntimeError:  # a rank of the group died: the launcher takes the group out
            everyone = False
        if asked and not everyone:
            self._withdraw()
        if not (asked and everyone) and m.warmup is None:  # else it warms up, then announces
            m.announce()

    def _withdraw(self) -> None:
        """Give up an answered ask: the pusher's feed breaks, the key is free again."""
        if self._follower is not None:
            self._follower.close()
        with contextlib.suppress(RuntimeError):
            self.membership.store.compare_set(self._key, self._token, "")
        self._follower = self._group = None
        self._token = ""

    def ask(self) -> bool:
        """A replacement's ask (module docstring, 1); True when a pusher answered (the copy
        and the steps are coming). False: nobody answered or another replacement follows;
        the caller announces this worker (a heal at the epoch change)."""
        store = self.membership.store
        token = f"{self.membership.wid}.{time.time_ns()}"
        try:
            if bytes(store.compare_set(self._key, "", token)).decode() != token:
                return False  # another replacement follows
            self._group = self._pair(token, 1)
            self._follower = Follower(1, self._group)
        except (RuntimeError, OSError) as e:
            log.warning("worker %d: no survivor answered the follow (%s): it heals at the "
                        "epoch change", self.membership.wid, e)  # fmt: skip
            self._follower = self._group = None
            with contextlib.suppress(RuntimeError):
                store.compare_set(self._key, token, "")
            return False
        self._token = token
        return True

    def _follow(self, ledger: StepLedger) -> None:
        """The replacement, before it joins its first epoch: apply the copy and the pushed
        steps, take the rest and compare digests; equal, the survivors' step is its own."""
        follower, group, self._follower = self._follower, self._group, None
        assert follower is not None
        if self.optimizer is None:  # a step boundary before job.optimizer(): heal in full
            self._group = None  # the pusher's feed breaks when its queue fills
            self.membership.announce()
            return
        params, buffers, optimizer = ledger.params, ledger.buffers, self.optimizer

        def announce_when_caught_up() -> bool:  # asked while no pushed step waits
            if not self.membership.announced and follower.step is not None:
                self.membership.announce()
            return self._given_up()

        try:
            step = follower.follow(self.state, optimizer, params, buffers,
                                   abandon=announce_when_caught_up, poll_s=0.02)  # fmt: skip
            take_rest(self.state, optimizer, params, buffers, 0, group)
            mine = digest(self.state, step)
            theirs = gather_digests(step, mine, group)[0]
            if theirs != (step, mine):
                raise DistributedError(f"digests differ after the follow to step {step}")
        except (DistributedError, RuntimeError, OSError, ConfigError) as e:  # ConfigError:
            # another layout (another model, or job.data_parallel after job.optimizer)
            log.warning("worker %d: the follow failed (%s): it heals at the epoch change",
                        self.membership.wid, e)  # fmt: skip
            ledger.events.write(EventKind.FOLLOW, role="follower", outcome="fell-back",
                                step=ledger.step, peer=None, detail=str(e)[:200])  # fmt: skip
            return
        finally:
            if not self.membership.announced:
                self.membership.announce()
            self._group, self._token = None, ""
        ledger.followed_to(step)
        ledger.events.write(EventKind.FOLLOW, role="follower", outcome="promoted", step=step,
                            peer=None, detail="")  # fmt: skip

    def _given_up(self) -> bool:
        """Whether the pusher freed the key (it ended the follow): a signal through the store,
        whatever the feed's socket says."""
        try:
            return bytes(self.membership.store.get(self._key)).decode() != self._token
        except RuntimeError:
            return False

    # -- the survivors' rank 0 --------------------------------------------------------------

    def boundary(self, ledger: StepLedger) -> None:
        """A step boundary: rank 0 starts the follow a replacement asked for (module
        docstring, 2), or forgets one whose feed broke. Nothing when an epoch change is due
        (:meth:`before_change` promotes or abandons then; a promoted follower's closed feed
        is not a break)."""
        if ledger.reconfigure_due:
            return
        if self._feed is not None:
            if self._feed.broken is not None:
                self._end(ledger, f"the feed broke: {self._feed.broken}")
            return
        if ledger.epoch.rank != 0 or ledger.step == 0 or self.optimizer is None:
            return
        store = self.membership.store
        try:
            token = bytes(store.get(self._key)).decode() if store.check([self._key]) else ""
        except RuntimeError:  # the coordinator's trouble is membership's, at the next join
            return
        if not token:
            return
        self._token, self._peer = token, int(token.split(".")[0])
        try:
            self._group = self._pair(token, 0)
            copy = AgreedState()  # not the parity's agreed copy: this one is of an unchecked step
            copy.record(self.state, ledger.step)
            self._lender = Lender(copy, 0, [1], self._group)
            self._feed = Feed.connect(1, True, self._group, ledger.params, ledger.buffers)
        except (RuntimeError, OSError, ConfigError) as e:  # ConfigError: a placement
            self._end(ledger, f"could not start: {e}")  # other than Shard and Replicate
            return
        ledger.events.write(EventKind.FOLLOW, role="pusher", outcome="started", step=ledger.step,
                            peer=self._peer, detail="")  # fmt: skip

    def push(self, ledger: StepLedger, change: bool) -> None:
        """After the step's all-reduce, before its update: push it (module docstring, 3); a
        step carrying the newer-epoch flag is the promotion when the follower is ready and
        listed (4)."""
        feed = self._feed
        if feed is None or feed.broken is not None:
            return
        assert self.optimizer is not None and self._lender is not None
        step, lender = ledger.step + 1, self._lender
        base = lender.step if lender.done() else -1  # the copy landed: the follower holds it
        self._promote = change and feed.ready(step, base=base) and self._listed()
        try:
            feed.push(step, ledger.params, ledger.buffers, self.optimizer, promote=self._promote)
        except ConfigError as e:  # gradients zeroed in place: they cannot be sent unchanged
            log.warning("the follow stops: %s", e)
            feed.close()

    def _listed(self) -> bool:
        """Whether the newest published epoch lists the follower."""
        m = self.membership
        try:
            return self._peer in decode(m.store.get(keys.members(m.latest_epoch())))
        except RuntimeError:
            return False

    def _finish(self, ledger: StepLedger) -> None:
        """The epoch changes: promote the follower (the rest, the digest) or abandon it. A
        change at a boundary where no step committed (``job.refresh()``) promotes a follower
        that applied every pushed step (:meth:`Feed.promote_now`); the follower checks it."""
        feed, step = self._feed, ledger.step
        assert feed is not None and self._lender is not None and self.optimizer is not None
        listed = self._listed()
        if not self._promote and feed.broken is None and listed:  # no step commits here
            caught_up = feed.acked >= step or self._lender.step == step  # the follower checks
            self._promote = caught_up and feed.promote_now(step)
        if not self._promote:  # (once promoted, the follower closes the feed: it broke then)
            self._end(ledger, f"abandoned at an epoch change (the follower applied step "
                              f"{feed.acked}, the copy of step {self._lender.step} "
                              f"{'landed' if self._lender.done() else 'in flight'}, listed: "
                              f"{listed}, feed: {feed.broken or 'open'})")  # fmt: skip
            return
        try:
            send_rest(self.state, step, self.optimizer, ledger.params, ledger.buffers, 0,
                      self._group)  # fmt: skip
            mine, theirs = gather_digests(step, ledger.digest(), self._group)
        except (RuntimeError, OSError) as e:
            self._end(ledger, f"the promotion failed: {e}")
            return
        if theirs != mine:  # the follower compares too, and falls back to the heal
            self._end(ledger, f"digests differ after the follow to step {step} (the follower "
                              f"holds {theirs[1][:8]} at step {theirs[0]}, the pusher "
                              f"{mine[1][:8]}): it heals at the epoch change",
                      outcome="fell-back")  # fmt: skip
            return
        self._end(ledger, "", outcome="promoted")

    def _end(self, ledger: StepLedger, why: str, outcome: str = "abandoned") -> None:
        """Close the feed, free the group of two and the key for the next replacement."""
        if self._feed is not None:
            self._feed.close()
        if why:
            log.warning("the follow of worker %d ends: %s", self._peer, why)
        ledger.events.write(EventKind.FOLLOW, role="pusher", outcome=outcome, step=ledger.step,
                            peer=self._peer, detail=why[:200])  # fmt: skip
        with contextlib.suppress(RuntimeError):
            self.membership.store.compare_set(self._key, self._token, "")
        self._feed = self._lender = self._group = None
        self._token, self._peer, self._promote = "", -1, False

    # -- both -------------------------------------------------------------------------------

    def before_change(self, ledger: StepLedger) -> None:
        """Before this member joins a new epoch: the replacement follows, the pusher promotes
        or abandons (:meth:`StepLedger.reconfigure` calls it)."""
        if self._follower is not None:
            self._follow(ledger)
        elif self._feed is not None:
            self._finish(ledger)

    def close(self, ledger: StepLedger) -> None:
        """The job ends: a running follow is abandoned (the replacement heals, if it joins)."""
        if self._feed is not None:
            self._end(ledger, "the job closed")
