"""Where every default of the planner comes from: public reports and stalwart's own benches.

Each default is a :class:`Cited` value: the number, its unit in the name, and the source in
words, so that a result can print the provenance of every input it used. Two kinds of source:

- **public**: a published report, named by title and section (the numbers are quoted, or
  derived from quoted numbers by the arithmetic written next to them);
- **measured here**: a figure from ``docs/benchmarks.md``, named by the bench script that
  produced it. Those were measured on a 2-core CPU box with gloo, not on accelerators: they
  are what stalwart costs today on the machine we have, not a prediction for a GPU cluster.

What no source gives is an **assumption**, said so in its text; the planner's docs list them.

Llama 3's 419 unexpected interruptions are split into the planner's failure kinds by the rows
of the report's Table 5 (root causes of unexpected interruptions in a 54-day snapshot):

    node loss (the host leaves the job)  350  faulty GPU 148, GPU HBM3 72, network switch or
                                              cable 35, host maintenance 32, GPU SRAM 19, GPU
                                              system processor 17, NIC 7, GPU thermal 6, SSD 3,
                                              power supply 3, chassis 2, IO expansion board 2,
                                              CPU 2, system memory 2
    process crash (software)              56  software bug 54, dependency 2
    hang                                   7  NCCL watchdog timeouts
    silent data corruption                 6

The split is ours (which rows take a host out of the job is a judgement), the counts are theirs.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "DALY",
    "LLAMA3",
    "LLAMA3_GPUS",
    "LLAMA3_HOURS",
    "LLAMA3_INTERRUPTIONS",
    "LLAMA3_KINDS",
    "META_RSC",
    "META_RSC_FAILURES_PER_1000_NODE_DAYS",
    "YOUNG",
    "Cited",
    "defaults",
]

LLAMA3 = "Llama 3 (Llama Team, AI @ Meta, 'The Llama 3 Herd of Models', arXiv:2407.21783, 2024)"
META_RSC = (
    "Kokolis et al., 'Revisiting Reliability in Large-Scale Machine Learning Research "
    "Clusters', HPCA 2025, arXiv:2410.21680"
)
YOUNG = "Young, 'A first order approximation to the optimum checkpoint interval', CACM 17(9), 1974"
DALY = (
    "Daly, 'A higher order estimate of the optimum checkpoint interval for restart dumps', "
    "Future Generation Computer Systems 22(3), 2006"
)

LLAMA3_GPUS = 16_384
LLAMA3_HOURS = 54 * 24.0
LLAMA3_INTERRUPTIONS = 419
LLAMA3_KINDS = {"node": 350, "crash": 56, "hang": 7, "sdc": 6}
"""Llama 3's unexpected interruptions by the planner's kinds (module docstring)."""

META_RSC_FAILURES_PER_1000_NODE_DAYS = {"rsc1": 6.50, "rsc2": 2.34}
"""Kokolis et al.: fitted node failure rate r_f of the two clusters (8 A100 GPUs per node)."""


class Cited(NamedTuple):
    """A default value and where it comes from."""

    value: float
    source: str


def _llama3_per_hour(kind: str, per: float) -> Cited:
    n = LLAMA3_KINDS[kind]
    return Cited(
        n / (per * LLAMA3_HOURS),
        f"public: {LLAMA3}, §3.3.4, Table 5: {n} of 419 unexpected interruptions in 54 days on "
        f"16,384 H100s ({kind}; the split by kind is ours, see stalwart.plan.sources)",
    )


_ASYNC = "measured here: bench/async_bench.py (docs/benchmarks.md, run of 2026-12-01 09:16 UTC)"
_BLOCK = "measured here: bench/async_bench.py (docs/benchmarks.md, run of 2026-12-01 08:36 UTC)"
_EC = "measured here: bench/ec_bench.py --mib 64 --reps 7 (docs/benchmarks.md)"
_CHAOS = "measured here: bench/elastic_bench.py --campaign 20 --mixed (docs/benchmarks.md)"
_CKPT = "measured here: bench/ckpt_bench.py --size-gib 1 --reps 3 (docs/benchmarks.md, issue 23)"
_STATE_MB = 12.6  # the async bench's model + optimizer state, saved every step
_STEP_MS = 1000 / 26.98  # its step without checkpoints (26.98 steps/s)


def _loop_cost(steps_per_s: float, extra_ms: float = 0.0) -> float:
    """Seconds of training lost per GB saved: (step with saves - step without) / state size."""
    return (1000 / steps_per_s - _STEP_MS - extra_ms) / _STATE_MB


def defaults() -> dict[str, Cited]:
    """Every default input of the planner, keyed ``section.field``, with its source."""
    return _job_and_fleet() | _tiers() | _costs()


def _job_and_fleet() -> dict[str, Cited]:
    return {
        "job.accelerators": Cited(16_384, f"public: {LLAMA3}, §3.3: 16,384 H100 GPUs"),
        "job.group_size": Cited(
            128,
            f"public: {LLAMA3}, §3.3.2, Table 4: tensor parallel 8 x pipeline parallel 16 = "
            "128 GPUs per model replica (the planner assumes each replica holds a full copy, "
            "as HSDP)",
        ),
        "job.state_gb": Cited(
            4.0, f"public: {LLAMA3}, §3.3.1: checkpoints of 1 MB to 4 GB per GPU"
        ),
        "job.step_s": Cited(
            6 * 405e9 * 16e6 / (16_384 * 400e12),
            f"derived from {LLAMA3}, §3.3.2, Table 4: 6 x 405e9 parameters x 16M tokens per "
            "batch / (16,384 GPUs x 400 TFLOPs/GPU)",
        ),
        "job.accelerators_per_node": Cited(8, f"public: {LLAMA3}, §3.3.1: 8 GPUs per server"),
        "fleet.crash_per_hour": _llama3_per_hour("crash", LLAMA3_GPUS),
        "fleet.hang_per_hour": _llama3_per_hour("hang", LLAMA3_GPUS),
        "fleet.sdc_per_hour": _llama3_per_hour("sdc", LLAMA3_GPUS),
        "fleet.node_loss_per_hour": _llama3_per_hour("node", LLAMA3_GPUS / 8),
        "fleet.rack_loss_per_hour": Cited(
            0.0, "assumption: no public per-rack loss rate; set it to study correlated loss"
        ),
        "fleet.nodes_per_rack": Cited(
            2, f"public: {LLAMA3}, §3.3.1: each rack hosts 16 GPUs in two servers"
        ),
        "fleet.network_gbps": Cited(
            50.0, f"public: {LLAMA3}, §3.3.1: 400 Gbps interconnect per GPU = 50 GB/s"
        ),
    }


def _tiers() -> dict[str, Cited]:
    return {
        "tiers.memory.write_gbps": Cited(
            9.76, f"{_EC}: XOR 4+1 encode 9.76 GB/s, the slowest step of a memory snapshot"
        ),
        "tiers.memory.read_gbps": Cited(
            7.82, f"{_EC}: XOR 4+1 decode 7.82 GB/s (the k shards cross the network too)"
        ),
        "tiers.memory.data_shards": Cited(4, f"{_EC}: erasure-coded groups of 4 data"),
        "tiers.memory.parity_shards": Cited(1, f"{_EC}: + 1 parity member (XOR)"),
        "tiers.disk.write_gbps": Cited(2**30 / 0.575 / 1e9, f"{_CKPT}: 1 GiB saved in 0.575 s"),
        "tiers.disk.read_gbps": Cited(2**30 / 0.630 / 1e9, f"{_CKPT}: 1 GiB loaded in 0.630 s"),
        "tiers.remote.write_gbps": Cited(
            2e12 / LLAMA3_GPUS / 1e9,
            f"public: {LLAMA3}, §3.3.1: Tectonic sustains 2 TB/s, shared by 16,384 GPUs",
        ),
        "tiers.remote.read_gbps": Cited(
            2e12 / LLAMA3_GPUS / 1e9, f"public: {LLAMA3}, §3.3.1: 2 TB/s sustained, per GPU"
        ),
        "tiers.interval_cap_s": Cited(
            3600.0, "assumption (policy): a tier no failure kind lands on saves hourly"
        ),
    }


def _costs() -> dict[str, Cited]:
    lazy = 1.3e-3 / (2**28 / 1e9)  # s/GB: lazy save_async blocks 1.3 ms per 256 MiB
    disk_loop = _loop_cost(21.30) - lazy  # lazy save_async to local disk every step
    return {
        "costs.memory_stall_s_per_gb": Cited(
            lazy, f"{_BLOCK}: lazy save_async blocks 1.3 ms per 256 MiB"
        ),
        "costs.memory_background_s_per_gb": Cited(
            _loop_cost(24.60, (1000 / 21.30 - _STEP_MS) / 20) - lazy + 1 / 9.76,
            f"{_ASYNC}: memory tier every step + disk every 20 costs 24.60 against 26.98 "
            f"steps/s on 12.6 MB, less the disk saves' share; plus the XOR encode ({_EC})",
        ),
        "costs.disk_stall_s_per_gb": Cited(lazy, f"{_BLOCK}: lazy save_async, 1.3 ms per 256 MiB"),
        "costs.disk_background_s_per_gb": Cited(
            disk_loop, f"{_ASYNC}: lazy save_async to disk every step, 21.30 vs 26.98 steps/s"
        ),
        "costs.remote_stall_s_per_gb": Cited(
            lazy, f"{_BLOCK}: lazy save_async, 1.3 ms per 256 MiB"
        ),
        "costs.remote_background_s_per_gb": Cited(
            disk_loop, f"assumption: as the local-disk save's measured cost ({_ASYNC})"
        ),
        "costs.crash_detect_s": Cited(0.16, f"{_CHAOS}: exception in step, median detection"),
        "costs.hang_detect_s": Cited(
            5.1, f"{_CHAOS}: detection <= hang timeout + 0.1 s; stalwart run's default 5 s"
        ),
        "costs.node_detect_s": Cited(
            5.1, "assumption: a dead host closes no socket, so heartbeats find it (as a hang)"
        ),
        "costs.resume_s": Cited(0.04, f"{_CHAOS}: SIGKILL, survivors commit 0.07 s - 0.03 s"),
        "costs.heal_s": Cited(2.90, f"{_CHAOS}: replacement launch -> first commit, SIGKILL"),
        "costs.restart_s": Cited(
            2.90, f"assumption: as a replacement's launch (costs.heal_s, {_CHAOS})"
        ),
        "costs.verify_every_steps": Cited(50, "stalwart.elastic.Job's default verify_every"),
        "costs.spare_s": Cited(0.0, "assumption: a spare node is ready (for every strategy)"),
        "costs.torchrun_restart_s": Cited(
            300.0, "assumption: no public restart time for torchrun at scale; set it"
        ),
        "costs.torchrun_hang_detect_s": Cited(
            600.0, "public: PyTorch's default NCCL timeout, 10 min (pytorch/pytorch#110947)"
        ),
        "costs.torchrun_stall_s_per_gb": Cited(
            75.6e-3 / (2**28 / 1e9),
            f"{_BLOCK}: dcp.async_save with a persistent stager blocks 75.6 ms per 256 MiB",
        ),
        "costs.torchrun_background_s_per_gb": Cited(
            _loop_cost(19.61) - 75.6e-3 / (2**28 / 1e9),
            f"{_ASYNC}: dcp.async_save, persistent stager, every step: 19.61 vs 26.98 steps/s",
        ),
    }
