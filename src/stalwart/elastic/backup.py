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

**Abandoning a step** (:func:`too_late`, as DBW's workers do): a loop accumulating gradients
over micro-batches polls it between them; True (the step has its ``k`` tickets) -> skip the rest
and call ``optimizer.step()``: the member posts nothing (that step's rows on it are dropped like
any late contribution), applies the result and starts the next step in phase. Its ``backup``
event says ``abandoned``; it posts no compute time (Dynamic counts it as the slowest).

Costs: every contribution crosses the coordinator's TCP store twice (in, then the result out;
raw bytes, :mod:`stalwart.elastic.backup_wire`), so this suits small and medium models; the
gloo all-reduce remains the default path.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from stalwart.elastic.backup_policy import Dynamic, backup_count, noise_scale
from stalwart.elastic.backup_wire import Janitor, decode, encode, rng_state, set_rng_state
from stalwart.elastic.protocol import keys
from stalwart.errors import ConfigError

if TYPE_CHECKING:
    from stalwart.elastic.job import Job

__all__ = ["BackupRound", "Dynamic", "Result", "backup_count", "commit_with_backup", "too_late"]

_KEEP_STEPS = 64  # results kept in the store for members that fall behind
_POLL = timedelta(seconds=0.2)  # how often a waiting member checks for a newer epoch
_PACE_WINDOW = 10  # intervals between results kept for the pace (their median)


@dataclass(frozen=True)
class Result:
    """One committed step's reduction, the same bytes for every member."""

    grads: list[torch.Tensor]
    buffers: list[torch.Tensor]
    used: tuple[int, ...]  # ranks whose contributions were averaged, in ticket order
    next_k: int
    change: float  # 1.0: a newer epoch was published, reconfigure after this step
    rng: tuple[Any, ...]
    times: Mapping[int, Mapping[int, float]] = field(default_factory=dict)  # step -> rank -> s
    posted: float = 0.0  # the reducer's wall clock when it posted this result
    intervals: tuple[float, ...] = ()  # the last intervals between results' posts, seconds
    noise: tuple[float, ...] = ()  # the last gradient noise scale estimates (Dynamic)
    costs: tuple[float, ...] = ()  # the last commit costs: interval - slowest used time (Dynamic)

    @property
    def pace(self) -> float:
        """The median interval between results (0.0 before two were posted)."""
        return statistics.median(self.intervals) if self.intervals else 0.0

    def encode(self) -> bytes:
        """The bytes every member decodes (see :mod:`stalwart.elastic.backup_wire`)."""
        header = (self.used, self.next_k, self.change, self.rng, dict(self.times),
                  self.posted, self.intervals, self.noise, self.costs, len(self.grads))  # fmt: skip
        return encode(header, [*self.grads, *self.buffers])

    @classmethod
    def decode(cls, data: bytes, templates: Sequence[torch.Tensor]) -> Result:
        """The result in ``data``; ``templates``: the local gradients then buffers."""
        head, tensors = decode(data, templates)
        *fields, n = head
        return cls(tensors[:n], tensors[n:], *fields)


