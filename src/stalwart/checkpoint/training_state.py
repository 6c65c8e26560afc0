"""TrainingState: everything a training loop needs saved so that a resume is exact.

A resumed run reproduces the uninterrupted one bit for bit only if *all* of its state comes
back: parameters, buffers, optimizer moments, the LR schedule, the caller's counters, other
stateful objects (a data sampler) and every RNG that decides something. :class:`TrainingState`
bundles them into one stateful object that :class:`stalwart.Checkpointer` saves and loads::

    ts = TrainingState(model=model, optimizer=opt, scheduler=sched, extra={"step": 0},
                       generators={"data": loader_generator}, stateful={"sampler": sampler})
    ckpt.save(step, {"train": ts})
    ckpt.load({"train": ts})          # restores all of the above in place

Its ``state_dict()`` holds only plain trees (tensors, numbers, strings), never pickled
objects::

    {"model": ..., "optimizer": ..., "scheduler": ..., "extra": {...},
     "stateful": {name: obj.state_dict()},
     "rng": {"rank<r>": {"torch": uint8 tensor, "cuda": [uint8 tensors] (if CUDA),
                         "numpy": {"name", "keys" (int64 tensor), "pos", "has_gauss",
                                   "cached_gaussian"},
                         "python": {"version", "state" (int64 tensor), "gauss_next"},
                         "generators": {name: uint8 tensor}}}}

RNG state is per rank, keyed by ``rank=`` (default: ``torch.distributed.get_rank()``, 0 when
not distributed). A rank with no entry of its own (the job restarted with more ranks) logs a
warning and *derives* its state from rank 0's: the global generators are reseeded from rank
0's saved torch state and the rank (blake2b), deterministic and different per rank; the named
``generators`` take rank 0's states unchanged (data order is normally shared by all ranks),
also with ``strict=True`` (the checkpointer leaves missing keys to ``load_state_dict``).
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from stalwart.checkpoint.fqn_state import fqn_state_dicts, set_fqn_state_dicts
from stalwart.errors import StateMismatchError

__all__ = ["TrainingState"]

logger = logging.getLogger(__name__)


def _current_rank() -> int:
    """This process's rank in the default process group, or 0 when not distributed."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _rank_key(rank: int) -> str:
    return f"rank{rank}"


def _capture_rng(generators: Mapping[str, torch.Generator]) -> dict[str, Any]:
    """Snapshot every RNG this process uses; returns fresh tensors (never live state)."""
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state(legacy=True)
    py_version, py_state, py_gauss = random.getstate()
    entry: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "name": str(np_name),
            # uint32 words; int64 holds them exactly and is a dtype every store supports.
            "keys": torch.from_numpy(np.asarray(np_keys, dtype=np.int64)),
            "pos": int(np_pos),
            "has_gauss": int(np_has_gauss),
            "cached_gaussian": float(np_cached),
        },
        "python": {
            "version": int(py_version),
            "state": torch.tensor(py_state, dtype=torch.int64),  # 624 words + position
            "gauss_next": None if py_gauss is None else float(py_gauss),
        },
    }
    if torch.cuda.is_available():
        entry["cuda"] = list(torch.cuda.get_rng_state_all())
    if generators:
        entry["generators"] = {name: g.get_state() for name, g in generators.items()}
    return entry


def _as_uint8_cpu(value: Any, what: str) -> torch.Tensor:
    if isinstance(value, np.ndarray):
        value = torch.from_numpy(value)
    if not isinstance(value, torch.Tensor):
        raise StateMismatchError(
            f"RNG state {what!r} should be a uint8 tensor, found {type(value).__name__}; "
            "the checkpoint was not written by TrainingState"
        )
    return value.detach().to(device="cpu", dtype=torch.uint8).contiguous()


def _as_int_list(value: Any) -> list[int]:
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return [int(v) for v in value.tolist()]
    return [int(v) for v in value]


def _restore_rng(entry: Mapping[str, Any], generators: Mapping[str, torch.Generator]) -> None:
    """Set every RNG from a snapshot taken by :func:`_capture_rng`."""
    torch.set_rng_state(_as_uint8_cpu(entry["torch"], "torch"))
    if "cuda" in entry:
        states = entry["cuda"]
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            if len(states) != count:
                logger.warning(
                    "checkpoint holds CUDA RNG states for %d devices, this process sees %d; "
                    "restoring the first %d",
                    len(states),
                    count,
                    min(len(states), count),
                )
            for device, state in enumerate(states[:count]):
                torch.cuda.set_rng_state(_as_uint8_cpu(state, "cuda"), device)
        else:
            logger.warning("checkpoint holds CUDA RNG states but CUDA is not available; skipped")
    if "numpy" in entry:
        npst = entry["numpy"]
        keys = np.asarray(_as_int_list(npst["keys"]), dtype=np.int64).astype(np.uint32)
        np.random.set_state(
            (
                str(npst["name"]),
                keys,
                int(npst["pos"]),
                int(npst["has_gauss"]),
                float(npst["cached_gaussian"]),
            )
        )
    if "python" in entry:
        pyst = entry["python"]
        gauss = pyst["gauss_next"]
        random.setstate(
            (
                int(pyst["version"]),
                tuple(_as_int_list(pyst["state"])),
                None if gauss is None else float(gauss),
            )
        )
    _restore_generators(entry.get("generators") or {}, generators)


