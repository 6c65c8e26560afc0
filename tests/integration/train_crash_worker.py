"""A real training process for the SIGKILL-and-resume tests of the framework integrations.

``python train_crash_worker.py '<job json>'`` trains a tiny model with Lightning
(``"framework": "lightning"``, through :class:`StalwartCheckpointIO`) or the Hugging Face
``Trainer`` (``"hf"``, through :class:`StalwartCallback`), resuming from the newest complete
checkpoint in ``job["dir"]`` when ``job["resume"]`` is set. It appends one ``<step> <loss>`` line
per optimizer step to ``job["losses"]`` (written with ``os.write``: a SIGKILL loses nothing
written before it), ``start <global_step>`` when training starts, and at a clean end writes the
parameters to ``job["final"]`` (``torch.save``). ``run()`` starts one interpreter that imports
the framework once and forks every job from it (``--phases``).

``job["kill"]`` makes the process SIGKILL itself (the signal the OOM killer and a preempted
node send; no handler, no flush):

* ``{"at": "step", "step": K}``: after optimizer step K (mid-epoch, between saves);
* ``{"at": "save", "step": K}`` (Lightning): right after ``save_checkpoint`` at global step K
  returned; with ``"async": true`` the write and the commit are still in flight.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached: a signal sent to oneself arrives before kill() returns


class _Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def line(self, text: str) -> None:
        os.write(self.fd, f"{text}\n".encode())


def _lightning(job: dict[str, Any], log: _Log) -> dict[str, torch.Tensor]:
    import lightning.pytorch as pl

    from stalwart.integrations.lightning import StalwartCheckpointIO

    kill = job.get("kill") or {}

    class Module(pl.LightningModule):
        def __init__(self, lr: float = 0.05) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(4, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_train_start(self) -> None:
            log.line(f"start {self.trainer.global_step}")

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            step = self.trainer.global_step
            log.line(f"{step} {outputs['loss'].item()!r}")
            if kill.get("at") == "step" and step == kill["step"]:
                _die()

        # Lightning does not checkpoint the global RNG; dropout needs it to resume identically.
        def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            checkpoint["torch_rng"] = torch.get_rng_state()

        def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
            torch.set_rng_state(checkpoint["torch_rng"])

        def configure_optimizers(self) -> Any:
            opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.9)]

    class KillingIO(StalwartCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, **kw: Any) -> None:
            super().save_checkpoint(checkpoint, path, **kw)
            if kill.get("at") == "save" and checkpoint["global_step"] == kill["step"]:
                _die()  # sync: committed; async: staged, write and commit in flight

    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8
    )
    pl.seed_everything(0, verbose=False)
    module = Module()
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=Path(job["dir"]) / "ckpts", save_last=True)
    trainer = pl.Trainer(
        max_epochs=4, plugins=[KillingIO(async_save=bool(job.get("async")))], callbacks=[ckpt],
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        accelerator="cpu", devices=1, deterministic=True,
    )  # fmt: skip
    last = Path(job["dir"]) / "ckpts" / "last.ckpt"
    trainer.fit(module, data, ckpt_path=str(last) if job.get("resume") and last.exists() else None)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _hf(job: dict[str, Any], log: _Log) -> dict[str, torch.Tensor]:
    import transformers

    from stalwart.integrations.huggingface import StalwartCallback

    kill = job.get("kill") or {}

    class Tokens(torch.utils.data.Dataset):
        def __init__(self) -> None:
            self.ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(1))

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    class Record(transformers.TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            log.line(f"start {state.global_step}")

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                log.line(f"{state.global_step} {logs['loss']!r}")
                if kill.get("at") == "step" and state.global_step == kill["step"]:
                    _die()

    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=64, tie_word_embeddings=True
    )
    model = transformers.GPT2LMHeadModel(config)  # dropout on: the RNG state must resume too
    args = transformers.TrainingArguments(
        output_dir=str(Path(job["dir"]) / "hf"), max_steps=12, per_device_train_batch_size=4,
        learning_rate=1e-2, warmup_steps=2, save_strategy="steps", save_steps=3,
        logging_steps=1, report_to=[], use_cpu=True, disable_tqdm=True, seed=7,
        dataloader_num_workers=0,
    )  # fmt: skip
    cb = StalwartCallback(Path(job["dir"]) / "root")
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), callbacks=[cb, Record()]
    )
    trainer.train(resume_from_checkpoint=cb.resume_path() if job.get("resume") else None)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


PRELOAD = {
    "lightning": ("lightning.pytorch", "stalwart.integrations.lightning"),
    "hf": ("transformers.trainer", "transformers.models.gpt2", "stalwart.integrations.huggingface"),
}
"""What a job of each framework imports: the zygote loads it once, before forking the jobs."""


def _fork_phases(
    phases: list[list[dict[str, Any]]], statuses: Path, timeout_s: float
) -> dict[str, Any] | None:
    """In the zygote: fork each phase's jobs, all at once, and reap them before the next phase.

    Returns a job in a forked child (the caller runs it at module level and exits like any
    interpreter: atexit handlers, non-daemon threads) and ``None`` in the zygote, which has
    written every phase's exit statuses to ``statuses``. No ``finally`` may sit between the
    fork and the ``return``: a child would run it.
    """
    import importlib

    for name in PRELOAD[phases[0][0]["framework"]]:
        importlib.import_module(name)
    done: list[list[int | None]] = []
    for jobs in phases:
        pids = []
        for job in jobs:
            pid = os.fork()
            if pid == 0:
                return job
            pids.append(pid)
        done.append(_reap(pids, time.monotonic() + timeout_s))
    statuses.write_text(json.dumps(done))
    return None


def _reap(pids: list[int], deadline: float) -> list[int | None]:
    """Exit statuses of ``pids`` (negative: signal); ``None`` for one SIGKILLed at ``deadline``."""
    codes: dict[int, int | None] = {}
    while len(codes) < len(pids):
        for pid in [p for p in pids if p not in codes]:
            got, status = os.waitpid(pid, os.WNOHANG)
            if got:
                codes[pid] = os.waitstatus_to_exitcode(status)
        late = [p for p in pids if p not in codes]
        if late and time.monotonic() > deadline:
            for pid in late:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                codes[pid] = None
        elif late:
            time.sleep(0.05)
    return [codes[p] for p in pids]


def run(*phases: list[dict[str, Any]], timeout_s: float = 240.0) -> list[list[int | None]]:
    """Run each phase's jobs at once, phase after phase; their exit statuses (negative: signal).

    One fresh interpreter (a zygote) imports torch and the framework once and forks every job
    from that clean state: a job is its own process, which shares nothing with the others but
    the imported modules (a resumed job is a sibling of the killed one, never its child), at a
    fifth of the start-up cost of one interpreter per job.
    """
    import subprocess
    import tempfile

    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "statuses.json"
        args = [json.dumps(phases), str(out), str(timeout_s)]
        zygote = subprocess.Popen(
            [sys.executable, __file__, "--phases", *args], env=env, start_new_session=True
        )
        try:
            assert zygote.wait(timeout_s * len(phases) + 60) == 0, "the zygote failed"
        finally:
            if zygote.poll() is None:
                os.killpg(zygote.pid, signal.SIGKILL)
                zygote.wait()
        return json.loads(out.read_text())


def read_losses(path: Path) -> tuple[list[int], dict[int, float]]:
    """The ``start`` steps and the loss of each step a job logged."""
    starts, losses = [], {}
    for raw in path.read_text().splitlines():
        a, b = raw.split()
        if a == "start":
            starts.append(int(b))
        else:
            losses[int(a)] = float(b)
    return starts, losses


def kill_and_resume(tmp: Path, framework: str, cases: dict[str, dict[str, Any]]) -> None:
    """Train uninterrupted; train, SIGKILL, resume (per case); assert identical continuations.

    ``cases`` maps a name to job keys (``kill``, ``async``). For each, the killed run's losses
    up to the step the resumed run starts from, then the resumed run's, must equal the
    uninterrupted run's, and so must the final parameters, bit for bit.
    """

    def job(name: str, **keys: Any) -> dict[str, Any]:
        return {"framework": framework, "dir": str(tmp / name), "losses": str(tmp / f"{name}.txt"),
                "final": str(tmp / f"{name}.pt"), **keys}  # fmt: skip

    killed = [job(name, **keys) for name, keys in cases.items()]
    resumed = [{**k, "kill": None, "resume": True, "losses": k["losses"] + ".resumed"}
               for k in killed]  # fmt: skip
    statuses = run([job("full"), *killed], resumed)
    assert statuses == [[0] + [-signal.SIGKILL] * len(killed), [0] * len(resumed)], statuses

    _, want = read_losses(tmp / "full.txt")
    final = torch.load(tmp / "full.pt")
    for k, r in zip(killed, resumed, strict=True):
        _, before = read_losses(Path(k["losses"]))
        (start,), after = read_losses(Path(r["losses"]))
        assert 0 < start <= k["kill"]["step"] == max(before), (start, k)
        assert {s: v for s, v in before.items() if s <= start} | after == want, k
        got = torch.load(k["final"])
        assert got.keys() == final.keys() and all(torch.equal(got[n], final[n]) for n in got)


def main(job: dict[str, Any]) -> None:
    """Train as ``job`` says (see the module docstring)."""
    torch.set_num_threads(1)  # the same reduction order in every process
    log = _Log(job["losses"])
    train = _lightning if job["framework"] == "lightning" else _hf
    torch.save(train(job, log), job["final"])


if __name__ == "__main__":
    if sys.argv[1] == "--phases":  # see run(): a zygote forking every job
        forked = _fork_phases(json.loads(sys.argv[2]), Path(sys.argv[3]), float(sys.argv[4]))
        if forked is not None:
            main(forked)
    else:
        main(json.loads(sys.argv[1]))
