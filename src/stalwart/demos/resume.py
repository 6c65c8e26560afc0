"""The ``stalwart demo``: kill a training run with SIGKILL, resume it, prove the resume is exact.

Three runs of the same small fine-tuning job (a frozen backbone of a few MB plus a trainable
head with dropout, AdamW, a step LR schedule and shuffled mini-batches), all on CPU:

A. the reference: ``steps`` steps straight through, in this process, no checkpoints;
B. a child process (``spawn``) that saves a :class:`~stalwart.TrainingState` every
   ``checkpoint_every`` steps and SIGKILLs itself in the middle of step ``kill_at``, after
   the backward pass and before the optimizer update;
C. a resume in this process from fresh objects: load the newest committed checkpoint and
   train to ``steps``, recomputing the steps the kill lost.

C's parameters, optimizer moments and final loss must equal A's bit for bit, which only
holds if the checkpoint carried every RNG (dropout masks, data order) along with the model,
optimizer and schedule. The frozen backbone makes content-addressed dedup visible: it is
stored once and reused by every later checkpoint.
"""

from __future__ import annotations

import json
import math
import multiprocessing as mp
import os
import random
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table
from torch import nn

from stalwart.checkpoint import Checkpointer, CheckpointOptions, KeepLast
from stalwart.checkpoint.training_state import TrainingState
from stalwart.errors import ConfigError

__all__ = ["DemoReport", "default_kill_step", "run_demo"]

SEED = 20240611
N_SAMPLES, N_FEATURES, N_CLASSES = 4096, 64, 10
HIDDEN = 1024  # backbone width: ~1.1 M frozen float32 parameters, 4.3 MB
HEAD = 128
BATCH = 64
KEEP_LAST = 3
REPORT_NAME = "demo-report.json"
"""Written in the demo root; its presence marks ``root/run`` as the demo's own to delete."""
_SAVE_FIELDS = ("bytes_total", "bytes_written", "bytes_reused", "chunks_written", "chunks_reused")


@dataclass
class DemoReport:
    """What the demo did and measured. Byte counts are summed over every save of B and C."""

    root: Path
    steps: int
    checkpoint_every: int
    kill_at: int
    child_exitcode: int | None = None
    resumed_from: int | None = None
    committed_steps: list[int] = field(default_factory=list)
    saves: int = 0
    bytes_total: int = 0
    bytes_written: int = 0
    bytes_reused: int = 0
    chunks_written: int = 0
    chunks_reused: int = 0
    seconds_reference: float = 0.0
    seconds_child_start: float = 0.0
    seconds_until_kill: float = 0.0
    seconds_load: float = 0.0
    seconds_resumed: float = 0.0
    final_loss_reference: float = math.nan
    final_loss_resumed: float = math.nan
    mismatches: list[str] = field(default_factory=list)

    @property
    def child_killed(self) -> bool:
        """True when the child process died of SIGKILL, as planned."""
        return self.child_exitcode == -signal.SIGKILL

    @property
    def bit_identical(self) -> bool:
        """True when the resumed run equals the reference bit for bit."""
        return not self.mismatches and self.final_loss_reference == self.final_loss_resumed

    @property
    def dedup_ratio(self) -> float:
        """Logical bytes saved per byte actually written (1.0 means no dedup)."""
        return self.bytes_total / self.bytes_written if self.bytes_written else math.inf

    @property
    def ok(self) -> bool:
        """The demo showed what it should: killed by SIGKILL and resumed bit-identically."""
        return self.child_killed and self.bit_identical


def default_kill_step(steps: int, checkpoint_every: int) -> int:
    """A random-looking but fixed step in 40-70 % of the run, never on a checkpoint step."""
    lo, hi = max(math.ceil(0.4 * steps), checkpoint_every + 1), math.floor(0.7 * steps)
    candidates = [s for s in range(lo, hi + 1) if s % checkpoint_every]
    if not candidates:
        candidates = [s for s in range(1, steps + 1) if s % checkpoint_every] or [steps]
    return candidates[(steps * 7919 + checkpoint_every * 104729) % len(candidates)]


