"""StalwartCallback under save_strategy="best": refused, or stored beside the Trainer's folders."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from stalwart.errors import ConfigError  # noqa: E402
from stalwart.integrations.huggingface import StalwartCallback  # noqa: E402
from tests.integration.test_huggingface import _model, _trainer  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _best_trainer(out: pathlib.Path, callbacks: list[Any], max_steps: int = 8) -> Any:
    """A tiny GPT-2 evaluated every 2 steps, saved whenever its eval loss is a new best."""
    return _trainer(
        out, _model(), callbacks, evaluate=True, max_steps=max_steps, warmup_steps=0,
        learning_rate=1e-1,  # high enough that the eval loss goes up once (at step 4)
        eval_strategy="steps", eval_steps=2, save_strategy="best",
        metric_for_best_model="loss", greater_is_better=False,
    )  # fmt: skip


def _best_steps(trainer: Any) -> list[int]:
    """The steps whose eval loss was lower than every earlier one, in order."""
    best, steps = float("inf"), []
    for h in trainer.state.log_history:
        if "eval_loss" in h and h["eval_loss"] < best:
            best = h["eval_loss"]
            steps.append(h["step"])
    return steps


def test_save_strategy_best_is_refused_with_what_to_use_instead(tmp_path: pathlib.Path) -> None:
    cb = StalwartCallback(tmp_path / "root")
    trainer = _best_trainer(tmp_path / "run", [cb])
    with pytest.raises(ConfigError, match=r'save_strategy="best".*keep_trainer_checkpoints=True'):
        trainer.train()
    assert trainer.state.global_step == 0 and cb.checkpointer.steps() == []


def test_save_strategy_best_with_trainer_folders_stores_the_best_steps(
    tmp_path: pathlib.Path,
) -> None:
    cb = StalwartCallback(tmp_path / "root", keep_trainer_checkpoints=True)
    trainer = _best_trainer(tmp_path / "run", [cb])
    trainer.train()
    best = _best_steps(trainer)
    assert 1 <= len(best) < 4  # evaluated at 2, 4, 6, 8; not every evaluation was a new best
    assert cb.checkpointer.steps() == best
    folders = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run").glob("checkpoint-*"))
    assert folders == best  # the Trainer's own best folders, kept as asked

    # The newest best step resumes a Trainer: its weights are those the Trainer saved there.
    again = StalwartCallback(tmp_path / "root", keep_trainer_checkpoints=True)
    folder = again.resume_path()
    assert folder is not None and folder.endswith(f"checkpoint-{best[-1]}")
    resumed = _best_trainer(tmp_path / "run2", [again], max_steps=best[-1] + 1)
    resumed.train(resume_from_checkpoint=folder)
    assert resumed.state.global_step == best[-1] + 1
    saved = cb.checkpointer.load(None, best[-1])["model"]
    from safetensors.torch import load_file

    theirs = load_file(tmp_path / "run" / f"checkpoint-{best[-1]}" / "model.safetensors")
    for name, t in theirs.items():
        assert torch.equal(saved[name], t), name


def _eval_trainer(out: pathlib.Path, callbacks: list[Any], **kw: Any) -> Any:
    """A tiny GPT-2 evaluated and saved every 2 steps; the "best" eval loss is the highest
    (greater_is_better), so that the best step is not the last one."""
    return _trainer(
        out, _model(), callbacks, evaluate=True, max_steps=6, warmup_steps=0,
        learning_rate=1e-1, eval_strategy="steps", eval_steps=2, save_strategy="steps",
        save_steps=2, metric_for_best_model="loss", greater_is_better=True,
        load_best_model_at_end=True, **kw,
    )  # fmt: skip


def test_each_save_holds_the_state_after_that_steps_evaluation(tmp_path: pathlib.Path) -> None:
    # The Trainer saves a step after logging and evaluating it (a plateau scheduler steps on
    # the eval loss, the best metric moves). Its own checkpoint-N folders, kept here, are the
    # reference: stalwart's step N holds the same scheduler and trainer state.
    import json

    cb = StalwartCallback(tmp_path / "root", keep_trainer_checkpoints=True)
    trainer = _eval_trainer(tmp_path / "run", [cb], lr_scheduler_type="reduce_lr_on_plateau")
    trainer.train()
    assert cb.checkpointer.steps() == [2, 4, 6]
    for step in (2, 4, 6):
        folder = tmp_path / "run" / f"checkpoint-{step}"
        ours = cb.checkpointer.load(None, step)
        theirs = torch.load(folder / "scheduler.pt", weights_only=False)
        assert ours["lr_scheduler"] == theirs, step
        mine = json.loads(ours["trainer_state"])
        trainer_state = json.loads((folder / "trainer_state.json").read_text())
        for key in ("global_step", "log_history", "best_metric", "best_global_step"):
            assert mine[key] == trainer_state[key], (step, key)


def test_load_best_model_at_end_loads_the_best_step_from_the_root(tmp_path: pathlib.Path) -> None:
    # The Trainer loads its best checkpoint-N folder at the end; the callback kept it from
    # writing any, so the callback loads the best step's weights (it left the last ones).
    cb = StalwartCallback(tmp_path / "root")
    trainer = _eval_trainer(tmp_path / "run", [cb])
    trainer.train()
    best = trainer.state.best_global_step
    assert best in (2, 4) and cb.checkpointer.steps() == [2, 4, 6]
    model = trainer.model.state_dict()
    for step in (best, 6):
        saved = cb.checkpointer.load(None, step)["model"]
        same = all(torch.equal(saved[k], model[k]) for k in saved)
        assert same == (step == best), step
