"""A GPT trained elastically at the shape of real jobs: FSDP2 inside replica groups (HSDP).

    stalwart run --nproc 4 --group-size 2 examples/gpt_hsdp.py              # ~124 M parameters
    stalwart run --nproc 4 --group-size 2 examples/gpt_hsdp.py --tiny --steps 20 --chaos-seed 3
    python examples/gpt_hsdp.py --tiny                                      # one process

Each replica is a group of ``--group-size`` ranks that shards the model with FSDP2 on
``job.shard_mesh``; the job averages gradients across the groups (the replicate dimension,
the fault-tolerant one). A rank's death takes its group out; a new group heals shard by shard
from a live one while the others keep training. The data is an
:class:`~stalwart.elastic.ElasticSampler` over generated token sequences: the committed step
is the cursor, so every sample is read once per epoch whatever the membership, and the
sampler rides in the committed state (``TrainingState(stateful=...)``). Checkpoint tiers are
attached (``Job(state, checkpoint=...)``): a durable tier every ``--ckpt-every`` steps,
written once per shard by replica group 0, from which the job resumes by itself when every
group died at once (or when the whole ``stalwart run`` is started again). ``--chaos-seed``
kills one worker at a seeded step (:class:`stalwart.testing.KillSchedule`).

Rank 0 prints the step, the loss and the tokens per second; the final line holds the digest.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

import stalwart
from stalwart.checkpoint import EveryNSteps, KeepLast, Tier, TieredCheckpointer
from stalwart.elastic import ElasticSampler, Job
from stalwart.testing import KillSchedule, chaos


@dataclass(frozen=True)
class GPTConfig:
    """The model's shape; the default is GPT-2 small's (~124 M parameters, tied embeddings)."""

    vocab: int = 50_304
    seq_len: int = 256
    d_model: int = 768
    n_layer: int = 12
    n_head: int = 12

    @classmethod
    def tiny(cls) -> GPTConfig:
        return cls(vocab=128, seq_len=32, d_model=64, n_layer=2, n_head=4)


class Block(nn.Module):
    """Pre-norm attention and MLP, each with a residual."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln1, self.ln2 = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.qkv = nn.Linear(c.d_model, 3 * c.d_model)
        self.proj = nn.Linear(c.d_model, c.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(c.d_model, 4 * c.d_model), nn.GELU(), nn.Linear(4 * c.d_model, c.d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, ``n_layer`` blocks, a head tied to the embedding."""

    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(c.vocab, c.d_model), nn.Embedding(c.seq_len, c.d_model)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, c.vocab, bias=False)
        self.head.weight = self.tok.weight
        for m in self.modules():  # GPT-2's initialisation: small weights, logits near zero
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def tokens(c: GPTConfig, n: int, seed: int = 7) -> torch.Tensor:
    """``n`` generated sequences of ``seq_len + 1`` tokens, learnable: x' = (a·x + b) mod V."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, 8, (n, 1), generator=g)
    x = torch.randint(c.vocab, (n, 1), generator=g)
    cols = [x]
    for _ in range(c.seq_len):
        cols.append((a * cols[-1] + 3) % c.vocab)
    return torch.cat(cols, dim=1)


def build(job: Job, c: GPTConfig) -> nn.Module:
    """The GPT on the job's device, every block and the root sharded on the group's mesh."""
    torch.manual_seed(0)  # the same full weights on every rank before sharding
    model = GPT(c).to(job.device)
    mesh = job.shard_mesh
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def tiers(root: Path, every: int) -> TieredCheckpointer:
    """A durable tier under ``root`` (shared by every worker); the job saves and resumes it.

    Under ``stalwart run`` the default process group is the replica group, so each group's
    ranks save their shards together; only replica group 0 writes.
    """
    return TieredCheckpointer(
        [Tier(name="local", root=str(root), every=EveryNSteps(every), keep=KeepLast(2))]
    )


def say(line: str) -> None:
    print(line, flush=True)  # noqa: T201


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tiny", action="store_true", help="a ~0.1 M parameter model, for tests")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=16, help="global batch, sequences")
    p.add_argument("--samples", type=int, default=4096, help="sequences in the dataset")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ckpt", type=Path, default=None, help="durable tier root (default: temp)")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--chaos-seed", type=int, default=None, help="kill one worker, seeded")
    p.add_argument("--chaos-workers", type=int, default=4, help="the workers it picks from")
    p.add_argument("--out", type=Path, default=None, help="write final-<worker>.pt here")
    a = p.parse_args()
    c = GPTConfig.tiny() if a.tiny else GPTConfig()
    random.seed(0)  # every generator is replicated state: seed them alike
    np.random.seed(0)
    data = tokens(c, a.samples)
    sampler = ElasticSampler(a.samples, a.batch, seed=11)
    root = a.ckpt or Path(tempfile.gettempdir()) / "stalwart-gpt-hsdp"
    state = stalwart.TrainingState(stateful={"sampler": sampler})  # model: once sharded
    device = "cuda" if torch.cuda.is_available() else "cpu"
    job = Job(state, verify_every=10, device=device, checkpoint=tiers(root, a.ckpt_every))
    model = build(job, c)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    state.model, state.optimizer = model, opt  # before the first zero_grad(): heals need them
    state.fqn_optimizer_state = True  # DCP's state dicts: a fresh AdamW loads DTensor moments
    torch.manual_seed(0)
    if a.chaos_seed is not None:
        steps = range(max(2, a.steps // 4), max(3, a.steps // 2))
        schedule = KillSchedule.seeded(a.chaos_seed, workers=a.chaos_workers, steps=steps,
                                       where="boundary")  # fmt: skip
        chaos.install(job, schedule)
    job.data_parallel(model)
    optimizer = job.optimizer(opt)
    params = sum(p.numel() for p in model.parameters())  # a DTensor counts its global shape
    if job.rank == 0:
        say(f"GPT {c}: ~{params / 1e6:.1f} M parameters; {job.replicas} replica group(s) "
            f"of {job.group_size}")  # fmt: skip
    t0, seen = time.perf_counter(), 0
    while job.step < a.steps:
        optimizer.zero_grad()
        share = sampler.share(job.step, job.rank, job.size)
        if len(share.indices):
            seq = data[torch.from_numpy(share.indices)].to(job.device)
            logits = model(seq[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, c.vocab), seq[:, 1:].reshape(-1),
                                   reduction="sum") / c.seq_len  # fmt: skip
            (loss * share.loss_scale).backward()
            seen += seq.numel()
        optimizer.step()
        if job.rank == 0 and job.step % 10 == 0 and len(share.indices):
            rate = seen * job.size / (time.perf_counter() - t0)
            per = loss.item() / len(share.indices)
            say(f"step {job.step}: loss {per:.3f} (ln V = {math.log(c.vocab):.2f}), "
                f"{rate:,.0f} tokens/s")  # fmt: skip
    job.close()
    wid = os.environ.get("STALWART_ELASTIC_WORKER") or "single"
    say(f"worker {wid}: done at step {job.step}, digest {job.digest()[:16]}")
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        torch.save({"digest": job.digest(), "step": job.step, "shard_rank": job.shard_rank},
                   a.out / f"final-{wid}.pt")  # fmt: skip


if __name__ == "__main__":
    main()
