"""Checkpoint save/load throughput: stalwart against torch.save, safetensors and DCP.

One process, one synthetic fp32 state (a few large tensors, many medium, many small; the
sizes and the values follow from ``--seed``), the same state for every contender. For each
contender and repetition: a fresh directory, a timed save that returns only once the data is
durable (fsync), the page cache dropped when the kernel lets us (``/proc/sys/vm/drop_caches``),
a timed load into preallocated tensors, a bit-exact check of what was loaded (untimed), then
the directory is removed so disk use stays under ~2x the state size.

Contenders:

``torch``        ``torch.save`` to one file, ``fsync`` the file and its directory;
                 ``torch.load(weights_only=True, mmap=False)`` then ``copy_`` into the
                 preallocated tensors (load time includes that copy).
``safetensors``  ``safetensors.torch.save_file`` + ``fsync`` of file and directory;
                 ``load_file`` then ``copy_`` into the preallocated tensors.
``dcp-t1/-t4``   ``torch.distributed.checkpoint.save(no_dist=True)`` with
                 ``FileSystemWriter(sync_files=True, thread_count=1|4)``; ``dcp.load`` in place.
                 (DCP fsyncs its files and ``.metadata`` but not the directory.)
``stalwart``     ``Checkpointer.save`` (fsync'd and committed on return) / ``.load`` in place,
                 verifying each chunk's blake3 hash.
``copy``         ``copy_`` into preallocated tensors and back: the memory-bandwidth ceiling.
``hash``         the CPU work of a verified load without the disk: BLAKE3 of every tensor's
                 bytes (as stalwart's I/O threads do, in parallel) then ``copy_`` into the
                 preallocated tensors; its "save" hashes only. When a load falls short of
                 ``dd``, this says whether the cores (shared, busy) were the limit.
``dd``           ``dd oflag=direct conv=fsync`` write / ``dd iflag=direct`` read of the same
                 byte count from /dev/zero: the disk's direct-I/O bandwidth ceiling.

The contenders' repetitions are interleaved (rep 0 of each, then rep 1, ...), and stalwart's
save and verified load are also given as a fraction of dd's direct write and read bandwidth in
the same repetition (median and range over reps), which a drifting shared disk cannot skew.

Then the incremental case: full save, rewrite ~10 % of the bytes (whole tensors chosen from
the seed), save again; stalwart should write only the changed chunks, DCP and torch.save
rewrite everything.

Run:  .venv/bin/python bench/ckpt_bench.py --size-gib 1 --reps 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

MiB = 1 << 20
GiB = 1 << 30
GB = 1e9

ALL_CONTENDERS = ("torch", "safetensors", "dcp-t1", "dcp-t4", "stalwart", "copy", "hash", "dd")
ALIASES = {"dcp": ("dcp-t1", "dcp-t4")}
INCREMENTAL_CONTENDERS = ("stalwart", "dcp-t4", "torch")

State = dict[str, torch.Tensor]


# --------------------------------------------------------------------------- state


def make_state(total_bytes: int, seed: int) -> State:
    """Deterministic fp32 state of ``total_bytes`` bytes: ~45 % large, ~54 % medium, small rest.

    Large tensors are 64-256 MiB (scaled down when the state is too small to hold one),
    medium 1-16 MiB, small 1-64 KiB (256 of them, or fewer for tiny states).
    """
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (1,), generator=gen))

    sizes: list[tuple[str, int]] = []  # (kind, numel); numel of large/medium is a multiple of 1024
    remaining = total_bytes // 4

    n_small = min(256, max(1, remaining // (64 * 1024)))
    for _ in range(n_small):
        numel = randint(256, 16384)  # 1-64 KiB
        sizes.append(("small", numel))
    remaining -= sum(n for _, n in sizes)

    large_budget = int(remaining * 0.45)
    for mib in (256, 192, 128, 96, 64):
        numel = mib * MiB // 4
        while numel <= large_budget and (large_budget - numel) >= 0:
            sizes.append(("large", numel))
            large_budget -= numel
            remaining -= numel
            if mib >= 128:  # at most one of each of the biggest
                break
    if not any(k == "large" for k, _ in sizes) and remaining > 0:
        numel = (int(remaining * 0.45) // 1024) * 1024
        if numel:
            sizes.append(("large", numel))
            remaining -= numel

    while remaining > 0:
        numel = randint(1 * MiB // 4 // 1024, 16 * MiB // 4 // 1024) * 1024
        if numel >= remaining or remaining - numel < 256 * 1024:  # last one takes the rest
            numel = remaining
        sizes.append(("medium", numel))
        remaining -= numel

    # interleave kinds the way a model's state_dict does (not all small tensors at the end)
    order = torch.randperm(len(sizes), generator=gen).tolist()
    state: State = {}
    counters: dict[str, int] = {}
    for i in order:
        kind, numel = sizes[i]
        idx = counters.get(kind, 0)
        counters[kind] = idx + 1
        shape: tuple[int, ...] = (numel // 1024, 1024) if numel % 1024 == 0 else (numel,)
        t = torch.empty(shape, dtype=torch.float32)
        t.normal_(generator=gen)
        state[f"model.{kind}.{idx}.weight"] = t
    return state


def state_bytes(state: State) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def empty_like_state(state: State) -> State:
    """Preallocated destination, pages faulted in (zeroed) so allocation is not timed."""
    return {k: torch.zeros_like(t) for k, t in state.items()}


def zero_state(state: State) -> None:
    for t in state.values():
        t.zero_()


def check_equal(expected: State, got: State) -> None:
    for k, t in expected.items():
        if not torch.equal(t, got[k]):
            raise AssertionError(f"loaded tensor {k!r} differs from what was saved")


def pick_modified(state: State, fraction: float, seed: int) -> list[str]:
    """Whole tensors adding up to ~``fraction`` of the bytes, chosen from ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    names = list(state)
    order = torch.randperm(len(names), generator=gen).tolist()
    target = fraction * state_bytes(state)
    chosen, acc = [], 0
    for i in order:
        n = names[i]
        b = state[n].numel() * 4
        if acc + b <= target * 1.02:
            chosen.append(n)
            acc += b
        if acc >= target * 0.95:
            break
    return chosen


