"""DiLoCo: H local inner steps, then one outer step on the members' averaged pseudo-gradient.

After Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language Models"
(arXiv 2311.08455). Every member trains its own copy of the model with its own *inner*
optimizer for ``H`` steps without communicating; then the members average their
*pseudo-gradients* ``Δ = θ_global - θ_local`` and an *outer* optimizer (Nesterov SGD, the
paper's lr 0.7, momentum 0.9) steps the global parameters with that average; every member
restarts its inner phase from the new global parameters. One exchange every ``H`` steps
instead of one per step: ``H`` times fewer bytes than data parallelism.

**On the elastic job.** The *replicated* state is the global model and the outer optimizer
(``TrainingState(model=global, optimizer=outer, rng=False)``); the local model and the inner
optimizer's state are each member's own. An outer step is one commit of
:class:`~stalwart.elastic.Job`: the pseudo-gradient is written into the global parameters'
``.grad`` and the job's all-reduce averages it (votes, change flag, discard, heal and digest
parity all as for a data-parallel step). So:

* a member that joins gets the global state from a live member (the job's heal) and starts
  its inner phase from it; membership changes only between outer steps (a newcomer waits up
  to one inner phase, so keep a phase shorter than the gloo timeout);
* a member that dies makes the outer all-reduce fail on the survivors: they discard it,
  join the next epoch, and **retry the same outer step with the same pseudo-gradients**, so
  nothing is lost but the departed member's inner steps; if some survivors had committed
  (the ring finished on them), the others are rolled forward by the heal, whose result
  already contains their contribution, and do not retry.

The buffered asynchronous mode (``mode=Buffered(...)``) replaces the all-reduce by the
coordinator's store: see :mod:`stalwart.elastic.async_outer`.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from stalwart.checkpoint.training_state import TrainingState
from stalwart.elastic.async_outer import AsyncOuter, Buffered, DiLoCoModels
from stalwart.elastic.job import Job
from stalwart.errors import ConfigError, DistributedError

__all__ = ["DiLoCo", "Nesterov"]

_RETRIES = 8  # outer-step attempts (each after a membership change) before giving up

Listener = Callable[[str, int], None]


@dataclass(frozen=True, kw_only=True)
class Nesterov:
    """The outer optimizer: SGD with Nesterov momentum (DiLoCo's defaults).

    Attributes:
        lr: outer learning rate (the paper: 0.7).
        momentum: outer momentum (the paper: 0.9).
    """

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if self.lr <= 0 or not 0 <= self.momentum < 1:
            raise ConfigError(f"{self}: need lr > 0 and 0 <= momentum < 1")

    def build(self, params: Any) -> torch.optim.Optimizer:
        """The torch optimizer over ``params``."""
        nesterov = self.momentum > 0  # torch refuses Nesterov without momentum
        return torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, nesterov=nesterov)


class DiLoCo:
    """Train ``model`` with ``inner`` locally and sync every ``h`` inner steps.

    Args:
        model: this member's model (trained locally between outer steps).
        inner: the inner optimizer over ``model``'s parameters (its state stays local).
        h: inner steps per outer step (the paper: 500; small models: 20-100).
        outer: the outer optimizer.
        mode: None for synchronous outer steps over the job's all-reduce, or
            :class:`~stalwart.elastic.async_outer.Buffered` for the asynchronous buffer.
        **job_options: passed to :class:`~stalwart.elastic.Job` (``min_size``,
            ``verify_every``, ``join_timeout_s``, ``stats_window``).

    Example:
        >>> diloco = DiLoCo(model, torch.optim.AdamW(model.parameters()), h=50)  # doctest: +SKIP
        >>> while diloco.outer_step < 100:
        ...     inner.zero_grad()
        ...     loss_fn(model(batch(diloco.inner_steps, diloco.rank))).backward()
        ...     diloco.step()  # the inner step; every h-th also the outer step
        >>> diloco.close()
    """

    def __init__(
        self,
        model: nn.Module,
        inner: torch.optim.Optimizer,
        *,
        h: int = 50,
        outer: Nesterov | None = None,
        mode: Buffered | None = None,
        **job_options: Any,
    ) -> None:
        if h < 1:
            raise ConfigError(f"DiLoCo(h={h}): the number of inner steps must be >= 1")
        self.model, self.inner, self.h = model, inner, h
        self.global_model = copy.deepcopy(model).requires_grad_(True)
        self.outer = (outer or Nesterov()).build(self.global_model.parameters())
        state = TrainingState(model=self.global_model, optimizer=self.outer, rng=False)
        self.job = Job(state, **job_options)
        if self.job.group_size > 1:
            raise ConfigError(
                f"DiLoCo under replica groups of {self.job.group_size}: DiLoCo replicates the "
                "whole model on each member; run it with --group-size 1"
            )
        self._outer = self.job.optimizer(self.outer)
        self.job.data_parallel(self.global_model)  # float buffers are averaged too
        self._local = list(model.parameters())
        self.global_params: list[torch.Tensor] = list(self.global_model.parameters())
        self._listeners: list[Listener] = []
        self.inner_steps = 0  # inner steps done by this member since it started
        self._in_phase = 0
        self._phase_t0 = time.perf_counter()
        self.bytes_sent = 0  # pseudo-gradient bytes this member contributed
        self._received = 0  # the averaged results of synchronous outer steps
        models = DiLoCoModels(
            local=model, global_model=self.global_model, global_params=self.global_params,
            outer=self.outer, h=h, pseudo_gradient=self.pseudo_gradient,
        )  # fmt: skip
        self._async = AsyncOuter(self.job.ledger, models, mode) if mode is not None else None
        if self._async is not None:
            self._async.start()
        self._adopt_global()

    # -- what the training loop reads -------------------------------------------------------

    @property
    def outer_step(self) -> int:
        """Outer steps applied to the global model (the buffer's version in async mode)."""
        return self._async.version if self._async is not None else self.job.step

    @property
    def bytes_received(self) -> int:
        """Bytes of outer results received: the averaged pseudo-gradients (an all-reduce:
        as much back as sent), in async mode the versions read from the store."""
        return self._async.bytes_received if self._async is not None else self._received

    @property
    def rank(self) -> int:
        """This member's rank in the current membership epoch."""
        return self.job.rank

    @property
    def size(self) -> int:
        """Number of members in the current epoch."""
        return self.job.size

    @property
    def phase_steps(self) -> int:
        """Inner steps of the current phase before this member reports (``h``, or the
        compute-aware assignment in async mode)."""
        return self._async.assigned_h if self._async is not None else self.h

    def add_listener(self, fn: Listener) -> None:
        """Call ``fn("step-begin" | "collective-enter", inner_steps)`` before each inner step.

        So :func:`stalwart.testing.chaos.install` slows (``Delay``) or kills a member at an
        inner step.
        """
        self._listeners.append(fn)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> None:
        """One inner step (``inner.step()``); after ``phase_steps`` of them, the outer step."""
        for fn in self._listeners:
            fn("step-begin", self.inner_steps)
            fn("collective-enter", self.inner_steps)
        self.inner.step()
        self.inner_steps += 1
        self._in_phase += 1
        if self._in_phase >= self.phase_steps:
            self._outer_step()

    def _outer_step(self) -> None:
        seconds = time.perf_counter() - self._phase_t0
        deltas = self.pseudo_gradient()
        self.bytes_sent += sum(d.numel() * d.element_size() for d in deltas)
        if self._async is not None:
            self._async.report(deltas, self._in_phase, seconds)
        else:
            self._sync(deltas)
            self._received = self.bytes_sent  # an all-reduce: as much back as sent
        self._adopt_global()

    def pseudo_gradient(self) -> list[torch.Tensor]:
        """``θ_global - θ_local`` per parameter (the outer optimizer's gradient)."""
        with torch.no_grad():
            return [
                g.detach() - p.detach()
                for g, p in zip(self.global_params, self._local, strict=True)
            ]

    def _sync(self, deltas: list[torch.Tensor]) -> None:
        """The synchronous outer step: one job commit, retried after a membership change."""
        for _ in range(_RETRIES):
            before = self.job.step
            self._outer.zero_grad()  # the job's boundary: a due epoch change and heal
            if self.job.step > before:
                return  # healed forward: that commit already holds our contribution
            self._copy_buffers(self.model, self.global_model)
            for g, d in zip(self.global_params, deltas, strict=True):
                g.grad = d.clone()
            self._outer.step()
            if self.job.step > before:
                return
        raise DistributedError(
            f"the outer step {self.job.step} was discarded {_RETRIES} times in a row; "
            "members keep failing: check the events folder for the faults"
        )

    def _adopt_global(self) -> None:
        """Restart the inner phase from the global parameters."""
        with torch.no_grad():
            for p, g in zip(self._local, self.global_params, strict=True):
                p.copy_(g)
        self._copy_buffers(self.global_model, self.model)
        self._in_phase = 0
        self._phase_t0 = time.perf_counter()

    @staticmethod
    def _copy_buffers(src: nn.Module, dst: nn.Module) -> None:
        with torch.no_grad():
            for s, d in zip(src.buffers(), dst.buffers(), strict=True):
                if d.is_floating_point():
                    d.copy_(s)

    def close(self, outer_steps: int | None = None) -> None:
        """Leave the job with the same global state as every other member.

        Args:
            outer_steps: async mode: the version every member ends on (default: the latest
                when this member closes; give the loop's bound so that all members agree).
        """
        if self._async is not None:
            self._async.finish(outer_steps)
            self._adopt_global()
        self.job.close()