class DemoModel(nn.Module):
    """A frozen two-layer backbone and a trainable head with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Linear(N_FEATURES, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU()
        )
        self.backbone.requires_grad_(False)
        self.head = nn.Sequential(nn.Dropout(0.1), nn.Linear(HIDDEN, HEAD), nn.GELU(),
                                  nn.Dropout(0.1), nn.Linear(HEAD, N_CLASSES))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of shape (batch, N_CLASSES) for inputs of shape (batch, N_FEATURES)."""
        return self.head(self.backbone(x))


def make_dataset() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs (N_SAMPLES, N_FEATURES) and labels from a fixed-seed random teacher network."""
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(N_SAMPLES, N_FEATURES, generator=g)
    w1 = torch.randn(N_FEATURES, 32, generator=g) / math.sqrt(N_FEATURES)
    w2 = torch.randn(32, N_CLASSES, generator=g)
    noise = 0.3 * torch.randn(N_SAMPLES, N_CLASSES, generator=g)
    return x, (torch.tanh(x @ w1) @ w2 + noise).argmax(dim=1)


@dataclass
class _Job:
    """The live objects of one training run and the TrainingState that covers them."""

    model: DemoModel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data_order: torch.Generator
    extra: dict[str, Any]
    state: TrainingState


def _build_job(steps: int) -> _Job:
    torch.manual_seed(SEED)  # weight init, then dropout masks
    model = DemoModel()
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=max(1, steps // 3), gamma=0.5)
    data_order = torch.Generator().manual_seed(SEED + 1)
    extra: dict[str, Any] = {"step": 0}
    state = TrainingState(
        model=model, optimizer=optimizer, scheduler=scheduler, extra=extra,
        generators={"data_order": data_order},
    )  # fmt: skip
    return _Job(model, optimizer, scheduler, data_order, extra, state)


def _forward_backward(job: _Job, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Each mini-batch is a fresh shuffled draw, so the data order lives in one generator.
    idx = torch.randperm(N_SAMPLES, generator=job.data_order)[:BATCH]
    job.model.train()
    loss = F.cross_entropy(job.model(x[idx]), y[idx])
    job.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


def _update(job: _Job) -> None:
    job.optimizer.step()
    job.scheduler.step()
    job.extra["step"] += 1


@contextmanager
def _deterministic() -> Iterator[None]:
    """One intra-op thread; restores the caller's thread count and global RNGs afterwards.

    A fixed thread count keeps CPU reductions in the same order in every process. The CPU
    kernels this model uses are deterministic, so ``torch.use_deterministic_algorithms``
    is not needed, and it would cost ~4 s per process (it imports torch._inductor).
    """
    threads = torch.get_num_threads()
    py_rng, np_rng = random.getstate(), np.random.get_state()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)
        random.setstate(py_rng)
        np.random.set_state(np_rng)


def _checkpointer(run_root: Path) -> Checkpointer:
    return Checkpointer(run_root, options=CheckpointOptions(keep=KeepLast(KEEP_LAST)))


def _save_stats(result: Any) -> dict[str, int]:
    return {k: int(getattr(result, k)) for k in _SAVE_FIELDS}


def _child_main(
    run_root: str, steps: int, every: int, kill_at: int, stats_path: str, shared: Any
) -> None:
    """Run B: train with checkpoints and SIGKILL this process during step ``kill_at``.

    ``shared`` is ``(steps done, wall-clock time training started)`` for the parent.
    """
    with _deterministic():
        x, y = make_dataset()
        job = _build_job(steps)
        ckpt = _checkpointer(Path(run_root))
        progress, started = shared
        started.value = time.time()
        for step in range(1, steps + 1):
            _forward_backward(job, x, y)
            if step == kill_at:  # gradients computed, update not applied: a mid-step death
                os.kill(os.getpid(), signal.SIGKILL)
            _update(job)
            if step % every == 0:
                with open(stats_path, "a") as f:  # the parent reads it after the kill
                    f.write(json.dumps(_save_stats(ckpt.save(step, job.state))) + "\n")
            progress.value = step


def _snapshot(job: _Job, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every tensor the comparison covers, cloned, by name."""
    out = {f"model.{k}": v.detach().clone() for k, v in job.model.state_dict().items()}
    for idx, st in job.optimizer.state_dict()["state"].items():
        out.update({f"optimizer.state.{idx}.{k}": v.clone() for k, v in st.items()})
    out["scheduler.last_lr"] = torch.tensor(job.scheduler.get_last_lr(), dtype=torch.float64)
    out["final_loss"] = loss.clone()
    return out