# --------------------------------------------------------------------------- system


def drop_caches() -> bool:
    """Flush dirty pages and drop the page cache; True when the kernel accepted it."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def mount_of(path: Path) -> dict[str, str]:
    real = os.path.realpath(path)
    best = {"mountpoint": "?", "device": "?", "fstype": "?", "options": "?"}
    best_len = -1
    with contextlib.suppress(OSError), open("/proc/mounts") as f:
        for line in f:
            dev, mnt, fstype, opts, *_ = line.split()
            mnt = mnt.replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) > best_len:
                best = {"mountpoint": mnt, "device": dev, "fstype": fstype, "options": opts}
                best_len = len(mnt)
    return best


def meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            key, val = line.split(":", 1)
            if key in ("MemTotal", "MemAvailable", "MemFree"):
                out[key] = int(val.split()[0]) * 1024
    return out


def machine_info(bench_dir: Path) -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    du = shutil.disk_usage(bench_dir)
    return {
        "nproc": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu": cpu,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "memory": meminfo(),
        "dir": str(bench_dir),
        "filesystem": mount_of(bench_dir),
        "disk_free_bytes": du.free,
        "loadavg_start": os.getloadavg(),
    }


# --------------------------------------------------------------------------- contenders


class Contender:
    """One way to persist and restore the state. ``save`` must return only when durable."""

    name = "?"

    def setup(self, state: State) -> None:
        """Untimed preparation (imports, preallocated buffers)."""

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        raise NotImplementedError

    def teardown(self) -> None:
        pass


def copy_into(dst: State, src: dict[str, torch.Tensor]) -> None:
    for k, t in dst.items():
        t.copy_(src[k])


class TorchSave(Contender):
    name = "torch"

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        path.mkdir(parents=True, exist_ok=True)
        f_path = path / f"step_{step}.pt"
        with open(f_path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(path)
        return {"bytes_written": f_path.stat().st_size}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        loaded = torch.load(path / f"step_{step}.pt", weights_only=True, mmap=False)
        t1 = time.perf_counter()
        copy_into(dst, loaded)
        return {"read_s": t1 - t0, "copy_s": time.perf_counter() - t1}


class SafetensorsSave(Contender):
    name = "safetensors"

    def setup(self, state: State) -> None:
        from safetensors.torch import load_file, save_file

        self._save_file, self._load_file = save_file, load_file

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        path.mkdir(parents=True, exist_ok=True)
        f_path = path / f"step_{step}.safetensors"
        self._save_file(state, str(f_path))
        fsync_path(f_path)
        fsync_path(path)
        return {"bytes_written": f_path.stat().st_size}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        loaded = self._load_file(str(path / f"step_{step}.safetensors"))
        t1 = time.perf_counter()
        copy_into(dst, loaded)
        return {"read_s": t1 - t0, "copy_s": time.perf_counter() - t1}


class DcpSave(Contender):
    def __init__(self, thread_count: int) -> None:
        self.thread_count = thread_count
        self.name = f"dcp-t{thread_count}"

    def setup(self, state: State) -> None:
        import torch.distributed.checkpoint as dcp

        self._dcp = dcp

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        d = path / f"step_{step}"
        writer = self._dcp.FileSystemWriter(d, sync_files=True, thread_count=self.thread_count)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._dcp.save(state, storage_writer=writer, no_dist=True)
        return {"bytes_written": dir_bytes(d)}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        reader = self._dcp.FileSystemReader(path / f"step_{step}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._dcp.load(dst, storage_reader=reader, no_dist=True)
        return {}


class StalwartSave(Contender):
    name = "stalwart"

    def __init__(self, chunk_bytes: int, io_threads: int) -> None:
        self.chunk_bytes = chunk_bytes
        self.io_threads = io_threads
        self._ckpts: dict[Path, Any] = {}

    def setup(self, state: State) -> None:
        try:
            import stalwart
        except ImportError:  # running from a checkout without `pip install -e .`
            sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
            import stalwart
        self._stalwart = stalwart
        self._options = stalwart.CheckpointOptions(
            chunk_bytes=self.chunk_bytes, compression=None, io_threads=self.io_threads
        )

    def _ckpt(self, path: Path) -> Any:
        if path not in self._ckpts:
            self._ckpts[path] = self._stalwart.Checkpointer(str(path), options=self._options)
        return self._ckpts[path]

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        res = self._ckpt(path).save(step, state)
        out = {}
        for k in (
            "bytes_total",
            "bytes_written",
            "bytes_reused",
            "chunks_written",
            "chunks_reused",
            "seconds",
        ):
            if hasattr(res, k):
                out[k] = getattr(res, k)
        return out

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        self._ckpt(path).load(dst, step=step)
        return {}

    def forget(self, path: Path) -> None:
        ckpt = self._ckpts.pop(path, None)
        close = getattr(ckpt, "close", None)
        if callable(close):
            close()

    def teardown(self) -> None:
        for p in list(self._ckpts):
            self.forget(p)


class MemCopy(Contender):
    name = "copy"

    def setup(self, state: State) -> None:
        self._buf = empty_like_state(state)

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        copy_into(self._buf, state)
        return {}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        copy_into(dst, self._buf)
        return {}

    def teardown(self) -> None:
        self._buf = {}


class HashCopy(Contender):
    name = "hash"

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def setup(self, state: State) -> None:
        from concurrent.futures import ThreadPoolExecutor

        import blake3

        self._blake3 = blake3.blake3
        self._pool = ThreadPoolExecutor(self.threads)
        self._src = {k: t.clone() for k, t in state.items()}

    def _hash(self, t: torch.Tensor) -> str:
        return self._blake3(t.reshape(-1).view(torch.uint8).numpy()).hexdigest()

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        list(self._pool.map(self._hash, state.values()))
        return {}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        def one(k: str) -> None:
            self._hash(self._src[k])
            dst[k].copy_(self._src[k])

        list(self._pool.map(one, dst))
        return {}

    def teardown(self) -> None:
        self._pool.shutdown()
        self._src = {}


class DirectDd(Contender):
    name = "dd"
    block = 64 * MiB

    def __init__(self, source: str = "zero") -> None:
        self.source = source
        self._src = "/dev/zero"

    def setup(self, state: State) -> None:
        if shutil.which("dd") is None:
            raise RuntimeError("dd not found on PATH")
        self._count = math.ceil(state_bytes(state) / self.block)
        if self.source == "random":
            # Virtual disks may turn zero writes into cheap unmaps (QEMU detect-zeroes); a
            # random source in RAM (tmpfs, so dropping the page cache keeps it) makes dd
            # write bytes like a checkpoint's. dd then also reads that source: a memory copy.
            fd, self._src = tempfile.mkstemp(prefix="stalwart-dd-src-", dir="/dev/shm")
            with os.fdopen(fd, "wb") as f:
                for _ in range(self._count):
                    f.write(os.urandom(self.block))

    def save(self, state: State, path: Path, step: int) -> dict[str, Any]:
        path.mkdir(parents=True, exist_ok=True)
        cmd = [
            "dd",
            f"if={self._src}",
            f"of={path / 'dd.bin'}",
            "bs=64M",
            f"count={self._count}",
            "oflag=direct",
            "conv=fsync",
            "status=none",
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        return {"bytes_written": self._count * self.block, "cmd": " ".join(cmd)}

    def load(self, dst: State, path: Path, step: int) -> dict[str, Any]:
        cmd = [
            "dd",
            f"if={path / 'dd.bin'}",
            "of=/dev/null",
            "bs=64M",
            "iflag=direct",
            "status=none",
        ]
        subprocess.run(cmd, check=True, capture_output=True)
        return {"cmd": " ".join(cmd)}

    def teardown(self) -> None:
        if self._src != "/dev/zero":
            with contextlib.suppress(OSError):
                os.unlink(self._src)


# --------------------------------------------------------------------------- driver


@dataclass
class Outcome:
    name: str
    bytes: int = 0
    save_s: list[float] = field(default_factory=list)
    load_s: list[float] = field(default_factory=list)
    load_cold: list[bool] = field(default_factory=list)
    extra: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None

    @property
    def save_med(self) -> float | None:
        return statistics.median(self.save_s) if self.save_s else None

    @property
    def load_med(self) -> float | None:
        return statistics.median(self.load_s) if self.load_s else None


def warm_up(c: Contender, state: State, root: Path) -> None:
    """Untimed save+load of a few small tensors: first-call costs (lazy imports, thread pools,
    allocator) are not what we measure."""
    if isinstance(c, (MemCopy, HashCopy, DirectDd)):
        return
    names = [k for k in state if ".small." in k][:8] or list(state)[:1]
    tiny = {k: state[k] for k in names}
    d = fresh_dir(root, f"warmup-{c.name}")
    try:
        c.save(tiny, d, 1)
        c.load({k: torch.empty_like(t) for k, t in tiny.items()}, d, 1)
    finally:
        cleanup(c, d)


def timed(fn: Callable[[], dict[str, Any]]) -> tuple[float, dict[str, Any]]:
    gc.collect()
    t0 = time.perf_counter()
    info = fn()
    return time.perf_counter() - t0, info


def fresh_dir(root: Path, tag: str) -> Path:
    d = root / tag
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def cleanup(c: Contender, d: Path) -> None:
    if isinstance(c, StalwartSave):
        c.forget(d)
    shutil.rmtree(d, ignore_errors=True)


def run_rep(
    c: Contender, out: Outcome, state: State, dst: State, root: Path, rep: int, log
) -> None:
    """One timed save + cold load of ``c``; a failure marks ``out`` and is logged."""
    d = fresh_dir(root, f"{c.name}-rep{rep}")
    try:
        os.sync()
        save_s, sinfo = timed(lambda d=d: c.save(state, d, 1))
        cold = drop_caches()
        zero_state(dst)
        load_s, linfo = timed(lambda d=d: c.load(dst, d, 1))
        if c.name not in ("dd",):
            check_equal(state, dst)
        out.save_s.append(save_s)
        out.load_s.append(load_s)
        out.load_cold.append(cold)
        out.extra.append({"save": sinfo, "load": linfo})
        log(
            f"  {c.name:12s} rep {rep}: save {save_s:7.3f} s  load {load_s:7.3f} s"
            f"  ({'cold' if cold else 'warm'})"
        )
    except Exception as e:  # one broken contender must not sink the others
        out.error = f"{type(e).__name__}: {e}"
        log(f"  {c.name}: FAILED {out.error}\n{traceback.format_exc()}")
    finally:
        cleanup(c, d)


def run_interleaved(
    contenders: list[Contender], state: State, dst: State, root: Path, reps: int, log
) -> list[Outcome]:
    """Rep 0 of every contender, then rep 1 of every contender, ...: the disk and the other
    tenants of a shared machine drift over minutes, and interleaving spreads that drift over
    all contenders instead of charging it to whichever ran last. The order rotates by one
    each rep, so no contender always follows the same one (a deleted 1 GiB file's discards
    can still slow the next writer)."""
    outs = [Outcome(c.name, bytes=state_bytes(state)) for c in contenders]
    for c, out in zip(contenders, outs, strict=True):
        try:
            c.setup(state)
            warm_up(c, state, root)
        except Exception as e:
            out.error = f"{type(e).__name__}: {e}"
            log(f"  {c.name}: FAILED {out.error}\n{traceback.format_exc()}")
    pairs = list(zip(contenders, outs, strict=True))
    for rep in range(reps):
        k = rep % len(pairs)
        for c, out in pairs[k:] + pairs[:k]:
            if out.error is None:
                run_rep(c, out, state, dst, root, rep, log)
    for c in contenders:
        with contextlib.suppress(Exception):
            c.teardown()
    return outs


def dd_ratios(st: Outcome, dd: Outcome, dd_bytes: int) -> dict[str, list[float]]:
    """Per repetition: stalwart's save (load) bandwidth as a fraction of dd's direct write
    (read) bandwidth measured in the same repetition (the reps are interleaved)."""
    out: dict[str, list[float]] = {"save": [], "load": []}
    for kind, a, b in (("save", st.save_s, dd.save_s), ("load", st.load_s, dd.load_s)):
        for s_s, d_s in zip(a, b, strict=False):
            out[kind].append((st.bytes / s_s) / (dd_bytes / d_s))
    return out


def fmt_pct(xs: list[float]) -> str:
    """Median and range of fractions as percentages."""
    if not xs:
        return "-"
    return f"{100 * statistics.median(xs):.0f} % (range {100 * min(xs):.0f}-{100 * max(xs):.0f})"


def run_incremental(
    c: Contender, state: State, modified: list[str], new_vals: State, root: Path, reps: int, log
) -> dict[str, Any]:
    res: dict[str, Any] = {
        "name": c.name,
        "full_s": [],
        "incr_s": [],
        "full_bytes_written": [],
        "incr_bytes_written": [],
        "incr_disk_growth": [],
        "error": None,
        "verified": None,
    }
    backup = {k: state[k].clone() for k in modified}
    try:
        c.setup(state)
        warm_up(c, state, root)
        for rep in range(reps):
            d = fresh_dir(root, f"incr-{c.name}-rep{rep}")
            try:
                os.sync()
                full_s, finfo = timed(lambda d=d: c.save(state, d, 1))
                for k in modified:
                    state[k].copy_(new_vals[k])
                os.sync()
                before = dir_bytes(d)
                incr_s, iinfo = timed(lambda d=d: c.save(state, d, 2))
                iinfo["disk_growth"] = dir_bytes(d) - before
                if rep == 0 and c.name == "stalwart":  # the delta checkpoint must load exactly
                    dst = empty_like_state(state)
                    c.load(dst, d, 2)
                    check_equal(state, dst)
                    del dst
                    res["verified"] = True
                res["full_s"].append(full_s)
                res["incr_s"].append(incr_s)
                res["full_bytes_written"].append(finfo.get("bytes_written"))
                res["incr_bytes_written"].append(iinfo.get("bytes_written"))
                res["incr_disk_growth"].append(iinfo["disk_growth"])
                res.setdefault("incr_info", []).append(iinfo)
                log(
                    f"  incr {c.name:12s} rep {rep}: full {full_s:7.3f} s  incremental "
                    f"{incr_s:7.3f} s  wrote {fmt_bytes(iinfo.get('bytes_written'))}"
                )
            finally:
                for k in modified:
                    state[k].copy_(backup[k])
                cleanup(c, d)
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"
        log(f"  incr {c.name}: FAILED {res['error']}\n{traceback.format_exc()}")
    finally:
        with contextlib.suppress(Exception):
            c.teardown()
    for k in ("full_s", "incr_s"):
        res[k + "_median"] = statistics.median(res[k]) if res[k] else None
    vals = [b for b in res["incr_bytes_written"] if b is not None]
    res["incr_bytes_written_median"] = statistics.median(vals) if vals else None
    growth = res["incr_disk_growth"]
    res["incr_disk_growth_median"] = statistics.median(growth) if growth else None
    return res


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def build_contenders(names: list[str], args: argparse.Namespace) -> list[Contender]:
    table: dict[str, Callable[[], Contender]] = {
        "torch": TorchSave,
        "safetensors": SafetensorsSave,
        "dcp-t1": lambda: DcpSave(1),
        "dcp-t4": lambda: DcpSave(4),
        "stalwart": lambda: StalwartSave(args.chunk_mib * MiB, args.io_threads),
        "copy": MemCopy,
        "hash": lambda: HashCopy(args.io_threads),
        "dd": lambda: DirectDd(args.dd_source),
    }
    return [table[n]() for n in names]


def parse_only(spec: str | None) -> list[str]:
    if not spec:
        return list(ALL_CONTENDERS)
    names: list[str] = []
    for raw in spec.split(","):
        n = raw.strip()
        if not n:
            continue
        expanded = ALIASES.get(n, (n,))
        for e in expanded:
            if e not in ALL_CONTENDERS:
                raise SystemExit(
                    f"--only: unknown contender {n!r}; choose from "
                    f"{', '.join(ALL_CONTENDERS)} (or 'dcp' for both DCP runs)"
                )
            if e not in names:
                names.append(e)
    return names


def main(argv: list[str] | None = None) -> int:
    default_dir = Path(os.environ.get("TMPDIR") or tempfile.gettempdir()) / "stalwart-ckpt-bench"
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="total state size (GiB)")
    p.add_argument("--reps", type=int, default=3, help="repetitions; medians are reported")
    p.add_argument("--dir", type=Path, default=default_dir, help=f"scratch (default {default_dir})")
    p.add_argument(
        "--only",
        default=None,
        help=f"comma list of contenders: {','.join(ALL_CONTENDERS)} ('dcp' = both)",
    )
    p.add_argument("--json", type=Path, default=None, help="write all numbers to this JSON file")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chunk-mib", type=int, default=4, help="stalwart chunk size (MiB)")
    p.add_argument("--io-threads", type=int, default=4, help="stalwart I/O threads")
    p.add_argument(
        "--incr-fraction",
        type=float,
        default=0.10,
        help="fraction of bytes modified for the incremental case",
    )
    p.add_argument("--no-incremental", action="store_true", help="skip the incremental case")
    p.add_argument(
        "--dd-source",
        choices=("zero", "random"),
        default="zero",
        help="what dd writes: /dev/zero, or random bytes staged in /dev/shm (virtual disks "
        "may write zeros faster than data)",
    )
    args = p.parse_args(argv)

    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 132)
    errc = Console(stderr=True, width=console.width)

    def log(msg: str) -> None:
        errc.print(msg, markup=False, highlight=False)

    names = parse_only(args.only)
    root: Path = args.dir
    root.mkdir(parents=True, exist_ok=True)
    total = int(args.size_gib * GiB) // 4 * 4
    machine = machine_info(root)
    if machine["disk_free_bytes"] < 3 * total:
        raise SystemExit(
            f"--dir {root} has {fmt_bytes(machine['disk_free_bytes'])} free; "
            f"need 3x the state ({fmt_bytes(3 * total)}). Pick another --dir."
        )

    t0 = time.perf_counter()
    state = make_state(total, args.seed)
    dst = empty_like_state(state)
    kinds: dict[str, list[int]] = {}
    for k, t in state.items():
        kinds.setdefault(k.split(".")[1], []).append(t.numel() * 4)
    composition = {
        k: {"count": len(v), "bytes": sum(v), "min": min(v), "max": max(v)}
        for k, v in kinds.items()
    }
    log(
        f"state built in {time.perf_counter() - t0:.1f} s: {len(state)} tensors, "
        f"{fmt_bytes(state_bytes(state))}; "
        + ", ".join(
            f"{k}: {c['count']} ({fmt_bytes(c['bytes'])}, {fmt_bytes(c['min'])}-"
            f"{fmt_bytes(c['max'])})"
            for k, c in composition.items()
        )
    )
    in_ram = machine["filesystem"]["fstype"] in ("tmpfs", "ramfs")
    cold_ok = drop_caches() and not in_ram  # dropping the cache cannot evict tmpfs pages

    m = machine
    mem = m["memory"]
    fs = m["filesystem"]
    console.print(
        f"machine: nproc={m['nproc']} (affinity {m['affinity_cpus']}), {m['cpu']}, "
        f"kernel {m['kernel']}, load average {m['loadavg_start'][0]:.2f} at start\n"
        f"python {m['python']}, torch {m['torch']} ({m['torch_threads']} intra-op threads), "
        f"memory {fmt_bytes(mem.get('MemAvailable'))} available of "
        f"{fmt_bytes(mem.get('MemTotal'))}\n"
        f"--dir {m['dir']}: {fs['fstype']} on {fs['device']} (mounted at {fs['mountpoint']}, "
        f"{fs['options']}), {fmt_bytes(m['disk_free_bytes'])} free\n"
        f"state: {len(state)} fp32 tensors, {fmt_bytes(total)} ({total / GB:.3f} GB), seed "
        f"{args.seed}; "
        + ", ".join(f"{c['count']} {k}" for k, c in composition.items())
        + f"\nreps={args.reps} (median shown); page cache dropped between save and load: "
        + (
            "yes -> loads are cold"
            if cold_ok
            else "no: --dir is in RAM (tmpfs) -> loads read memory"
            if in_ram
            else "NO (drop_caches refused) -> loads are warm"
        ),
        markup=False,
        highlight=False,
    )

    log(f"running {', '.join(names)}, interleaved, {args.reps} reps ...")
    outcomes = run_interleaved(build_contenders(names, args), state, dst, root, args.reps, log)
    del dst

    by_name = {o.name: o for o in outcomes}
    ref = by_name.get("stalwart")
    ref_save = ref.save_med if ref and not ref.error else None
    ref_load = ref.load_med if ref and not ref.error else None

    table = Table(
        title=f"checkpoint save/load, {fmt_bytes(total)} fp32 state, median of {args.reps}",
        box=box.SIMPLE_HEAD,
    )
    for col in (
        "contender",
        "save s",
        "save GB/s",
        "load s",
        "load GB/s",
        "save ratio",
        "load ratio",
        "load cache",
    ):
        table.add_column(col, justify="left" if col in ("contender", "load cache") else "right")
    for o in outcomes:
        if o.error:
            table.add_row(o.name, "FAILED", "-", "-", "-", "-", "-", "see below")
            continue
        s, lo = o.save_med, o.load_med
        table.add_row(
            o.name,
            fmt(s),
            fmt(o.bytes / s / GB if s else None, ".2f"),
            fmt(lo),
            fmt(o.bytes / lo / GB if lo else None, ".2f"),
            fmt(s / ref_save if s and ref_save else None, ".2f") + ("x" if ref_save else ""),
            fmt(lo / ref_load if lo and ref_load else None, ".2f") + ("x" if ref_load else ""),
            "n/a (memory)"
            if o.name in ("copy", "hash")
            else "direct I/O"
            if o.name == "dd"
            else "in RAM (tmpfs)"
            if in_ram
            else ("cold" if all(o.load_cold) else "warm"),
        )
    console.print(table)
    for o in outcomes:
        if o.error:
            console.print(f"{o.name} FAILED: {o.error}", markup=False, highlight=False)
    console.print(
        "ratio = contender time / stalwart time (>1: stalwart is faster).\n"
        "torch/safetensors load = read into new tensors + copy_ into preallocated; "
        "dcp/stalwart load in place (all loads checked bit-exact, untimed)."
        + (
            f"\ndd = direct I/O of {fmt_bytes(DirectDd.block * math.ceil(total / DirectDd.block))}"
            f" from {'/dev/zero' if args.dd_source == 'zero' else 'random bytes in /dev/shm'}"
            " (write: oflag=direct conv=fsync, read: iflag=direct)."
            if "dd" in names
            else ""
        ),
        markup=False,
        highlight=False,
    )
    dd = by_name.get("dd")
    vs_dd: dict[str, list[float]] = {}
    if ref and not ref.error and dd and not dd.error and dd.save_s:
        dd_bytes = DirectDd.block * math.ceil(total / DirectDd.block)
        vs_dd = dd_ratios(ref, dd, dd_bytes)
        console.print(
            "stalwart vs dd in the same repetition (median, range over reps): "
            f"save = {fmt_pct(vs_dd['save'])} of dd oflag=direct write "
            f"({fmt_bytes(dd_bytes / statistics.median(dd.save_s))}/s); "
            f"verified load = {fmt_pct(vs_dd['load'])} of dd iflag=direct read "
            f"({fmt_bytes(dd_bytes / statistics.median(dd.load_s))}/s)",
            markup=False,
            highlight=False,
        )

    incremental: list[dict[str, Any]] = []
    incr_names = [n for n in INCREMENTAL_CONTENDERS if n in names]
    modified: list[str] = []
    if not args.no_incremental and incr_names:
        modified = pick_modified(state, args.incr_fraction, args.seed)
        mod_bytes = sum(state[k].numel() * 4 for k in modified)
        gen = torch.Generator().manual_seed(args.seed + 2)
        new_vals = {k: torch.empty_like(state[k]).normal_(generator=gen) for k in modified}
        log(
            f"incremental: modifying {len(modified)} tensors, {fmt_bytes(mod_bytes)} "
            f"({100 * mod_bytes / total:.1f} % of bytes)"
        )
        for c in build_contenders(incr_names, args):
            incremental.append(run_incremental(c, state, modified, new_vals, root, args.reps, log))
        del new_vals

        itable = Table(
            title=f"incremental save: {len(modified)} whole tensors rewritten = "
            f"{fmt_bytes(mod_bytes)} ({100 * mod_bytes / total:.1f} % of "
            f"{fmt_bytes(total)}), median of {args.reps}",
            box=box.SIMPLE_HEAD,
        )
        for col in (
            "contender",
            "full save s",
            "incr save s",
            "full/incr",
            "bytes written (2nd save)",
            "% of state",
            "dir growth",
        ):
            itable.add_column(col, justify="left" if col == "contender" else "right")
        for r in incremental:
            if r["error"]:
                itable.add_row(r["name"], "FAILED", "-", "-", "-", "-", "-")
                continue
            f_s, i_s, b = r["full_s_median"], r["incr_s_median"], r["incr_bytes_written_median"]
            itable.add_row(
                r["name"],
                fmt(f_s),
                fmt(i_s),
                fmt(f_s / i_s if f_s and i_s else None, ".2f") + "x",
                fmt_bytes(b),
                fmt(100 * b / total if b is not None else None, ".1f"),
                fmt_bytes(r["incr_disk_growth_median"]),
            )
        console.print(itable)
        for r in incremental:
            if r["error"]:
                console.print(f"incremental {r['name']} FAILED: {r['error']}", markup=False)
        if any(r.get("verified") for r in incremental):
            console.print(
                "stalwart's second (incremental) checkpoint was loaded and matched "
                "the modified state bit for bit.",
                markup=False,
                highlight=False,
            )

    machine["loadavg_end"] = os.getloadavg()
    busy = max(machine["loadavg_start"][0], machine["loadavg_end"][0])
    console.print(
        f"load average {machine['loadavg_start'][0]:.2f} at start, "
        f"{machine['loadavg_end'][0]:.2f} at end on {machine['nproc']} CPUs"
        + (
            " - the machine was busy with other work; expect noisy timings."
            if busy > 0.5 * (machine["nproc"] or 1)
            else ""
        ),
        markup=False,
        highlight=False,
    )
    with contextlib.suppress(OSError):  # only if empty: never delete a user's folder
        root.rmdir()

    if args.json:
        doc = {
            "machine": machine,
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "state": {"bytes": total, "tensors": len(state), "composition": composition},
            "page_cache_dropped": cold_ok,
            "stalwart_vs_dd_per_rep": vs_dd,
            "results": [
                {
                    "name": o.name,
                    "bytes": o.bytes,
                    "error": o.error,
                    "save_s": o.save_s,
                    "load_s": o.load_s,
                    "save_s_median": o.save_med,
                    "load_s_median": o.load_med,
                    "save_GBps": o.bytes / o.save_med / GB if o.save_med else None,
                    "load_GBps": o.bytes / o.load_med / GB if o.load_med else None,
                    "save_ratio_vs_stalwart": o.save_med / ref_save
                    if o.save_med and ref_save
                    else None,
                    "load_ratio_vs_stalwart": o.load_med / ref_load
                    if o.load_med and ref_load
                    else None,
                    "load_cold": o.load_cold,
                    "details": o.extra,
                }
                for o in outcomes
            ],
            "incremental": {
                "modified_tensors": modified,
                "modified_bytes": sum(state[k].numel() * 4 for k in modified),
                "results": incremental,
            },
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2, default=str))
        log(f"wrote {args.json}")
    return 0 if all(o.error is None for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