def _restore_generators(
    saved: Mapping[str, Any], generators: Mapping[str, torch.Generator]
) -> None:
    for name, gen in generators.items():
        if name not in saved:
            logger.warning("generator %r has no saved state in the checkpoint; left as it is", name)
            continue
        gen.set_state(_as_uint8_cpu(saved[name], f"generators.{name}"))


def _derived_seed(rank0_torch_state: Any, rank: int) -> int:
    """A 63-bit seed that depends only on rank 0's saved torch RNG state and the rank."""
    data = _as_uint8_cpu(rank0_torch_state, "torch").numpy().tobytes()
    digest = hashlib.blake2b(data + f"|stalwart-rank{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _reseed_from_rank0(
    rank0: Mapping[str, Any], rank: int, generators: Mapping[str, torch.Generator]
) -> None:
    """Deterministic RNG state for a rank the checkpoint has no entry for (see module doc)."""
    seed = _derived_seed(rank0["torch"], rank)
    torch.manual_seed(seed)  # also seeds every CUDA device
    np.random.seed(seed % 2**32)
    random.seed(seed)
    _restore_generators(rank0.get("generators") or {}, generators)


class TrainingState:
    """The whole state of a training loop, as one stateful object for the checkpointer.

    Every part is optional; absent parts are simply not saved. The object keeps references
    to the live model, optimizer, scheduler, ``extra`` dict and generators, so
    :meth:`load_state_dict` restores them in place and the training loop carries on with the
    same objects.

    Args:
        model: module whose ``state_dict()`` (parameters and buffers) is saved.
        optimizer: optimizer whose state (moments, step counts) and param groups are saved.
            A freshly built optimizer with empty state loads fine.
        scheduler: learning-rate scheduler.
        extra: the caller's own small values (step, epoch, best metric, tensors). It is
            updated in place on load, so keep using the same dict object.
        rng: save and restore the global torch, CUDA, numpy and Python RNGs of this rank.
        generators: further generators by name (a data loader's or sampler's
            ``torch.Generator``), saved with the RNG state of this rank.
        stateful: other objects with ``state_dict()``/``load_state_dict()`` of plain values,
            by name (an ``ElasticSampler``, a loader, an EMA); restored in place.
        rank: this process's RNG entry (None: ``torch.distributed``'s rank, else 0).
        fqn_optimizer_state: build model and optimizer state with
            ``torch.distributed.checkpoint.state_dict.get_state_dict`` (restore with
            ``set_state_dict``): optimizer state keyed by parameter FQN, not by index, so
            pipeline stages and multi-part models do not collide and FSDP2/TP state is
            saved sharded. ``model`` and ``optimizer`` may then be lists of parts
            (``model[i]`` is optimized by ``optimizer[i]``), as in torchtitan.

    Example:
        >>> ts = TrainingState(model=model, optimizer=opt, extra={"step": 0})
        >>> ckpt.save(step, {"train": ts})
        >>> ckpt.load({"train": ts})  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: Optimizer | Sequence[Optimizer] | None = None,
        scheduler: LRScheduler | None = None,
        extra: dict[str, Any] | None = None,
        rng: bool = True,
        generators: Mapping[str, torch.Generator] | None = None,
        stateful: Mapping[str, Any] | None = None,
        rank: int | None = None,
        fqn_optimizer_state: bool = False,
    ) -> None:
        self.fqn_optimizer_state = fqn_optimizer_state
        if fqn_optimizer_state and (model is None) != (optimizer is None):
            raise ValueError(
                "fqn_optimizer_state=True keys optimizer state by the model's parameter names, "
                "so it needs both model= and optimizer= (lists of the same length for parts)"
            )
        if not fqn_optimizer_state and isinstance(model, (list, tuple)):
            raise ValueError(
                "a list of model parts needs fqn_optimizer_state=True (optimizer state keyed "
                "by parameter FQN, so the parts do not collide)"
            )
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.extra, self.rng = extra, rng
        self.generators: dict[str, torch.Generator] = dict(generators or {})
        self.stateful: dict[str, Any] = dict(stateful or {})
        for name, obj in self.stateful.items():
            if not all(callable(getattr(obj, f, None)) for f in ("state_dict", "load_state_dict")):
                raise ValueError(
                    f"TrainingState(stateful={{{name!r}: {type(obj).__name__}}}) "
                    "needs state_dict() and load_state_dict(); plain values: extra="
                )
        self.rank = rank
        if self.generators and not rng:
            logger.warning(
                "TrainingState(rng=False) ignores the %d generators given", len(self.generators)
            )

    def __repr__(self) -> str:
        parts = [
            name
            for name in ("model", "optimizer", "scheduler", "extra")
            if getattr(self, name) is not None
        ]
        parts.extend(f"stateful.{name}" for name in self.stateful)
        if self.rng:
            parts.append("rng")
            parts.extend(f"generators.{name}" for name in self.generators)
        return f"TrainingState({', '.join(parts)})"

    def state_dict(self) -> dict[str, Any]:
        """Return the state tree; model and optimizer tensors are the live ones (not copies).

        RNG states are fresh tensors taken at call time, under this rank's key only.
        """
        sd: dict[str, Any] = {}
        if self.fqn_optimizer_state and self.model is not None:
            sd["model"], sd["optimizer"] = fqn_state_dicts(self.model, self.optimizer)
        elif self.model is not None:
            sd["model"] = cast(nn.Module, self.model).state_dict()
        if self.optimizer is not None and not self.fqn_optimizer_state:
            sd["optimizer"] = cast(Optimizer, self.optimizer).state_dict()
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        if self.extra is not None:
            sd["extra"] = dict(self.extra)
        if self.stateful:
            sd["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        if self.rng:
            sd["rng"] = {_rank_key(self._rank()): _capture_rng(self.generators)}
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> None:
        """Restore every part this object holds from ``state_dict``.

        Parts in ``state_dict`` that this object does not hold are ignored. The optimizer
        may be fresh (empty state): its state is taken from the loaded tensors. ``strict``
        is the model's, as in ``nn.Module.load_state_dict``.

        Raises:
            StateMismatchError: a part this object holds is missing from ``state_dict``, or
                (``strict``, ``fqn_optimizer_state``) model keys differ.
        """
        for name in ("model", "optimizer", "scheduler", "extra"):
            if getattr(self, name) is not None and name not in state_dict:
                raise StateMismatchError(
                    f"TrainingState holds {name!r} but the loaded state has no {name!r} entry "
                    f"(found {sorted(state_dict)}); build the TrainingState with the same "
                    "parts that were saved, or pass that part as None"
                )
        if self.fqn_optimizer_state and self.model is not None:
            set_fqn_state_dicts(self.model, self.optimizer, state_dict, strict)
        elif self.model is not None:
            cast(nn.Module, self.model).load_state_dict(state_dict["model"], strict=strict)
        if self.optimizer is not None and not self.fqn_optimizer_state:
            cast(Optimizer, self.optimizer).load_state_dict(state_dict["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])
        if self.extra is not None:
            loaded = dict(state_dict["extra"])  # copy first: it may be self.extra itself
            self.extra.clear()
            self.extra.update(loaded)
        self._load_stateful(state_dict.get("stateful") or {})
        if self.rng:
            self._load_rng(state_dict.get("rng"))

    def _rank(self) -> int:
        return self.rank if self.rank is not None else _current_rank()

    def _load_stateful(self, saved: Mapping[str, Any]) -> None:
        missing = sorted(set(self.stateful) - set(saved))
        if missing:
            raise StateMismatchError(
                f"TrainingState holds stateful objects {missing} that the loaded state lacks "
                f"(found {sorted(saved)}); build it with the objects that were saved"
            )
        for name, obj in self.stateful.items():
            obj.load_state_dict(saved[name])

    def _load_rng(self, saved: Mapping[str, Any] | None) -> None:
        if not saved:
            logger.warning("the loaded state holds no RNG state; RNGs left as they are")
            return
        rank = self._rank()
        entry = saved.get(_rank_key(rank))
        if entry is not None:
            _restore_rng(entry, self.generators)
            return
        rank0 = saved.get(_rank_key(0))
        if rank0 is None:
            raise StateMismatchError(
                f"the loaded RNG state has neither this rank's entry {_rank_key(rank)!r} nor "
                f"rank 0's (found {sorted(saved)}); it was not written by TrainingState"
            )
        logger.warning(
            "no saved RNG state for rank %d (the job has more ranks than when it was saved); "
            "reseeding it deterministically from rank 0's state",
            rank,
        )
        _reseed_from_rank0(rank0, rank, self.generators)