class BackupRound:
    """The store side of backup-worker steps for one member (see the module docstring).

    Args:
        store: the coordinator's store (shared by the members).
        backup: a static count of backup workers, or :class:`Dynamic`.
    """

    def __init__(self, store: dist.Store, backup: int | Dynamic) -> None:
        if isinstance(backup, int) and backup < 0:
            raise ConfigError(f"backup={backup}: the number of backup workers must be >= 0")
        self.store = store
        self.backup = backup
        self._k: dict[int, int] = {}  # epoch -> the next step's k (agreed through results)
        self._last: tuple[int, Result] | None = None  # (epoch, the last result applied)
        self._janitor = Janitor(store)  # deletes old steps' keys off the critical path
        self._gave_up: tuple[int, int] | None = None  # (epoch, step) found too late

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
        abandon: Callable[[], bool] = lambda: False,
    ) -> tuple[Result, int]:
        """Post this member's contribution (if in time) and return the step's result.

        ``abandon()`` is polled while waiting: True (a newer epoch was published, so a member
        is gone) gives up at once instead of waiting for the store's timeout.

        Returns:
            The result, and this member's ticket (arrival order, 1-based; > k: dropped).

        Raises:
            RuntimeError: abandoned, or the store timed out or is gone (a member died mid-step).
        """
        p = self._prefix(epoch, step)
        k = self._k.get(epoch, backup_count(self.backup, size))
        ticket = self.store.add(f"{p}/n", 1)
        templates = [*grads, *buffers]
        head = (rank, own_s)
        if ticket < k:
            self.store.set(f"{p}/g{ticket}", encode(head, templates))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        elif ticket > k and isinstance(self.backup, Dynamic) and not self.gave_up(epoch, step):
            # late after a full step: tell the next reducer (an abandoned step has no time)
            self.store.set(f"{p}/t{rank}", repr(own_s))
        if ticket == k:  # the reducer: its own contribution stays in memory
            self._wait([f"{p}/g{i}" for i in range(1, k)], abandon)
            mine = (head, [t.detach() for t in templates])
            result = self._reduce(p, k, mine, len(grads), epoch, step, size, generators)
            self._forget(epoch, step - _KEEP_STEPS, size)
        else:
            self._wait([f"{p}/r"], abandon)
            result = Result.decode(self.store.get(f"{p}/r"), templates)
        self._seen(epoch, result)
        return result, ticket

    def _seen(self, epoch: int, result: Result) -> None:
        self._k = {epoch: result.next_k}
        self._last = (epoch, result)

    def _reduce(
        self, p: str, k: int, mine: tuple[tuple[int, float], list[torch.Tensor]],
        n_grads: int, epoch: int, step: int, size: int, generators: Sequence[torch.Generator],
    ) -> Result:  # fmt: skip
        templates = mine[1]
        *others, latest = self.store.multi_get([*(f"{p}/g{i}" for i in range(1, k)), keys.EPOCH])
        parts = [decode(data, templates) for data in others] + [mine]  # ticket order
        used = tuple(head[0] for head, _ in parts)
        mean = [_mean([ts[j] for _, ts in parts]) for j in range(len(templates))]
        prev = self._last[1] if self._last is not None and self._last[0] == epoch else None
        now = time.time()
        intervals = (*prev.intervals, now - prev.posted)[-_PACE_WINDOW:] if prev else ()
        times, next_k, noise, costs = {}, backup_count(self.backup, size), (), ()
        if isinstance(self.backup, Dynamic):
            times = self._times(epoch, step, size, {head[0]: head[1] for head, _ in parts})
            w = self.backup.window
            phi = noise_scale([ts[:n_grads] for _, ts in parts], mean[:n_grads])
            noise = tuple(v for v in (*(prev.noise if prev else ()), phi) if not math.isnan(v))[-w:]
            if prev:  # none yet: the commit's cost is unknown, wait for all
                cost = max(0.0, intervals[-1] - max(head[1] for head, _ in parts))
                costs = (*prev.costs, cost)[-w:]
                known = statistics.median(noise) if noise else None
                next_k = self.backup.choose(
                    list(times.values()), size, cost=statistics.median(costs), noise=known
                )
        change = 1.0 if int(latest) > epoch else 0.0  # a newer epoch: reconfigure after it
        result = Result(mean[:n_grads], mean[n_grads:], used, next_k, change,
                        rng_state(generators), times, now, intervals, noise, costs)  # fmt: skip
        self.store.set(f"{p}/r", result.encode())  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        return result

    def _times(
        self, epoch: int, step: int, size: int, now: Mapping[int, float]
    ) -> dict[int, dict[int, float]]:
        """The compute-time window (step -> rank -> seconds), carried from result to result.

        This step's contributors bring theirs; members late for the previous step posted
        theirs beside it (one store read each, if already there).
        """
        assert isinstance(self.backup, Dynamic)
        prev = self._last[1] if self._last is not None and self._last[0] == epoch else None
        times = {s_: dict(t) for s_, t in (prev.times if prev is not None else {}).items()}
        if prev is not None and step - 1 in times:
            p = self._prefix(epoch, step - 1)
            for r in range(size):
                if r not in prev.used and self.store.check([f"{p}/t{r}"]):
                    times[step - 1][r] = float(self.store.get(f"{p}/t{r}").decode())
        times[step] = dict(now)
        return {s_: times[s_] for s_ in sorted(times)[-self.backup.window :]}

    def _wait(self, keys: list[str], abandon: Callable[[], bool]) -> None:
        deadline = time.monotonic() + self.store.timeout.total_seconds()  # type: ignore[attr-defined]  # missing from the stub
        while True:
            try:
                self.store.wait(keys, _POLL)
                return
            except RuntimeError:  # DistStoreError: not there yet
                if abandon():
                    raise RuntimeError(
                        f"gave up waiting for {keys[-1]}: a newer membership epoch was "
                        "published (a member left mid-step); the step is discarded"
                    ) from None
                if time.monotonic() > deadline:
                    raise

    def _forget(self, epoch: int, step: int, size: int) -> None:
        if step < 0:
            return
        p = self._prefix(epoch, step)
        late = [f"{p}/t{r}" for r in range(size)] if isinstance(self.backup, Dynamic) else []
        self._janitor.delete([f"{p}/n", f"{p}/r", *(f"{p}/g{i}" for i in range(1, size)), *late])


