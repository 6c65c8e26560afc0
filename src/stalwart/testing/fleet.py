"""A simulated fleet: hundreds of runs over a pool of hosts, written as fleet logs (one folder per
run: ``members.jsonl``, ``faults.jsonl``, ``run.json``; docs/diagnose.md, "Fleet logs"), with
the causes of each kind of fault planted and returned, to test and measure ``stalwart rca``.

The pool: ``hosts`` hosts of eight GPUs in racks of eight. The racks take the GPU models in
turn (from six racks on, every model is in two racks or more, so no model stands for one
rack); each host draws a CPU model, a kernel, an OS release that ships it, a driver version.
Each run packs its workers onto whole hosts (a worker per device) that the scheduler picks
least-used first, runs for a few thousand steps, and replaces a worker that crashed or hung by
a fresh incarnation on a spare host.

Planted (``FleetTruth.causes``): a few bad hosts and one driver version raise the rate of SDC
suspects, one rack raises the crash rate, one kernel the hang rate, one CPU model the straggler
rate; every kind also strikes everywhere at a low background rate. The bad hosts are drawn
among the hosts without the bad driver, so that each planted cause stands on its own rows.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["FleetTruth", "simulate_fleet"]

SCHEMA = 1  # the fleet-log schema written (stalwart.diagnose.fleet.FLEET_SCHEMA)
GPUS = ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H200")
CPUS = ("AMD EPYC 7763 64-Core Processor", "Intel(R) Xeon(R) Platinum 8480+", "AMD EPYC 9654")
KERNELS = {  # kernel -> the OS releases that ship it (no OS stands for one kernel)
    "5.15.0-105-generic": ("Ubuntu 22.04.4 LTS",),
    "6.5.0-1017-nvidia": ("Ubuntu 22.04.4 LTS",),
    "6.8.0-45-generic": ("Ubuntu 22.04.5 LTS", "Ubuntu 24.04.1 LTS"),
}
DRIVERS = ("535.183.01", "550.54.15", "550.90.07", "560.35.03")
SOFTWARE = (  # python, torch, CUDA runtime of a run's container
    ("3.10.14", "2.3.1+cu121", "12.1"),
    ("3.11.9", "2.4.1+cu124", "12.4"),
    ("3.11.10", "2.5.1+cu124", "12.4"),
)
JOBS = ("llm-7b", "llm-70b", "vit-h", "recsys")
TENSORS = ("layers.3.mlp.fc1.weight", "layers.11.attn.qkv.weight", "embed.weight", "head.bias")
DECIDED_BY = {
    "crash": "exit-signal",
    "hang": "heartbeat-timeout",
    "straggler": "step-time-outlier",
    "sdc_suspect": "parity-majority",  # with two members: "parity-reexecution"
}

# Faults per 1,000 steps served everywhere, and the factor a planted cause multiplies it by.
BACKGROUND = {"crash": 0.004, "hang": 0.004, "straggler": 0.006, "sdc_suspect": 0.002}
FACTOR = {
    ("crash", "rack"): 12.0,
    ("hang", "kernel"): 10.0,
    ("straggler", "cpu_model"): 8.0,
    ("sdc_suspect", "hostname"): 150.0,
    ("sdc_suspect", "cuda_driver"): 25.0,
}


@dataclass(frozen=True)
class FleetTruth:
    """What ``simulate_fleet`` planted and wrote."""

    causes: dict[str, tuple[tuple[str, str], ...]]
    """Fault kind -> the (attribute, value) items planted for it."""
    runs: int
    members: int
    """Worker incarnations written (rows of the members files)."""
    faults: dict[str, int]
    """Fault rows written per kind."""


def simulate_fleet(
    folder: str | Path,
    runs: int = 200,
    seed: int = 0,
    *,
    hosts: int = 48,
    bad_hosts: int = 3,
    workers: tuple[int, ...] = (2, 4, 8, 16),
    steps: tuple[int, int] = (2_000, 8_000),
    max_restarts: int = 3,
) -> FleetTruth:
    """Write ``runs`` simulated runs into ``folder`` (one subfolder each) and return the truth.

    Args:
        folder: where the run folders go (made; existing run folders are overwritten).
        runs: how many runs.
        seed: the simulation's seed; the same seed writes the same files.
        hosts: the pool's size, a multiple of 8 from 16 (racks of 8 hosts of 8 GPUs).
        bad_hosts: hosts that raise the SDC-suspect rate.
        workers: the workers of a run are drawn from these (each at most 8 x hosts / 4).
        steps: a run's length is drawn uniformly from this range.
        max_restarts: replacement incarnations a run may start.
    """
    if hosts < 16 or hosts % 8 or not 1 <= bad_hosts <= hosts // 8 or runs < 1:
        raise ValueError(
            f"simulate_fleet(hosts={hosts}, bad_hosts={bad_hosts}, runs={runs}): need hosts a "
            "multiple of 8 from 16, 1 <= bad_hosts <= hosts / 8 and runs >= 1"
        )
    if max(workers) > 2 * hosts or min(workers) < 1:
        raise ValueError(f"workers={workers}: each from 1 to {2 * hosts} (a quarter of the GPUs)")
    rng = np.random.default_rng(seed)
    pool = _pool(rng, hosts)
    bad_driver = DRIVERS[int(rng.integers(len(DRIVERS)))]
    fine = [h for h in pool if h["cuda_driver"] != bad_driver]
    chosen = rng.choice(len(fine), size=bad_hosts, replace=False)
    causes = {
        "crash": (("rack", f"r{int(rng.integers(hosts // 8))}"),),
        "hang": (("kernel", list(KERNELS)[int(rng.integers(len(KERNELS)))]),),
        "straggler": (("cpu_model", CPUS[int(rng.integers(len(CPUS)))]),),
        "sdc_suspect": (
            *sorted(("hostname", fine[int(i)]["hostname"]) for i in chosen),
            ("cuda_driver", bad_driver),
        ),
    }
    sim = _Simulation(rng, pool, causes, max_restarts)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    for r in range(runs):
        sim.run(root / f"run-{r:05d}", f"run-{r:05d}", int(rng.choice(workers)), steps)
    return FleetTruth(causes, runs, sim.members, dict(sim.faults))


def _pool(rng: np.random.Generator, hosts: int) -> list[dict[str, str]]:
    out = []
    rack_gpu = [GPUS[r % len(GPUS)] for r in range(hosts // 8)]  # each model in 2 racks or more
    for h in range(hosts):
        kernel = list(KERNELS)[int(rng.integers(len(KERNELS)))]
        out.append(
            {
                "hostname": f"gpu-node-{h:03d}",
                "rack": f"r{h // 8}",
                "cpu_model": CPUS[int(rng.integers(len(CPUS)))],
                "kernel": kernel,
                "os": KERNELS[kernel][int(rng.integers(len(KERNELS[kernel])))],
                "cuda_driver": DRIVERS[int(rng.integers(len(DRIVERS)))],
                "gpu_count": "8",
                "gpu": rack_gpu[h // 8],
                "uuid": f"{h:08x}-{int(rng.integers(1 << 16)):04x}",
            }
        )
    return out


class _Simulation:
    """Writes runs, one at a time, counting what it wrote."""

    def __init__(
        self,
        rng: np.random.Generator,
        pool: list[dict[str, str]],
        causes: dict[str, tuple[tuple[str, str], ...]],
        max_restarts: int,
    ) -> None:
        self.rng, self.pool, self.max_restarts = rng, pool, max_restarts
        self.causes = {k: set(v) for k, v in causes.items()}
        self.members = 0
        self.used = np.zeros(len(pool))
        """Runs each host has served (the scheduler's balance)."""
        self.world = 0
        """The workers of the run being written."""
        self.faults = dict.fromkeys(BACKGROUND, 0)

    def rates(self, host: dict[str, str]) -> dict[str, float]:
        """Faults per step of each kind on ``host``."""
        items = set(host.items())
        return {
            kind: base / 1000.0 * math.prod(FACTOR[kind, a] for a, _ in items & self.causes[kind])
            for kind, base in BACKGROUND.items()
        }

    def run(self, folder: Path, run: str, n_workers: int, steps: tuple[int, int]) -> None:
        rng, self.world = self.rng, n_workers
        length = int(rng.integers(steps[0], steps[1] + 1))
        python, torch, cuda = SOFTWARE[int(rng.integers(len(SOFTWARE)))]
        software = {"python": python, "torch": torch, "cuda_runtime": cuda}
        # the scheduler takes the least-used hosts first (ties in random order), as fleet
        # schedulers balance: every host serves about as many runs
        order = np.lexsort((rng.random(len(self.pool)), self.used)).tolist()
        n_hosts = -(-n_workers // 8)
        slots = [(order[w // 8], w % 8) for w in range(n_workers)]
        spares = order[n_hosts:]
        self.used[order[:n_hosts]] += 1
        members: list[dict[str, Any]] = []
        faults: list[dict[str, Any]] = []
        restarts = 0
        for worker, slot in enumerate(slots):
            start, incarnation = 0, 0
            while start < length:
                host = self.attributes(slot, software)
                end, ended_by = self.serve(run, worker, incarnation, host, start, length, faults)
                members.append(_row(run, worker, incarnation, host, steps=end - start))
                if ended_by is None or restarts >= self.max_restarts or not spares:
                    break
                restarts, incarnation, start = restarts + 1, incarnation + 1, end
                slot = (spares.pop(0), 0)
                self.used[slot[0]] += 1
        folder.mkdir(parents=True, exist_ok=True)
        attrs = {"job": JOBS[int(rng.integers(len(JOBS)))], "world_size": str(n_workers)}
        (folder / "run.json").write_text(
            json.dumps({"schema": SCHEMA, "run": run, "attributes": attrs}) + "\n"
        )
        _write_lines(folder / "members.jsonl", members)
        _write_lines(folder / "faults.jsonl", faults)
        self.members += len(members)
        for f in faults:
            self.faults[f["kind"]] += 1

    def attributes(self, slot: tuple[int, int], software: dict[str, str]) -> dict[str, str]:
        """The host attributes a member on ``slot`` (host, device) records."""
        h = self.pool[slot[0]]
        return {
            "hostname": h["hostname"],
            "rack": h["rack"],
            "cpu_model": h["cpu_model"],
            "kernel": h["kernel"],
            "os": h["os"],
            **software,
            "cuda_driver": h["cuda_driver"],
            "gpu_count": h["gpu_count"],
            "device_index": str(slot[1]),
            "device_name": h["gpu"],
            "device_uuid": f"GPU-{h['uuid']}-{slot[1]:04x}",
        }

    def serve(
        self,
        run: str,
        worker: int,
        incarnation: int,
        host: dict[str, str],
        start: int,
        length: int,
        faults: list[dict[str, Any]],
    ) -> tuple[int, str | None]:
        """Steps ``start``.. on ``host`` until the run ends or a crash or hang ends the
        incarnation; its faults appended. Returns (the step it ended at, what ended it)."""
        rng, rate = self.rng, self.rates(host)
        fatal = {k: start + rng.exponential(1 / rate[k]) for k in ("crash", "hang")}
        kind = min(fatal, key=lambda k: fatal[k])
        end = min(length, int(fatal[kind]) + 1)
        ended_by = kind if fatal[kind] < length else None
        at: list[tuple[int, str]] = [
            (int(step), k)
            for k in ("straggler", "sdc_suspect")
            for step in rng.integers(start, end, int(rng.poisson(rate[k] * (end - start))))
        ]
        if ended_by is not None:
            at.append((end - 1, ended_by))
        for step, k in sorted(at):
            tensor = TENSORS[int(rng.integers(len(TENSORS)))] if k == "sdc_suspect" else None
            decided = (
                DECIDED_BY[k] if (k, self.world) != ("sdc_suspect", 2) else "parity-reexecution"
            )
            faults.append(
                _row(
                    run,
                    worker,
                    incarnation,
                    host,
                    step=step,
                    kind=k,
                    decided_by=decided,
                    tensor=tensor,
                )
            )
        return end, ended_by


def _row(
    run: str, worker: int, incarnation: int, host: dict[str, str], **more: Any
) -> dict[str, Any]:
    return {
        "schema": SCHEMA,
        "run": run,
        "worker": worker,
        "incarnation": incarnation,
        **more,
        "host": host,
    }


def _write_lines(path: Path, rows: list[dict[str, Any]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
