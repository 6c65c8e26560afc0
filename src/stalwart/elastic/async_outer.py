"""Buffered asynchronous outer steps for DiLoCo: apply once K of N pseudo-gradients arrived.

gloo has no partial all-reduce, so (as for backup workers, :mod:`stalwart.elastic.backup`)
the buffer lives on the coordinator's ``TCPStore``. Versions ``v = 0, 1, 2, ...`` of the
global model are published by whichever member fills a buffer; nobody waits for the slowest:

    diloco/version      the newest published version (decimal)
    diloco/r{v}         version v: global parameters and buffers, the outer optimizer's state,
                        who was used or dropped, and the next phase's H per worker
    diloco/b{v}/n       ticket counter of buffer v (the contributions that make version v+1)
    diloco/b{v}/g{t}    contribution t: worker id, base version, inner steps, seconds, Δ
    diloco/b{v}/claim   the one aggregator of buffer v, decided with ``compare_set``

1. A member finishing its inner phase reads ``v = version``. Its **staleness** is
   ``s = v - base`` (base: the version its phase started from). If ``s > S`` its
   contribution is **dropped** (it adopts version v and starts again).
2. Otherwise it takes a ticket ``t`` in buffer v, posts its contribution, and, if the buffer
   holds ``k = min(K, members)`` contributions, claims the aggregation (``compare_set``; the
   claim fixes how many contributions are used); below ``k = N`` a stale phase is first
   restated against version v (``θ_v - θ_local``). The aggregator loads version v, combines
   the contributions, steps the outer optimizer, and publishes version v+1.
3. A member whose phase started from the newest version (``base == v``) waits until version
   v+1 is published (it waits for the K fastest, not for the slowest); a stale member adopts
   the newest version at once. A member that finds itself left out of the buffer it waited
   on (it arrived after the claim) posts again into the next buffer.

**Weights** (unbiased when which members arrive is random, FedFix/FAVANO's concern): each
contribution counts by the inner steps behind it, discounted by staleness,
``w_i = h_i · (1 + s_i)^-1/2`` (FedBuff's discount), and the pseudo-gradient applied is

    Δ = H · Σ_i (1 + s_i)^-1/2 Δ_i / Σ_i w_i

the per-inner-step progress averaged over the samples behind it, scaled to ``H`` steps. With
equal ``h_i = H`` and no staleness this is the plain mean of synchronous DiLoCo; a member that
did fewer steps neither shrinks nor inflates the step, and every sample counts the same
whichever members arrived.

**Compute-aware H** (after FedCompass): every member publishes its seconds per inner step
``r_i`` at each report (``diloco/rate/{wid}``, dropped or not); the aggregator assigns
``H_i = clamp(round(H · r_med / r_i), h_min, H)`` (``r_med``: the median member's), so each
member's phase takes about the median member's ``H``-step time and they report together.

**Outer rule.** With ``k`` equal to the members (no version is a partial round) each version
takes the outer optimizer's own step, as synchronous DiLoCo does. With ``k`` below the
members the default is **delayed Nesterov** (:mod:`stalwart.elastic.outer_rules`): a
version of ``n`` of ``N`` contributions is ``n / N`` of a round, applied as a momentum-free
step, and the momentum is updated once per round; the per-version Nesterov step diverged
there (``Buffered(rule="per-version")`` keeps it, for comparison).

**Membership.** ``k`` follows the published members, so a departed member never blocks a
buffer (a member that died between its ticket and its post costs the aggregator one store
timeout for that slot; a claim whose owner left the latest epoch before publishing is taken
over by the first waiter that sees it, with ``compare_set``, and the buffer aggregated
again). A newer epoch (a newcomer) is joined when each member next reports or waits: that
join is a barrier of the job (the slowest member arrives within one of its phases), after
which every member adopts the newest version again.
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import Store

from stalwart.elastic.events import EventKind
from stalwart.elastic.ledger import StepLedger
from stalwart.elastic.outer_rules import Buffered, Pending, assign_h, combine, delayed_nesterov
from stalwart.elastic.protocol import decode, keys
from stalwart.errors import ConfigError, DistributedError

__all__ = ["AsyncOuter", "Buffered", "DiLoCoModels", "combine"]

_KEEP = 16  # versions kept on the store
_WAIT = timedelta(seconds=0.05)  # between membership and buffer checks while waiting


@dataclass(frozen=True)
class DiLoCoModels:
    """What buffered DiLoCo reads and writes of its member (see :class:`~stalwart.elastic.DiLoCo`).

    Attributes:
        local: this member's own model (its float buffers are posted with each phase).
        global_model: the replicated global model.
        global_params: ``global_model``'s parameters, in order.
        outer: the outer optimizer over ``global_params``.
        h: inner steps per outer step.
        pseudo_gradient: ``θ_global - θ_local`` per parameter, computed now.
    """

    local: nn.Module
    global_model: nn.Module
    global_params: list[torch.Tensor]
    outer: torch.optim.Optimizer
    h: int
    pseudo_gradient: Callable[[], list[torch.Tensor]]


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=False)


class AsyncOuter:
    """The store side of buffered asynchronous DiLoCo for one member.

    Args:
        ledger: the member's job ledger (membership, events, reconfiguration).
        models: the DiLoCo models and outer optimizer the buffer reads and writes.
        mode: the buffer's settings.

    Raises:
        ConfigError: not under ``stalwart run`` (the buffer needs the coordinator).
    """

    def __init__(self, ledger: StepLedger, models: DiLoCoModels, mode: Buffered) -> None:
        membership = ledger.membership
        if membership is None:
            raise ConfigError(
                "DiLoCo(mode=Buffered(...)) needs the coordinator's store: run the script "
                "with `stalwart run`, or use the synchronous mode (mode=None)"
            )
        self.ledger, self.models, self.mode, self.membership = ledger, models, mode, membership
        self.version = 0  # the version the global model holds
        self.assigned_h = models.h
        self.bytes_received = 0  # the versions read from the store
        self._pending = Pending()  # delayed Nesterov's round in progress (outer_rules)
        self.wid = membership.wid
        self._timeout_s = self.store.timeout.total_seconds()  # type: ignore[attr-defined]  # missing from the stub

    @property
    def store(self) -> Store:
        """The coordinator's store (read each time: membership may follow a new one)."""
        return self.membership.store

    # -- versions ---------------------------------------------------------------------------

    def latest(self) -> int:
        """The newest published version (0: none yet)."""
        return int(self.store.get("diloco/version")) if self.store.check(["diloco/version"]) else 0

    def start(self) -> None:
        """A member (a newcomer too) starts from the newest version."""
        self.adopt(self.latest(), force=True)

    def adopt(self, v: int, *, force: bool = False) -> dict[str, Any] | None:
        """Load version ``v`` into the global model and outer optimizer; returns its record."""
        if v == 0 or (v == self.version and not force):
            self.version = max(self.version, v)
            return None
        raw = self.store.get(f"diloco/r{v}")
        self.bytes_received += len(raw)
        rec: dict[str, Any] = _loads(raw)
        with torch.no_grad():
            for g, t in zip(self.models.global_params, rec["params"], strict=True):
                g.copy_(t)
            floats = [b for b in self.models.global_model.buffers() if b.is_floating_point()]
            for b, t in zip(floats, rec["buffers"], strict=True):
                b.copy_(t)
        self.models.outer.load_state_dict(rec["outer"])
        self._pending = Pending.from_state(rec.get("pending"))
        self.version = v
        self._take_assignment(rec)
        return rec

    def _take_assignment(self, rec: dict[str, Any]) -> None:
        """This member's inner steps for its next phase, from a version's record."""
        mine = rec["assign"].get(self.wid, self.models.h)
        self.assigned_h = mine if self.mode.compute_aware_for(self._members()) else self.models.h

    def _member_ids(self) -> list[int]:
        epoch = self.membership.latest_epoch()
        return list(decode(self.store.get(keys.members(epoch)))) if epoch else [self.wid]

    def _members(self) -> int:
        return len(self._member_ids())

    def _rates(self) -> dict[int, float]:
        """The latest seconds per inner step of each current member that reported one."""
        found = {}
        for wid in self._member_ids():
            key = f"diloco/rate/{wid}"
            if self.store.check([key]):
                found[wid] = float(self.store.get(key))
        return found

    def _follow_membership(self) -> None:
        """Join a newer published epoch (a barrier of the job), then adopt the newest version."""
        if self.membership.latest_epoch() > self.ledger.epoch.number:
            self.ledger.reconfigure()  # the heal may overwrite the global model: adopt again
            self.adopt(max(self.latest(), self.version), force=True)

    # -- reporting a phase ------------------------------------------------------------------

    def report(self, deltas: list[torch.Tensor], h_done: int, seconds: float) -> None:
        """Post this phase's pseudo-gradient to the open buffer and move to a newer version."""
        base = self.version
        buffers = [b.detach().clone() for b in self.models.local.buffers() if b.is_floating_point()]
        part = {"wid": self.wid, "base": base, "h": h_done, "rate": seconds / max(h_done, 1),
                "deltas": deltas, "buffers": buffers}  # fmt: skip
        # every phase's speed is published, dropped or not: the slowest needs assigning most
        self.store.set(f"diloco/rate/{self.wid}", str(part["rate"]))
        rel = base  # the version part["deltas"] is relative to
        while True:
            self._follow_membership()
            v = self.latest()
            if v - base > self.mode.staleness:
                self._event(EventKind.DILOCO_DROPPED, base=base, version=v, h=h_done)
                self.adopt(v)
                return
            if v > rel and self.mode.delayed(self._members()):
                self.adopt(v)  # restate a stale phase relative to version v: θ_v - θ_local
                part["deltas"], rel = self.models.pseudo_gradient(), v
            ticket = self.store.add(f"diloco/b{v}/n", 1)
            self.store.set(f"diloco/b{v}/g{ticket}", _dumps({**part, "ticket": ticket}))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
            self._maybe_aggregate(v)
            self._event(EventKind.DILOCO_REPORT, base=base, buffer=v, ticket=ticket, h=h_done)
            if v > base:  # stale: never wait, the newest version is already there
                self.adopt(self.latest())
                return
            self._wait_newer(base)
            self.adopt(self.latest())
            if self._included(v, ticket):
                return
            # left out of buffer v (arrived after its claim): post again into the next one

    def _wait_newer(self, base: int) -> None:
        deadline = time.monotonic() + self._timeout_s
        while self.latest() <= base:
            self._follow_membership()
            self._maybe_aggregate(self.latest())
            if time.monotonic() > deadline:
                raise DistributedError(
                    f"worker {self.wid}: no DiLoCo version after {base} within "
                    f"{self._timeout_s:.0f} s; fewer than k members are reporting (raise "
                    "--timeout, or lower Buffered(k=...))"
                )
            # blocks on the store until the next version is posted; after _WAIT without it,
            # check membership and the buffer again
            with contextlib.suppress(RuntimeError):
                self.store.wait([f"diloco/r{base + 1}"], _WAIT)

    def finish(self, outer_steps: int | None) -> None:
        """Wait for version ``outer_steps`` (default: the newest) and adopt exactly it."""
        target = self.latest() if outer_steps is None else outer_steps
        if self.latest() < target:
            self._wait_newer(target - 1)
        self.adopt(target, force=True)

    def _event(self, kind: EventKind, **fields: Any) -> None:
        self.ledger.events.write(kind, worker=self.wid, **fields)

    # -- aggregating a buffer ---------------------------------------------------------------

    def _maybe_aggregate(self, v: int) -> None:
        """Claim and aggregate buffer ``v`` if it holds ``k`` contributions and nobody has.

        A claim whose owner is no longer a member of the latest epoch (it died before
        publishing) is taken over: ``compare_set`` against the claim's value, so exactly one
        member takes it.
        """
        n, members = self.store.add(f"diloco/b{v}/n", 0), self._member_ids()
        if n < self.mode.k_for(len(members)) or self.latest() > v:
            return
        key, mine = f"diloco/b{v}/claim", f"{self.wid}:{n}"
        held = bytes(self.store.compare_set(key, "", mine)).decode()
        if held != mine:
            owner = int(held.split(":")[0])
            if owner in members or self.latest() > v:
                return  # another member claimed it and is aggregating (or has published)
            if bytes(self.store.compare_set(key, held, mine)).decode() != mine:
                return  # another member took the departed claimer's buffer over first
            self._event(EventKind.DILOCO_TAKEOVER, buffer=v, departed=owner)
        self._aggregate(v, n)

    def _included(self, v: int, ticket: int) -> bool:
        key = f"diloco/r{v + 1}"
        if not self.store.check([key]):
            return True  # already forgotten: long ago, count it as used
        used = _loads(self.store.get(key))["used"]
        return any(u["wid"] == self.wid and u["ticket"] == ticket for u in used)

    def _parts(self, v: int, n: int) -> list[dict[str, Any]]:
        """Contributions 1..n of buffer ``v``; a slot never posted (its member died) is skipped."""
        parts = []
        for t in range(1, n + 1):
            key = f"diloco/b{v}/g{t}"
            try:
                self.store.wait([key], timedelta(seconds=self._timeout_s))
            except RuntimeError:
                self._event(EventKind.DILOCO_MISSING, buffer=v, ticket=t)
                continue
            parts.append(_loads(self.store.get(key)))
        return parts

    def _aggregate(self, v: int, n: int) -> None:
        """Make version v+1 from buffer v's first ``n`` contributions and publish it."""
        parts = self._parts(v, n)
        fresh = [p for p in parts if v - p["base"] <= self.mode.staleness]
        self.adopt(v)  # the aggregator steps from version v exactly
        rates = self._rates()
        weights: list[float] = []
        moved = 0  # momentum updates (1, except delayed Nesterov: 0 mid-round, 2 for > N parts)
        if fresh:
            deltas, weights = combine(fresh, v, self.models.h)
            moved = self._step(deltas, len(fresh))
            floats = [b for b in self.models.global_model.buffers() if b.is_floating_point()]
            with torch.no_grad():
                for j, b in enumerate(floats):
                    b.copy_(torch.stack([p["buffers"][j] for p in fresh]).mean(0).to(b.dtype))
        used = [{"wid": p["wid"], "ticket": p["ticket"], "base": p["base"], "h": p["h"],
                 "weight": w} for p, w in zip(fresh, weights, strict=True)]  # fmt: skip
        rec = {
            "version": v + 1,
            "params": [g.detach().clone() for g in self.models.global_params],
            "buffers": [b.detach().clone() for b in self.models.global_model.buffers()
                        if b.is_floating_point()],
            "outer": self.models.outer.state_dict(),
            "pending": self._pending.state_dict(),
            "used": used,
            "dropped": [p["wid"] for p in parts if p not in fresh],
            "assign": assign_h(rates, self.models.h, self.mode.h_min),
        }  # fmt: skip
        if bytes(self.store.get(f"diloco/b{v}/claim")).decode() != f"{self.wid}:{n}":
            self.adopt(v, force=True)  # taken over (this member was left out): undo the step
            return
        self.store.set(f"diloco/r{v + 1}", _dumps(rec))  # type: ignore[arg-type]  # the stub says str; bytes are accepted
        self.store.set("diloco/version", str(v + 1))
        self.version = v + 1
        self._take_assignment(rec)  # the aggregator adopts its own version without reading it
        self._event(EventKind.DILOCO_AGGREGATE, version=v + 1, used=used, dropped=rec["dropped"],
                    momentum=moved, assign=rec["assign"], members=self._members())  # fmt: skip
        self._forget(v + 1 - _KEEP)

    def _step(self, deltas: list[torch.Tensor], used: int) -> int:
        """The outer step of one version: the optimizer's own, or delayed Nesterov (k < N).

        Returns:
            How many times the momentum was updated.
        """
        members = self._members()
        params = self.models.global_params
        if not self.mode.delayed(members):
            self._pending = Pending()
            for g, dlt in zip(params, deltas, strict=True):
                g.grad = dlt
            self.models.outer.step()
            self.models.outer.zero_grad(set_to_none=True)
            return 1
        group, state = self.models.outer.param_groups[0], self.models.outer.state
        bufs = [state[g].get("momentum_buffer") for g in params]
        mass = used / members  # a member may post two phases into one buffer: > 1
        moved = delayed_nesterov(params, deltas, bufs, self._pending, mass=mass,
                                 lr=group["lr"], beta=group["momentum"])  # fmt: skip
        for g, b in zip(params, bufs, strict=True):
            if b is not None:
                state[g]["momentum_buffer"] = b
        return moved

    def _forget(self, old: int) -> None:
        if old < 1:
            return
        n = self.store.add(f"diloco/b{old}/n", 0)
        for key in [f"diloco/r{old}", f"diloco/b{old}/n", f"diloco/b{old}/claim"] + [
            f"diloco/b{old}/g{t}" for t in range(1, n + 1)
        ]:
            self.store.delete_key(key)