def _mean(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Mean in ticket order, accumulated in float64, returned in the inputs' dtype."""
    acc = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t in tensors:
        acc += t.to(torch.float64)
    return (acc / len(tensors)).to(tensors[0].dtype)


# -- the job's side (package-internal: Job.commit delegates here) ---------------------------


def commit_with_backup(job: Job, backups: BackupRound, apply: Callable[[], Any]) -> Any:
    """Commit ``job``'s step with the first ``n - b`` contributions, then catch up if late.

    Returns ``apply()``'s result for this member's step, or None when the step was discarded
    (the store timed out: a member died mid-step; the job reconfigures at the next boundary).
    """
    membership = job._membership
    assert membership is not None

    def abandon() -> bool:
        try:
            return membership.latest_epoch() > job.epoch
        except RuntimeError:
            return False

    gens = _generators(job.state)
    grads = [(p.grad if p.grad is not None else torch.zeros_like(p)).detach() for p in job._params]
    buffers = [b.detach() for b in job._buffers]
    try:
        found, ticket = backups.exchange(
            epoch=job.epoch, step=job.step, rank=job.rank, size=job.size, grads=grads,
            buffers=buffers, own_s=job._own_s, generators=gens, abandon=abandon,
        )  # fmt: skip
    except RuntimeError as e:
        job._discard(e)
        return None
    abandoned = backups.gave_up(job.epoch, job.step)
    result = _apply(job, found, ticket, apply, gens, abandoned=abandoned)
    if ticket <= len(found.used):
        return result  # in time: in phase with the others, nothing to catch up
    while not job._needs_reconfigure:  # late: catch up, then get back in phase
        try:
            later = backups.published(job.epoch, job.step, [*grads, *buffers])
            if later is None and (wait_s := backups.behind()) > 0:
                later = backups.published(job.epoch, job.step, [*grads, *buffers], wait_s)
        except RuntimeError:
            break
        if later is None:
            break
        _apply(job, later, None, apply, gens)
    return result


def too_late(job: Job) -> bool:
    """Whether ``job``'s current step already has its ``k`` contributions without this member.

    Poll it between micro-batches (one store read); True: skip the rest, call
    ``optimizer.step()`` (see "Abandoning a step" above). False without backup workers.
    """
    backups = job._backups
    if backups is None or job.size <= 1 or job._needs_reconfigure:
        return False
    try:
        return backups.too_late(job.epoch, job.step, job.size)
    except RuntimeError:  # the store is gone: step() reports it
        return False


def _generators(state: Any) -> list[torch.Generator]:
    named = getattr(state, "generators", None)
    return list(named.values()) if isinstance(named, Mapping) else []


def _apply(
    job: Job, found: Result, ticket: int | None, apply: Callable[[], Any],
    gens: Sequence[torch.Generator], abandoned: bool = False,
) -> Any:  # fmt: skip
    job._events.write("backup", step=job.step, epoch=job.epoch, ticket=ticket,
                      used=[job.members[r] for r in found.used], next_k=found.next_k,
                      abandoned=abandoned)  # fmt: skip
    for p, g in zip(job._params, found.grads, strict=True):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)
    with torch.no_grad():
        for b, v in zip(job._buffers, found.buffers, strict=True):
            b.copy_(v)
    set_rng_state(found.rng, gens)
    result = apply()
    job._step += 1
    job._needs_reconfigure = job._needs_reconfigure or found.change > 0
    job._after_commit()
    return result
