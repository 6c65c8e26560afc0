"""Hugging Face pretrained folders: a step's model as a ``save_pretrained`` folder, and back.

:func:`export_pretrained` builds the model on the meta device from the config recorded in the
step's metadata (``hf.config``, ``hf.model_class``, written by
:class:`~stalwart.integrations.huggingface.StalwartCallback`), gives it the step's tensors and
saves it with its own ``save_pretrained``; :func:`import_pretrained` reads such a folder into a
step. Both are re-exported by :mod:`stalwart.integrations.huggingface`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.tools.export import load_subtree
from stalwart.errors import CheckpointNotFoundError, ConfigError, require

transformers = require("transformers", "huggingface", "stalwart.integrations.huggingface")

__all__ = ["CLASS_KEY", "CONFIG_KEY", "export_pretrained", "import_pretrained"]

CONFIG_KEY = "hf.config"
CLASS_KEY = "hf.model_class"


def _model_class(name: str | None, given: Any) -> Any:
    if given is not None:
        return given
    cls = getattr(transformers, name, None) if name else None
    if not (isinstance(cls, type) and hasattr(cls, "from_pretrained")):
        raise ConfigError(
            f"cannot tell which transformers class the checkpoint's model is ({name!r}); pass "
            "model_class=, e.g. export_pretrained(..., model_class=AutoModelForCausalLM)"
        )
    return cls


def export_pretrained(
    root: str | os.PathLike[str] | Checkpointer,
    out: str | os.PathLike[str],
    *,
    step: int | None = None,
    subtree: str | None = "model",
    model_class: Any = None,
    config: Any = None,
) -> Path:
    """Write ``step``'s model as a ``save_pretrained`` folder that ``from_pretrained`` loads.

    The model is built on the meta device from its config (no weights allocated twice), given
    the checkpoint's tensors, its tied weights re-tied, and saved by its own
    ``save_pretrained``: safetensors, ``config.json``, shared weights stored once.

    Args:
        root: the stalwart root (or its Checkpointer).
        out: the folder to write.
        step: the step; the newest when None.
        subtree: the path of the model's state dict in the tree (``model`` for
            :class:`StalwartCallback` and ``TrainingState``); None when the step is the bare
            state dict.
        model_class: the transformers class; read from the metadata (``hf.model_class``)
            when None.
        config: a ``PretrainedConfig``; read from the metadata (``hf.config``) when None.

    Raises:
        ConfigError: the subtree is not a model's state dict (a whole training state, say),
            or the class or config is unknown.
    """
    ck = root if isinstance(root, Checkpointer) else Checkpointer(root)
    try:
        step = ck.latest_step() if step is None else step
        if step is None:
            raise CheckpointNotFoundError(
                f"no committed checkpoint under {ck.url}; nothing to export"
            )
        weights = load_subtree(ck, step, subtree)
        meta = ck.manifest(step).metadata
    finally:
        if ck is not root:
            ck.close()
    cls = _model_class(meta.get(CLASS_KEY), model_class)
    if config is None:
        if CONFIG_KEY not in meta:
            raise ConfigError(f"step {step} records no model config; pass config=")
        config = transformers.AutoConfig.for_model(**json.loads(meta[CONFIG_KEY]))
    with torch.device("meta"):
        model = cls(config)
    model.load_state_dict(weights, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ConfigError(
            f"the checkpoint's model lacks {len(missing)} weights of {cls.__name__} "
            f"({missing[:5]}...); check subtree= and model_class="
        )
    model.save_pretrained(str(out))
    return Path(out)


def import_pretrained(
    folder: str | os.PathLike[str],
    root: str | os.PathLike[str] | Checkpointer,
    *,
    step: int,
    subtree: str = "model",
    overwrite: bool = False,
) -> int:
    """Save a ``save_pretrained`` folder's weights as ``step`` under ``subtree``.

    Reads ``model.safetensors`` or the shards of ``model.safetensors.index.json`` (no pickle)
    and keeps ``config.json`` in the metadata. Weights that ``save_pretrained`` leaves out
    because they are tied stay out: load with ``strict=False`` or re-tie after loading.
    ``overwrite=True`` replaces ``step`` when it is already committed.

    Returns:
        The number of tensors imported.

    Raises:
        StepExistsError: ``step`` is committed and ``overwrite`` is False.
    """
    from safetensors.torch import load_file

    src = Path(folder)
    index = src / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (src / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise CheckpointNotFoundError(
            f"{src} holds no model.safetensors (or its index); save the model with "
            "save_pretrained(..., safe_serialization=True) first"
        )
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(src / name)))
    meta = {"stalwart.source": f"pretrained:{src.name}"}
    if (src / "config.json").is_file():
        config = json.loads((src / "config.json").read_text())
        meta[CONFIG_KEY] = json.dumps(config)
        archs = config.get("architectures") or []
        if archs:
            meta[CLASS_KEY] = archs[0]
    tree: Any = weights
    for key in reversed(subtree.split(".") if subtree else []):
        tree = {key: tree}
    ck = root if isinstance(root, Checkpointer) else Checkpointer(root)
    try:
        ck.save(step, tree, metadata=meta, overwrite=overwrite)
    finally:
        if ck is not root:
            ck.close()
    return len(weights)
