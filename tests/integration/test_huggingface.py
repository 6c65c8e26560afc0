"""Hugging Face through stalwart: Trainer stop/resume, accelerate hooks, pretrained export."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from typer.testing import CliRunner  # noqa: E402

from stalwart.checkpoint import Checkpointer, CheckpointOptions, TrainingState  # noqa: E402
from stalwart.cli.main import app  # noqa: E402
from stalwart.errors import ConfigError, StepExistsError  # noqa: E402
from stalwart.integrations.huggingface import (  # noqa: E402
    StalwartCallback,
    export_pretrained,
    import_pretrained,
    register_accelerate_hooks,
)

pytestmark = pytest.mark.timeout(120)


def _model() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, tie_word_embeddings=True
    )
    return transformers.GPT2LMHeadModel(config)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, 64, (16, 12), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class _StopAt(transformers.TrainerCallback):
    """Stops training after ``step`` (after the save there), like a killed job."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


class _SaveAtTheEnd(transformers.TrainerCallback):
    """transformers 4.x's end of training: a save at the last step, whatever the strategy."""

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step >= state.max_steps and args.save_strategy != "no":
            control.should_save = True
        return control


def _trainer(
    out: pathlib.Path, model: Any, callbacks: list[Any], *, evaluate: bool = False, **kw: Any
) -> Any:
    schedule = kw or {"max_steps": 12, "save_strategy": "steps", "save_steps": 3}
    args = transformers.TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        **({"learning_rate": 1e-2, "warmup_steps": 2} | schedule),
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=7,
        dataloader_num_workers=0,
    )
    return transformers.Trainer(
        model=model, args=args, train_dataset=_Tokens(), callbacks=callbacks,
        eval_dataset=_Tokens() if evaluate else None,
    )  # fmt: skip


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_trainer_stops_and_resumes_bit_identically(tmp_path: pathlib.Path) -> None:
    full_model = _model()
    full = _trainer(tmp_path / "full", full_model, [])
    full.train()

    cb = StalwartCallback(tmp_path / "root")
    assert cb.resume_path() is None  # first run: nothing to resume
    first = _trainer(tmp_path / "run", _model(), [cb, _StopAt(6)])
    first.train(resume_from_checkpoint=cb.resume_path())
    assert cb.checkpointer.steps() == [3, 6]
    assert not list((tmp_path / "run").glob("checkpoint-*"))  # the Trainer wrote no folder

    resumed_model = _model()
    cb2 = StalwartCallback(tmp_path / "root")
    resumed = _trainer(tmp_path / "run", resumed_model, [cb2])
    resumed.train(resume_from_checkpoint=cb2.resume_path())

    assert {**_losses(first), **_losses(resumed)} == _losses(full)
    for (name, a), b in zip(
        full_model.state_dict().items(), resumed_model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name
    assert cb2.checkpointer.steps() == [3, 6, 9, 12]


def _resume_dirs(tmp: pathlib.Path) -> list[str]:
    return sorted(p.name for p in tmp.glob("stalwart-resume-*"))


def test_resuming_leaves_no_copy_in_the_temp_dir(tmp_path: pathlib.Path, monkeypatch: Any) -> None:
    import tempfile

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    cb = StalwartCallback(tmp_path / "root")
    _trainer(tmp_path / "run", _model(), [cb, _StopAt(6)]).train()
    cb2 = StalwartCallback(tmp_path / "root")
    before = _resume_dirs(tmp)
    folder = cb2.resume_path()
    assert folder is not None and folder.startswith(str(tmp)) and _resume_dirs(tmp) != before
    resumed = _trainer(tmp_path / "run", _model(), [cb2])
    resumed.train(resume_from_checkpoint=folder)
    assert resumed.state.global_step == 12 and cb2.checkpointer.steps() == [3, 6, 9, 12]
    assert _resume_dirs(tmp) == before == []  # removed once the Trainer had read it
    # Resuming where training already ended runs no step: the folder goes at train end.
    done = StalwartCallback(tmp_path / "root")
    _trainer(tmp_path / "run", _model(), [done]).train(resume_from_checkpoint=done.resume_path())
    assert _resume_dirs(tmp) == []


def test_a_step_saved_twice_by_one_run_is_replaced_another_runs_is_refused(
    tmp_path: pathlib.Path,
) -> None:
    # save_strategy="epoch" under transformers 4.x: the last step is saved at the end of
    # training (on_step_end) and again at the end of its epoch, at one global step; the
    # Trainer rewrites its checkpoint-8 folder, the callback replaces its step 8.
    epochs = {"max_steps": 8, "save_strategy": "epoch"}  # 16 samples / 4 a batch: 4 steps
    saves: list[int] = []
    record = CheckpointOptions(on_event=lambda e: saves.append(e.step) if e.kind == "save" else 0)
    cb = StalwartCallback(tmp_path / "root", options=record)
    _trainer(tmp_path / "run", _model(), [_SaveAtTheEnd(), cb], **epochs).train()
    assert cb.checkpointer.steps() == [4, 8] and saves == [4, 8, 8]
    state = json.loads(cb.checkpointer.load(None, 8)["trainer_state"])
    assert state["global_step"] == 8 and state["epoch"] == 2.0

    other = StalwartCallback(tmp_path / "root")  # a new run, not resumed, into the same root
    with pytest.raises(StepExistsError, match=r"step 4 from another run.*resume_path\(\)"):
        _trainer(tmp_path / "other", _model(), [other], **epochs).train()


def test_export_pretrained_loads_the_same_weights_with_ties(tmp_path: pathlib.Path) -> None:
    model = _model()
    with torch.no_grad():
        model.lm_head.weight.add_(1.0)  # tied: the embedding moves too
    state = TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    ck = Checkpointer(tmp_path / "root")
    ck.save(1, state, metadata={"hf.config": model.config.to_json_string()})

    with pytest.raises(ConfigError, match=r"--subtree model"):
        export_pretrained(ck, tmp_path / "whole", subtree=None, model_class=type(model))

    out = export_pretrained(ck, tmp_path / "hf", model_class=transformers.GPT2LMHeadModel)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # tied weights stay tied
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name

    # Round trip: the save_pretrained folder imports as a step that loads into the model.
    n = import_pretrained(out, tmp_path / "imported", step=5)
    assert n == len(loaded.state_dict()) - 1  # the tied lm_head is stored once, as wte
    with pytest.raises(StepExistsError):
        import_pretrained(out, tmp_path / "imported", step=5)
    assert import_pretrained(out, tmp_path / "imported", step=5, overwrite=True) == n
    fresh = _model()
    Checkpointer(tmp_path / "imported").load({"model": fresh}, 5, strict=False)
    assert torch.equal(fresh.lm_head.weight, model.lm_head.weight)


def test_cli_export_subtree_strips_the_prefix_and_refuses_the_whole_state(
    tmp_path: pathlib.Path,
) -> None:
    from safetensors.torch import load_file

    model = _model()
    Checkpointer(tmp_path / "root").save(1, TrainingState(model=model))
    runner = CliRunner()
    whole = runner.invoke(app, ["ckpt", "export", str(tmp_path / "root"), str(tmp_path / "a.st")])
    assert whole.exit_code == 0  # the generic export keeps the whole tree
    r = runner.invoke(
        app,
        ["ckpt", "export", str(tmp_path / "root"), str(tmp_path / "m.st"), "--subtree", "model"],
    )
    assert r.exit_code == 0, r.output
    assert set(load_file(str(tmp_path / "m.st"))) == set(model.state_dict())
    bad = runner.invoke(
        app, ["ckpt", "export", str(tmp_path / "root"), str(tmp_path / "b.st"), "--subtree", "x"]
    )
    assert bad.exit_code != 0 and "--subtree" in bad.output


def test_accelerate_hooks_keep_weights_in_the_root(tmp_path: pathlib.Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = acc.prepare(_model())
    ck = register_accelerate_hooks(acc, tmp_path / "root")
    acc.save_state(str(tmp_path / "s1"))
    assert not list((tmp_path / "s1").glob("model*.safetensors"))
    assert json.loads((tmp_path / "s1" / "stalwart.json").read_text())["step"] == 1
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    acc.load_state(str(tmp_path / "s1"))
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved[k]), k
    assert ck.steps() == [1]
    # Closing the checkpointer takes its hooks off: the next root's hooks alone run (before,
    # the closed one's hook ran first and save_state failed: its threads were shut down).
    ck.close()
    ck2 = register_accelerate_hooks(acc, tmp_path / "root2")
    acc.save_state(str(tmp_path / "s2"))
    assert ck2.steps() == [1]
    ck2.close()
    acc.save_state(str(tmp_path / "s3"))  # no stalwart hook left: accelerate writes the model
    assert list((tmp_path / "s3").glob("model*.safetensors"))
