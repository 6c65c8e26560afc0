"""Hugging Face: a ``Trainer`` callback, ``accelerate`` save/load hooks, and pretrained export.

Adopting it in a ``Trainer`` is three lines::

    from stalwart.integrations.huggingface import StalwartCallback
    cb = StalwartCallback("runs/ckpt")                       # Trainer(..., callbacks=[cb])
    trainer.train(resume_from_checkpoint=cb.resume_path())  # None on the first run

**Saving.** The callback takes over the Trainer's saves: when the Trainer decides to save
(``save_strategy``, ``save_steps``), the callback writes model, optimizer, LR scheduler, RNG
and trainer state as stalwart step ``global_step`` into one root (consecutive saves share every
unchanged chunk) and clears ``control.should_save``, so the Trainer writes no folder of its
own. A step the Trainer also logs or evaluates is stored as the Trainer stores its own: after
that logging and evaluation (a plateau scheduler stepped, the best metric set), at the next
callback (the next step's start, the epoch's end, the end of training). With
``load_best_model_at_end`` the callback loads the best step's weights at the end of training
(the Trainer would look for its own folder). The model's config and class name go into the
manifest's metadata (``hf.config``, ``hf.model_class``) for :func:`export_pretrained`.
``save_strategy="best"`` is the exception: the Trainer decides a best step after evaluating
and writes its folder at once, with no callback in between to take the save over, so the
callback refuses it (``ConfigError``) unless ``keep_trainer_checkpoints=True``; then it
stores each best step after the Trainer's own save.

**Resuming.** The Trainer resumes only from a folder in its own layout, so
:meth:`StalwartCallback.resume_path` writes the newest step as one (``model.safetensors``,
``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``, ``trainer_state.json``) in a temporary
folder and returns it; the Trainer then restores everything, RNG and data position included,
so the resumed run is bit-identical to an uninterrupted one. That folder is a view made at
resume time and deleted once the Trainer has read it; the root stays the record. A step saved
again by the same run (the last step, once more at the end of its epoch) replaces the first
save, as the Trainer's own folder would be; a step of another run in the same root is refused
(``StepExistsError``). State of other stateful callbacks (early stopping)
is not carried.

**accelerate.** :func:`register_accelerate_hooks` makes ``Accelerator.save_state`` store the
models' weights in a stalwart root (a ``stalwart.json`` pointer goes in the folder instead of
``model.safetensors``) and ``load_state`` read them back; accelerate keeps writing the
optimizer, scheduler and RNG files itself (its hooks see only the models).

**Export and import.** :func:`export_pretrained` writes a step's model subtree as a
``save_pretrained`` folder (safetensors + ``config.json``, prefix stripped, tied weights
tied) through the model's own ``save_pretrained``; :func:`import_pretrained` reads such a
folder into a step. Exporting a whole training state where a model is expected is an error
that names the subtree to pick.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from stalwart.checkpoint import Checkpointer, CheckpointOptions
from stalwart.checkpoint.tools.export import unshared
from stalwart.errors import CheckpointNotFoundError, ConfigError, StepExistsError, require
from stalwart.integrations.huggingface_pretrained import (
    CLASS_KEY,
    CONFIG_KEY,
    export_pretrained,
    import_pretrained,
)

transformers = require("transformers", "huggingface", "stalwart.integrations.huggingface")
TrainerCallback: Any = transformers.TrainerCallback  # Any: a class of a module require() returned

__all__ = [
    "StalwartCallback",
    "export_pretrained",
    "import_pretrained",
    "register_accelerate_hooks",
]

POINTER_NAME = "stalwart.json"


def _capture_rng() -> dict[str, Any]:
    """The RNG states the Trainer saves, as values the state tree holds without pickle."""
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    assert isinstance(keys, np.ndarray)  # legacy=True: the MT19937 tuple
    version, py_state, gauss = random.getstate()
    rng: dict[str, Any] = {
        "python": {"version": version, "state": list(py_state), "gauss": gauss},
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "cpu": torch.random.get_rng_state(),
    }
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.random.get_rng_state_all()
    return rng


def _trainer_rng(rng: dict[str, Any]) -> dict[str, Any]:
    """``rng_state.pth`` as the Trainer writes it, from :func:`_capture_rng`'s tree."""
    py, npy = rng["python"], rng["numpy"]
    keys = np.asarray(npy["keys"].numpy(), dtype=np.uint32)
    out: dict[str, Any] = {
        "python": (py["version"], tuple(py["state"]), py["gauss"]),
        "numpy": (npy["kind"], keys, npy["pos"], npy["has_gauss"], npy["cached"]),
        "cpu": rng["cpu"],
    }
    if "cuda" in rng and torch.cuda.is_available():
        cuda = rng["cuda"]
        out["cuda"] = cuda if torch.cuda.device_count() > 1 else cuda[0]
    return out


def _model_metadata(model: Any) -> dict[str, str]:
    meta: dict[str, str] = {}
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        meta[CONFIG_KEY] = config.to_json_string(use_diff=False)
    cls = type(model)
    if getattr(transformers, cls.__name__, None) is cls:
        meta[CLASS_KEY] = cls.__name__
    return meta


class StalwartCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that saves the Trainer's state into a stalwart root.

    Args:
        root: folder or fsspec URL of the stalwart root.
        options: the stalwart checkpoint options (chunking, compression, retention).
        keep_trainer_checkpoints: also let the Trainer write its own ``checkpoint-N`` folders
            (needed for ``save_strategy="best"``, whose saves the callback cannot take over).
        storage_options: fsspec options for a remote root.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        options: CheckpointOptions | None = None,
        keep_trainer_checkpoints: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.checkpointer = Checkpointer(root, options, storage_options=storage_options)
        self.keep_trainer_checkpoints = keep_trainer_checkpoints
        self._ours: set[int] = set()  # steps this run saved or resumed from
        self._resume_dir: tempfile.TemporaryDirectory[str] | None = None
        self._pending: dict[str, Any] | None = None  # a due save's control, after the eval

    def _maybe_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if not control.should_save or args.save_strategy == "best":  # "best": in on_save
            return control
        if control.should_log or control.should_evaluate:
            # The Trainer logs and evaluates this step before it would save: its evaluation
            # may step a plateau scheduler and set the best metric. Save at the next callback.
            self._pending = control.state()
        else:
            self._save_trainer(state, control.state(), **kwargs)
        if not self.keep_trainer_checkpoints:
            control.should_save = False
        return control

    def _save_pending(self, state: Any, **kwargs: Any) -> None:
        """The save :meth:`_maybe_save` put off, now that the step's evaluation is done."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._save_trainer(state, pending, **kwargs)

    def _save_trainer(self, state: Any, control_state: dict[str, Any], **kwargs: Any) -> None:
        """Save the Trainer's model, optimizer, scheduler, RNG and state as ``global_step``."""
        model = kwargs["model"]
        # Every rank saves, together: replicated tensors are written once, sharded ones
        # (FSDP) by their holders; RNG states are per rank.
        state.stateful_callbacks["TrainerControl"] = control_state
        tree = {
            "model": model,
            "optimizer": kwargs.get("optimizer"),
            "lr_scheduler": kwargs.get("lr_scheduler"),
            "rng": {f"rank{_rank()}": _capture_rng()},
            "trainer_state": json.dumps(_asdict(state), sort_keys=True),
        }
        self._save(state.global_step, tree, _model_metadata(model))

    def _save(self, step: int, tree: dict[str, Any], meta: dict[str, str]) -> None:
        """Save ``step``; a step this run already holds is replaced, as the Trainer replaces
        its ``checkpoint-N`` folder (the last step saved again at the end of an epoch)."""
        try:
            if step in self._ours:
                self.checkpointer.save(step, tree, metadata=meta, overwrite=True)
            else:
                self.checkpointer.save(step, tree, metadata=meta)
        except StepExistsError as e:
            raise StepExistsError(
                f"{self.checkpointer.url} already holds step {step} from another run, and "
                "StalwartCallback does not replace it. To continue that run, pass "
                "resume_from_checkpoint=callback.resume_path() to trainer.train; to start "
                "over, give the callback a new root (or delete the old steps with "
                "`stalwart ckpt rm`)"
            ) from e
        self._ours.add(step)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Refuse ``save_strategy="best"`` unless the Trainer keeps its own folders.

        Raises:
            ConfigError: ``save_strategy="best"`` and not ``keep_trainer_checkpoints``.
        """
        if args.save_strategy == "best" and not self.keep_trainer_checkpoints:
            raise ConfigError(
                'StalwartCallback cannot take over save_strategy="best": the Trainer decides '
                "a step is the best after evaluating it and writes its checkpoint-N folder at "
                'once, with no callback in between. Use save_strategy="steps" (save_steps '
                'equal to eval_steps) or "epoch" to have stalwart store the saves instead, '
                "or pass keep_trainer_checkpoints=True to StalwartCallback to store each best "
                "step in stalwart as well as in the Trainer's folder"
            )
        return control

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Store the last step's save, put off past its evaluation; delete the folder
        :meth:`resume_path` wrote: the Trainer has read all of it by the first step after
        resuming (weights, optimizer, scheduler, state, RNG)."""
        self._save_pending(state, **kwargs)
        self._drop_resume_dir()
        return control

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Store the last epoch's save, put off past its evaluation."""
        self._save_pending(state, **kwargs)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Store the last save put off past its evaluation; with ``load_best_model_at_end``,
        load the best step's weights into the model (the Trainer looks for its own folder,
        which the callback kept it from writing); delete the resume folder when training
        ended before any step."""
        self._save_pending(state, **kwargs)
        best = state.best_global_step
        if args.load_best_model_at_end and best and state.best_model_checkpoint is None:
            self._load_best(best, kwargs["model"])
        self._drop_resume_dir()
        return control

    def _load_best(self, step: int, model: Any) -> None:
        """Load step ``step``'s weights into ``model``, as the Trainer would from its folder."""
        if step not in self.checkpointer.steps():  # the run is done: say so, do not fail it
            warnings.warn(
                f"load_best_model_at_end: the best step, {step}, is not in "
                f"{self.checkpointer.url} (retention removed it, or it was never saved: "
                "save_steps must be a multiple of eval_steps); the model keeps the last "
                "step's weights",
                stacklevel=2,
            )
            return
        self.checkpointer.load({"model": model}, step, strict=False)

    def _drop_resume_dir(self) -> None:
        if self._resume_dir is not None:
            self._resume_dir.cleanup()
            self._resume_dir = None

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Save when the Trainer would (its save schedule set ``control.should_save``)."""
        return self._maybe_save(args, state, control, **kwargs)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """Save at the end of an epoch when the Trainer would (``save_strategy="epoch"``)."""
        self._save_pending(state, **kwargs)
        return self._maybe_save(args, state, control, **kwargs)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        """With ``save_strategy="best"`` (and ``keep_trainer_checkpoints``), store the step the
        Trainer has just saved as its new best: only now is the decision made, and the state
        complete (the evaluation logged, ``best_metric`` set, a plateau scheduler stepped)."""
        if args.save_strategy == "best":
            self._save_trainer(state, control.state(), **kwargs)
        return control

    def resume_path(self, step: int | None = None, folder: str | None = None) -> str | None:
        """Write ``step`` (the newest when None) as a Trainer checkpoint folder; return it.

        Args:
            step: the step to resume from.
            folder: where to write it; when None, a temporary folder that the callback
                deletes once the Trainer has read it (at its first step, or the end of
                training), or at exit when training never starts.

        Returns:
            The folder for ``Trainer.train(resume_from_checkpoint=...)``, or None when the
            root holds no checkpoint yet (a first run). Under torch.distributed every rank
            calls it (the load is collective) and gets a folder with its own RNG file.
        """
        if step is None:
            try:
                step = self.checkpointer.latest_step()
            except CheckpointNotFoundError:
                step = None
            if step is None:
                return None
        tree = self.checkpointer.load(None, step)
        self._ours.add(step)  # saving it again (the resumed Trainer may) replaces it
        if folder is None:
            self._drop_resume_dir()
            self._resume_dir = tempfile.TemporaryDirectory(prefix="stalwart-resume-")
            folder = self._resume_dir.name
        out = Path(folder) / f"checkpoint-{step}"
        out.mkdir(parents=True, exist_ok=True)
        from safetensors.torch import save_file

        weights = unshared(tree["model"])  # tied weights come back sharing memory
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
        config = self.checkpointer.manifest(step).metadata.get(CONFIG_KEY)
        if config is not None:
            (out / "config.json").write_text(config)
        if tree.get("optimizer") is not None:
            torch.save(tree["optimizer"], out / "optimizer.pt")
        if tree.get("lr_scheduler") is not None:
            torch.save(tree["lr_scheduler"], out / "scheduler.pt")
        rank, world = _rank(), _world()
        rng_name = "rng_state.pth" if world == 1 else f"rng_state_{rank}.pth"
        torch.save(_trainer_rng(tree["rng"][f"rank{rank}"]), out / rng_name)
        (out / "trainer_state.json").write_text(tree["trainer_state"])
        return str(out)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _asdict(state: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(state)


def register_accelerate_hooks(accelerator: Any, root: str | os.PathLike[str]) -> Checkpointer:
    """Store the models' weights of ``accelerator.save_state`` in the stalwart root ``root``.

    ``save_state(dir)`` then writes the weights as the next step of ``root`` and a
    ``stalwart.json`` pointer in ``dir`` (no ``model.safetensors``); ``load_state(dir)`` loads
    them from the step the pointer names. Optimizer, scheduler and RNG files stay accelerate's.

    Returns:
        The root's :class:`Checkpointer`; closing it takes the hooks off ``accelerator``.
    """
    ck = Checkpointer(root)

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if not weights:
            return
        step = max(ck.steps(), default=0) + 1
        ck.save(step, {"models": list(weights)}, metadata=_model_metadata(models[0]))
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, POINTER_NAME), "w") as f:
            json.dump({"root": ck.url, "step": step, "models": len(weights)}, f)
        weights.clear()  # accelerate writes no model files

    def load_hook(models: list[Any], input_dir: str) -> None:
        pointer = os.path.join(input_dir, POINTER_NAME)
        if not os.path.isfile(pointer):
            return  # a folder accelerate wrote itself: let it load as usual
        with open(pointer) as f:
            step = int(json.load(f)["step"])
        ck.load({"models": [accelerator.unwrap_model(m) for m in models]}, step)
        models.clear()  # accelerate loads no model files

    for handle in (
        accelerator.register_save_state_pre_hook(save_hook),
        accelerator.register_load_state_pre_hook(load_hook),
    ):  # off again when ck closes: a closed checkpointer's hook would fail every save_state
        ck.on_close(handle.remove)
    return ck