def run_demo(
    root: Path,
    *,
    steps: int = 300,
    checkpoint_every: int = 25,
    kill_at: int | None = None,
    console: Console,
) -> DemoReport:
    """Run the kill-and-resume demo under ``root`` and print what happened.

    Checkpoints go to ``root / "run"``, which must hold no checkpoint yet; a JSON copy of
    the report is written to ``root / "demo-report.json"``.

    Args:
        root: the demo's folder (created if missing).
        steps: training steps of the whole run.
        checkpoint_every: save a checkpoint every this many steps.
        kill_at: the step during which the child is killed; by default a fixed step in
            40-70 % of the run that is not a checkpoint step.
        console: where to print progress and the summary.

    Returns:
        The measurements; ``report.ok`` tells whether the resume was bit-identical.

    Raises:
        ConfigError: invalid arguments, or ``root / "run"`` already holds checkpoints.
    """
    kill_at = default_kill_step(steps, checkpoint_every) if kill_at is None else kill_at
    for name, value, lo in (("steps", steps, 2), ("checkpoint_every", checkpoint_every, 1),
                            ("kill_at", kill_at, 1)):  # fmt: skip
        if not lo <= value <= max(steps, 2):
            raise ConfigError(f"{name}={value}: use {lo}..{max(steps, 2)}")
    root = Path(root).absolute()
    run_root = root / "run"
    root.mkdir(parents=True, exist_ok=True)
    report = DemoReport(root, steps, checkpoint_every, kill_at)
    if _checkpointer(run_root).steps():
        raise ConfigError(
            f"{run_root} already holds checkpoints of an earlier demo; delete that folder "
            "(`stalwart demo` does, unless given --no-fresh) so that the demo starts clean"
        )
    (root / REPORT_NAME).write_text(json.dumps({"status": "running"}) + "\n")
    console.rule("[bold]stalwart demo[/]: SIGKILL a training run, resume it, check it bit for bit")
    columns = (TextColumn("{task.description:<22}"), BarColumn(), MofNCompleteColumn())
    with _deterministic(), Progress(*columns, TimeElapsedColumn(), console=console) as progress:
        x, y = make_dataset()
        ref_loss, ref = _reference_run(report, x, y, progress)
        _killed_run(report, run_root, progress)
        res_loss, got = _resumed_run(report, run_root, x, y, progress)
    report.final_loss_reference, report.final_loss_resumed = float(ref_loss), float(res_loss)
    report.mismatches = sorted(set(ref) ^ set(got))
    report.mismatches += [k for k in ref if k in got and not torch.equal(ref[k], got[k])]
    report.committed_steps = list(_checkpointer(run_root).steps())
    summary = {k: v for k, v in asdict(report).items() if k != "root"}
    summary.update(root=str(root), bit_identical=report.bit_identical, status="done")
    (root / REPORT_NAME).write_text(json.dumps(summary, indent=2) + "\n")
    _print_report(report, console)
    return report


