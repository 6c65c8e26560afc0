"""The reference-model record and the registry that builds, trains and caches them.

A reference model is trained in seconds on CPU from data the code generates or a package
ships, deterministically (fixed seeds, one thread while training), so every run of a
campaign or benchmark sees the same weights. Built models are cached in memory; with
``cache_dir`` (or ``cache=True`` for the user cache folder) their weights are also kept
on disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from stalwart.errors import ConfigError, require
from stalwart.fingerprint import model_hash

__all__ = ["ReferenceModel", "available", "cache_folder", "load", "model_hash", "register"]

log = logging.getLogger(__name__)


@dataclass
class ReferenceModel:
    """A trained model with its evaluation data and the criteria that fit its output."""

    name: str
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    """Evaluation inputs: ``model(*inputs)`` gives the golden output."""
    labels: torch.Tensor
    criteria: tuple[str, ...]
    """Criteria that fit the output, the first being the default."""
    metric: str
    """``accuracy`` or ``auc``."""
    quality: float = 0.0
    """Golden value of ``metric`` on the evaluation inputs (set by :func:`load`)."""
    independent_samples: bool = True
    """False when one input's activations reach other outputs (GCN message passing)."""
    train_s: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def evaluate(self, model: nn.Module | None = None) -> float:
        """``metric`` of ``model`` (default: this one) on the evaluation inputs."""
        with torch.no_grad():
            out = (model or self.model)(*self.inputs)
        if self.metric == "auc":
            require("sklearn", "sdc", "the AUC metric")
            from sklearn.metrics import roc_auc_score

            score = torch.nan_to_num(out.reshape(-1).float(), nan=0.0, posinf=1e30, neginf=-1e30)
            return float(roc_auc_score(self.labels.numpy(), score.numpy()))
        return float((out.argmax(-1) == self.labels).float().mean())


Builder = Callable[[bool], ReferenceModel]
"""Builds the model and its data; trains it when the argument is True."""
_BUILDERS: dict[str, Builder] = {}
_CACHE: dict[str, ReferenceModel] = {}


def register(name: str) -> Callable[[Builder], Builder]:
    """Decorator adding a builder to the registry under ``name``."""

    def deco(fn: Builder) -> Builder:
        _BUILDERS[name] = fn
        return fn

    return deco


def available() -> list[str]:
    """Names of the reference models."""
    import importlib

    for module in ("digits", "dlrm", "gcn", "transformer"):  # importing registers them
        importlib.import_module(f"stalwart.models.{module}")

    return sorted(_BUILDERS)


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/stalwart/models`` (``~/.cache/stalwart/models`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "stalwart" / "models"


def load(
    name: str, *, cache: bool = False, cache_dir: str | os.PathLike[str] | None = None
) -> ReferenceModel:
    """Build (or fetch from cache) a trained reference model in eval mode.

    Args:
        name: one of :func:`available` (``digits-cnn``, ``mlp``, ``dlrm``, ``gcn``,
            ``transformer``).
        cache: also keep weights on disk under :func:`cache_folder`.
        cache_dir: keep weights on disk here (implies ``cache``).
    """
    names = available()
    if name not in _BUILDERS:
        raise ConfigError(f"no reference model {name!r}; choose one of {', '.join(names)}")
    if name in _CACHE:
        return _CACHE[name]
    folder = Path(cache_dir) if cache_dir is not None else (cache_folder() if cache else None)
    t0 = time.perf_counter()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # same float sums on every machine: deterministic training
    try:
        path = folder / f"{name}-v1.pt" if folder else None
        if path is not None and path.is_file():
            ref = _BUILDERS[name](False)
            ref.model.load_state_dict(torch.load(path, weights_only=True))
        else:
            ref = _BUILDERS[name](True)
            if path is not None:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                torch.save(ref.model.state_dict(), tmp)
                tmp.replace(path)
    finally:
        torch.set_num_threads(threads)
    ref.model.eval()
    ref.quality = ref.evaluate()
    ref.train_s = time.perf_counter() - t0
    log.info("reference model %s ready in %.1f s", name, ref.train_s)
    _CACHE[name] = ref
    return ref
