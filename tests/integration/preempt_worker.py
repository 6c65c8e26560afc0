"""A training loop under a PreemptionGuard, run as a script by test_preemption.py.

python preempt_worker.py ROOT        trains until SIGTERM, saving asynchronously every 3
                                     steps; prints "step N" after each step
"""

from __future__ import annotations

import sys

import torch

import stalwart


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)  # the data of a step depends on the step alone
    x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()


def main(root: str) -> None:
    model, optimizer = build()
    state = stalwart.TrainingState(model=model, optimizer=optimizer)
    ckpt = stalwart.Checkpointer(root)
    with stalwart.PreemptionGuard() as preemption:
        for step in range(1, 1_000_000):
            train_step(model, optimizer, step)
            if step % 3 == 0:
                ckpt.save_async(step, state)
            print(f"step {step}", flush=True)
            preemption.save_and_exit_if_requested(ckpt, step, state)
    sys.exit("the loop ended without a signal")


if __name__ == "__main__":
    main(sys.argv[1])