def _reference_run(
    report: DemoReport, x: torch.Tensor, y: torch.Tensor, progress: Progress
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    task = progress.add_task("A reference run", total=report.steps)
    job, loss = _build_job(report.steps), torch.tensor(math.nan)
    start = time.perf_counter()
    for _ in range(report.steps):
        loss = _forward_backward(job, x, y)
        _update(job)
        progress.advance(task)
    report.seconds_reference = time.perf_counter() - start
    return loss, _snapshot(job, loss)


def _killed_run(report: DemoReport, run_root: Path, progress: Progress) -> None:
    task = progress.add_task("B run until SIGKILL", total=report.steps)
    ctx = mp.get_context("spawn")
    counter, started = ctx.RawValue("i", 0), ctx.RawValue("d", 0.0)
    with tempfile.TemporaryDirectory(prefix="stalwart-demo-") as tmp:
        stats_path = Path(tmp) / "saves.jsonl"
        stats_path.touch()
        args = (str(run_root), report.steps, report.checkpoint_every, report.kill_at)
        child = ctx.Process(target=_child_main, args=(*args, str(stats_path), (counter, started)))
        start = time.time()  # wall clock: compared with the child's
        child.start()
        while child.is_alive():
            progress.update(task, completed=counter.value)
            child.join(0.05)
        end = time.time()
        report.seconds_child_start = max(0.0, (started.value or end) - start)
        report.seconds_until_kill = end - (started.value or end)
        progress.update(task, completed=counter.value)
        report.child_exitcode = child.exitcode
        for line in stats_path.read_text().splitlines():
            _add_save(report, json.loads(line))


def _add_save(report: DemoReport, stats: dict[str, int]) -> None:
    report.saves += 1
    for key in _SAVE_FIELDS:
        setattr(report, key, getattr(report, key) + stats[key])


def _resumed_run(
    report: DemoReport, run_root: Path, x: torch.Tensor, y: torch.Tensor, progress: Progress
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ckpt = _checkpointer(run_root)
    job = _build_job(report.steps)  # fresh objects, as a restarted process would build them
    start = time.perf_counter()
    report.resumed_from = ckpt.latest_step()
    if report.resumed_from is not None:
        ckpt.load(job.state, step=report.resumed_from)
    report.seconds_load = time.perf_counter() - start
    first = int(job.extra["step"]) + 1
    task = progress.add_task("C resumed run", total=report.steps, completed=first - 1)
    start = time.perf_counter()
    loss = torch.tensor(math.nan)
    for step in range(first, report.steps + 1):
        loss = _forward_backward(job, x, y)
        _update(job)
        if step % report.checkpoint_every == 0:
            _add_save(report, _save_stats(ckpt.save(step, job.state)))
        progress.advance(task)
    report.seconds_resumed = time.perf_counter() - start
    return loss, _snapshot(job, loss)


def _fmt_bytes(n: float) -> str:
    exp = min(int(math.log(max(n, 1.0), 1024)), 3)
    return f"{n / 1024**exp:.1f} {('B', 'KiB', 'MiB', 'GiB')[exp]}"


def _print_report(r: DemoReport, console: Console) -> None:
    lost_from = (r.resumed_from or 0) + 1
    died = "SIGKILL" if r.child_killed else f"[red]exit code {r.child_exitcode}, not SIGKILL[/]"
    phases = Table("phase", "steps", Column("seconds", justify="right"), "what happened")
    for row in (
        ("A reference run", f"1-{r.steps}", r.seconds_reference, "uninterrupted, no checkpoints"),
        ("B run until kill", f"1-{r.kill_at}", r.seconds_until_kill,
         f"checkpoint every {r.checkpoint_every} steps; {died} during step {r.kill_at} "
         f"(+{r.seconds_child_start:.1f} s process start)"),
        ("C resume: load", f"{r.resumed_from or 0}", r.seconds_load,
         "fresh model, optimizer, scheduler, generators; newest checkpoint"),
        ("C resumed run", f"{lost_from}-{r.steps}", r.seconds_resumed,
         f"steps {lost_from}-{r.kill_at} recomputed after the kill"),
    ):  # fmt: skip
        phases.add_row(row[0], row[1], f"{row[2]:.2f}", row[3])
    console.print(phases)
    reused = r.bytes_reused / r.bytes_total if r.bytes_total else 0.0
    shown = ", ".join(r.mismatches[:5]) + (" ..." if len(r.mismatches) > 5 else "")
    verdict = (
        "[bold green]✓ bit-identical[/]: every parameter, optimizer moment and the final loss "
        f"({r.final_loss_resumed:.6f}) equal the uninterrupted run"
        if r.bit_identical
        else f"[bold red]✗ not bit-identical[/]: final loss {r.final_loss_resumed!r} vs "
        f"{r.final_loss_reference!r}; differing: {shown or 'final loss'}"
    )
    console.print(
        f"committed steps (KeepLast({KEEP_LAST})): {', '.join(map(str, r.committed_steps))}\n"
        f"{r.saves} saves: {_fmt_bytes(r.bytes_total)} logical, {_fmt_bytes(r.bytes_written)} "
        f"written, {_fmt_bytes(r.bytes_reused)} reused by dedup ({reused:.0%}; "
        f"dedup ratio {r.dedup_ratio:.2f}x; chunks {r.chunks_written} written, "
        f"{r.chunks_reused} reused)\n{verdict}\ndemo folder: {escape(str(r.root))}"
    )
