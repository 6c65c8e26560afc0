"""Backup workers: a step commits with the first ``n - b`` gradient contributions (DBW).

gloo has no partial all-reduce (a collective waits for every member), so steps with backup
workers go through the coordinator's store instead, keyed by (epoch, step):

1. every member packs its gradients and floating-point buffers and takes a ticket,
   ``i = store.add(".../n", 1)``: its arrival order, 1-based, decided atomically by the store;
2. the first ``k = n - b`` arrivals post their contribution under ``.../g{i}``; later arrivals
   post nothing: **their contribution is dropped, never applied later (staleness 0)**;
3. the ``k``-th arrival reduces: the mean of the ``k`` contributions, in ticket order, plus the
   next step's ``k`` and its RNG state, posted once under ``.../r``;
4. every member, late ones included, applies that one result: parity holds because every
   member applies the same bytes through the same optimizer.

A member that arrives after later steps' results were posted applies them in order without
computing their gradients (it catches up; its RNG follows the reducer's). Results are kept
for 64 steps; a member further behind finds them gone, times out, and is healed from its peers
by the parity policy of the next epoch.

**Back in phase.** A late member cannot interrupt its forward/backward; had it then started
the open step at once, it would stay a fraction of a step behind and be late at every step
after. So a late member that finds the open step more than half done (time since the last
result's post against the median interval between posts, the reducers' wall clocks) waits for
that step's result (at most 1.5 intervals) and starts the next step with the others.

**Unbiased scaling.** The result divides by ``k`` (the contributions used), not ``n``: each
member's gradient is the mean over its share, so the mean of ``k`` shares estimates the full
batch's mean gradient without bias *when which members are late does not depend on their data*
(fresh samples per step, as in ``batch(step, rank, size)``). With fixed per-rank shards a
persistently slow member's shard is under-represented; use ``backup=0`` there.

**Dynamic b** (:class:`Dynamic`, :mod:`stalwart.elastic.backup_policy`): every contribution
carries its member's compute time (step start to ticket; a late member posts it beside); the
window of recent steps' times, the intervals between results and the gradient noise scale
estimated from the contributions travel in the results, and the reducer picks the ``k`` of
the next step that maximises the expected progress per second.

**Abandoning a step** (``optimizer.too_late()``, as DBW's workers do): a loop accumulating
gradients over micro-batches polls it between them; True (the step has its ``k`` tickets) ->
skip the rest and call ``optimizer.step()``: the member posts nothing (that step's rows on it
are dropped like any late contribution), applies the result and starts the next step in
phase. Its ``backup`` event says ``abandoned``; it posts no compute time (Dynamic counts it as
the slowest).

**Partial contributions** (``Static(b, partial=True)`` / ``Dynamic(partial=True)``, the
DropCompute rule): a member that stopped early through ``optimizer.accumulate`` (which knows
the share ``f`` of its micro-batches it computed) posts that partial gradient with its ticket
``> k`` instead of nothing. The ``k``-th arrival waits for those posts at most ``grace`` median
step intervals and reduces ``sum(g_i) / sum(f_i)`` (each ``g_i`` is ``f_i`` times its member's
mean over its computed rows, so this is the mean over every row computed; ``sum(f) = k`` without
partial posts, the rule above). Members it included are in phase; a post after the grace is
dropped like any late one.

**A member leaves mid-step.** A waiting member polls the latest membership epoch; one that
drops a member of this epoch ends the wait at once only if the departed member may hold a
piece the step still lacks: it is the reducer (``.../k`` names it) and no result is posted,
or one of the first ``k - 1`` contributions is missing (or the reducer unknown) and the
departed member's own is not among those posted. Otherwise (a newcomer joined, or the member
left after posting) the step completes for everyone and the new epoch is joined after it.

Costs: every contribution crosses the coordinator's TCP store twice (in, then the result out;
raw bytes, :mod:`stalwart.elastic.backup_wire`), so this suits small and medium models; the
gloo all-reduce remains the default path.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from stalwart.elastic.backup_policy import Dynamic, Static, backup_count, noise_scale
from stalwart.elastic.backup_wire import (
    Janitor,
    Result,
    decode,
    encode,
    mean,
    rng_state,
)
from stalwart.elastic.protocol import keys
from stalwart.errors import ConfigError

__all__ = ["BackupRound", "Dynamic", "Result", "Static", "backup_count"]

_KEEP_STEPS = 64  # results kept in the store for members that fall behind
_POLL = timedelta(seconds=0.2)  # how often a waiting member checks for a newer epoch
_PACE_WINDOW = 10  # intervals between results kept for the pace (their median)


class BackupRound:
    """The store side of backup-worker steps for one member (see the module docstring).

    Args:
        store: the coordinator's store (shared by the members).
        backup: a static count of backup workers, :class:`Static` or :class:`Dynamic`.
    """

    def __init__(self, store: dist.Store, backup: int | Static | Dynamic) -> None:
        if isinstance(backup, int) and backup < 0:
            raise ConfigError(f"backup={backup}: the number of backup workers must be >= 0")
        self.store = store
        self.backup = Static(backup) if isinstance(backup, int) else backup
        self.share: tuple[int, int, float] | None = None  # (epoch, step, f) from accumulate
        self._k: dict[int, int] = {}  # epoch -> the next step's k (agreed through results)
        self._last: tuple[int, Result] | None = None  # (epoch, the last result applied)
        self._janitor = Janitor(store)  # deletes old steps' keys off the critical path
        self._gave_up: tuple[int, int] | None = None  # (epoch, step) found too late

    def close(self) -> None:
        """Stop the thread that deletes old steps' keys (after the keys queued so far)."""
        self._janitor.close()

    def _prefix(self, epoch: int, step: int) -> str:
        return f"backup/{epoch}/{step}"

    def published(
        self, epoch: int, step: int, templates: Sequence[torch.Tensor], wait_s: float = 0.0
    ) -> Result | None:
        """The result of ``step`` if posted (within ``wait_s`` seconds), else None.

        ``templates``: the local gradients then buffers (shapes and dtypes to decode).
        """
        key = f"{self._prefix(epoch, step)}/r"
        if wait_s > 0:
            try:
                self.store.wait([key], timedelta(seconds=wait_s))
            except RuntimeError:  # DistStoreError: not posted in time
                return None
        elif not self.store.check([key]):
            return None
        result = Result.decode(self.store.get(key), templates)
        self._seen(epoch, result)
        return result

    def too_late(self, epoch: int, step: int, size: int) -> bool:
        """True when ``step`` already has its ``k`` tickets: this member's part would be dropped.

        One store read (the ticket count) until True, then none for the rest of the step.
        """
        if self._gave_up == (epoch, step):
            return True
        k = self._k.get(epoch, backup_count(self.backup, size))
        if k >= size or int(self.store.add(f"{self._prefix(epoch, step)}/n", 0)) < k:
            return False
        self._gave_up = (epoch, step)
        return True

    def gave_up(self, epoch: int, step: int) -> bool:
        """Whether :meth:`too_late` was True for ``step`` (the member abandoned its compute)."""
        return self._gave_up == (epoch, step)

    def expected_s(self) -> float:
        """When the next step's ``k``-th contribution is expected, in seconds of compute.

        The median over recent steps of the ``k``-th smallest compute time (a partial share's
        time scaled to the whole batch); 0.0 when unknown or the policy is not ``partial``.
        """
        if self._last is None or not self.backup.partial or not self._last[1].times:
            return 0.0
        k = self._last[1].next_k
        ordered = [sorted(t.values()) for t in self._last[1].times.values()]
        return statistics.median(o[min(k, len(o)) - 1] for o in ordered)

    def behind(self) -> float:
        """Seconds to wait for the open step's result before computing it (0: compute it).

        For a member that was late: > 0 when the others are more than half way through the
        open step, so computing it would be late again ("Back in phase" above).
        """
        if self._last is None or self._last[1].pace <= 0:
            return 0.0
        last = self._last[1]
        return 1.5 * last.pace if time.time() - last.posted > 0.5 * last.pace else 0.0

    def exchange(
        self,
        *,
        epoch: int,
        step: int,
        rank: int,
        size: int,
        grads: list[torch.Tensor],
        buffers: list[torch.Tensor],
        own_s: float,
        generators: Sequence[torch.Generator] = (),
        gone: Callable[[], set[int]] = set,
    ) -> tuple[Result, int]:
        """Post this member's contribution (if in time) and return the step's result.

        ``gone()`` is polled while waiting: the ranks of this epoch's members that a newer
        epoch left out. The member gives up at once (instead of waiting for the store's
        timeout) only when one of them may hold a piece the step still lacks ("A member
        leaves mid-step" above); a newcomer alone, or a member that left after its
        contribution was posted, never costs the step.

        Returns:
            The result, and this member's ticket (arrival order, 1-based; > k: dropped
            unless a partial post of it is in ``result.used``).

        Raises:
            RuntimeError: abandoned, or the store timed out or is gone (a member died mid-step).
        """
        p = self._prefix(epoch, step)
        k = self._k.get(epoch, backup_count(self.backup, size))
        ticket = self.store.add(f"{p}/n", 1)
        templates = [*grads, *buffers]
        share = self.share[2] if self.share is not None and self.share[:2] == (epoch, step) else 1.0
        head = (rank, own_s, share)
        partial = (
            ticket > k and self.backup.partial and (share < 1 or not self.gave_up(epoch, step))
        )
        if ticket < k or partial:
            self.store.set(f"{p}/g{ticket}", encode(head, templates))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        elif ticket > k and isinstance(self.backup, Dynamic) and not self.gave_up(epoch, step):
            # late after a full step: tell the next reducer (an abandoned step has no time)
            self.store.set(f"{p}/t{rank}", repr(own_s))

        def lost() -> bool:
            return self._lost(p, k, gone(), templates)

        if ticket == k:  # the reducer: its own contribution stays in memory
            self.store.set(f"{p}/k", str(rank))  # who reduces: waiters check it is alive
            self._wait([f"{p}/g{i}" for i in range(1, k)], lost)
            late = self._partial_posts(p, k, size)
            mine = (head, [t.detach() for t in templates])
            result = self._reduce(p, k, late, mine, len(grads), epoch, step, size, generators)
            self._forget(epoch, step - _KEEP_STEPS, size)
        else:
            self._wait([f"{p}/r"], lost)
            result = Result.decode(self.store.get(f"{p}/r"), templates)
        self._seen(epoch, result)
        return result, ticket

    def _seen(self, epoch: int, result: Result) -> None:
        self._k = {epoch: result.next_k}
        self._last = (epoch, result)

    def _partial_posts(self, p: str, k: int, size: int) -> list[str]:
        """The keys of late members' partial posts that arrived within the grace period."""
        if not self.backup.partial or k >= size:
            return []
        late = [f"{p}/g{i}" for i in range(k + 1, size + 1)]
        pace = self._last[1].pace if self._last is not None else 0.0
        # DistStoreError: some did not come in time, use those that did; no pace yet (an
        # epoch's first steps): wait at most _POLL
        with contextlib.suppress(RuntimeError):
            self.store.wait(late, timedelta(seconds=self.backup.grace * pace) if pace else _POLL)
        return [key for key in late if self.store.check([key])]

    def _reduce(
        self, p: str, k: int, late: list[str], mine: tuple[tuple[Any, ...], list[torch.Tensor]],
        n_grads: int, epoch: int, step: int, size: int, generators: Sequence[torch.Generator],
    ) -> Result:  # fmt: skip
        templates = mine[1]
        *others, latest = self.store.multi_get(
            [*(f"{p}/g{i}" for i in range(1, k)), *late, keys.EPOCH]
        )
        parts = [decode(data, templates) for data in others[: k - 1]] + [mine]
        parts += [decode(data, templates) for data in others[k - 1 :]]  # ticket order
        used = tuple(head[0] for head, _ in parts)
        total = sum(head[2] for head, _ in parts)
        avg = [mean([ts[j] for _, ts in parts], total if j < n_grads else None)
               for j in range(len(templates))]  # fmt: skip
        prev = self._last[1] if self._last is not None and self._last[0] == epoch else None
        now = time.time()
        intervals = (*prev.intervals, now - prev.posted)[-_PACE_WINDOW:] if prev else ()
        times, next_k, noise, costs = {}, backup_count(self.backup, size), (), ()
        mine_s = {head[0]: head[1] / head[2] for head, _ in parts}  # a share's full time
        if isinstance(self.backup, Dynamic) or self.backup.partial:
            times = self._times(epoch, step, size, mine_s)
        if isinstance(self.backup, Dynamic):
            w = self.backup.window
            full = [ts[:n_grads] for head, ts in parts if head[2] == 1.0]  # the noise needs
            full_mean = avg[:n_grads]  # equal batches: partial shares are left out of it
            if 2 <= len(full) < len(parts):
                full_mean = [mean([f[j] for f in full]) for j in range(n_grads)]
            phi = noise_scale(full, full_mean)  # nan below two full contributions
            noise = tuple(v for v in (*(prev.noise if prev else ()), phi) if not math.isnan(v))[-w:]
            if prev:  # none yet: the commit's cost is unknown, wait for all
                cost = max(0.0, intervals[-1] - sorted(mine_s.values())[k - 1])
                costs = (*prev.costs, cost)[-w:]
                known = statistics.median(noise) if noise else None
                next_k = self.backup.choose(
                    list(times.values()), size, cost=statistics.median(costs), noise=known
                )
        change = 1.0 if int(latest) > epoch else 0.0  # a newer epoch: reconfigure after it
        result = Result(avg[:n_grads], avg[n_grads:], used, next_k, change,
                        rng_state(generators), times, now, intervals, noise, costs,
                        tuple(head[2] for head, _ in parts))  # fmt: skip
        self.store.set(f"{p}/r", result.encode())  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        return result

    def _times(
        self, epoch: int, step: int, size: int, now: Mapping[int, float]
    ) -> dict[int, dict[int, float]]:
        """The compute-time window (step -> rank -> s): this step's contributors' and the
        previous step's late members' (posted beside it; one store read each)."""
        prev = self._last[1] if self._last is not None and self._last[0] == epoch else None
        times = {s_: dict(t) for s_, t in (prev.times if prev is not None else {}).items()}
        if prev is not None and step - 1 in times:
            p = self._prefix(epoch, step - 1)
            for r in range(size):
                if r not in prev.used and self.store.check([f"{p}/t{r}"]):
                    times[step - 1][r] = float(self.store.get(f"{p}/t{r}").decode())
        times[step] = dict(now)
        window = self.backup.window if isinstance(self.backup, Dynamic) else _PACE_WINDOW
        return {s_: times[s_] for s_ in sorted(times)[-window:]}

    def _lost(self, p: str, k: int, gone: set[int], templates: list[torch.Tensor]) -> bool:
        """Whether a member that left (``gone``: ranks) may hold a piece step ``p`` still
        lacks: the result of a reducer that left, or one of the first ``k - 1`` contributions
        not posted yet when a departed member's own is not among the posted ones."""
        if not gone or self.store.check([f"{p}/r"]):
            return False
        known = self.store.check([f"{p}/k"])  # the reducer's rank, set once it has ticket k
        if known and int(self.store.get(f"{p}/k")) in gone:
            return True
        posted = [key for key in (f"{p}/g{i}" for i in range(1, k)) if self.store.check([key])]
        heads = self.store.multi_get(posted) if posted else []
        ranks = {decode(data, templates)[0][0] for data in heads}  # head: (rank, own_s, share)
        return not gone <= ranks and (len(posted) < k - 1 or not known)

    def _wait(self, keys: list[str], lost: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.store.timeout.total_seconds()  # type: ignore[attr-defined]  # missing from the stub
        while True:
            try:
                self.store.wait(keys, _POLL)
                return
            except RuntimeError:  # DistStoreError: not there yet
                if lost() and not self.store.check(keys):  # a last look before giving up
                    raise RuntimeError(
                        f"gave up waiting for {keys[-1]}: a member that left the job (a newer "
                        "membership epoch was published) held a piece of this step; the step "
                        "is discarded and retried in the new epoch"
                    ) from None
                if time.monotonic() > deadline:
                    raise

    def _forget(self, epoch: int, step: int, size: int) -> None:
        if step < 0:
            return
        p = self._prefix(epoch, step)
        late = [f"{p}/t{r}" for r in range(size)] if isinstance(self.backup, Dynamic) else []
        self._janitor.delete(
            [f"{p}/n", f"{p}/r", f"{p}/k", *(f"{p}/g{i}" for i in range(1, size + 1)), *late]
        )
