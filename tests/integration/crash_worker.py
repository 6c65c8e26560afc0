"""Child processes for the crash-consistency tests: save checkpoints until SIGKILLed.

Lone writers: starting a Python process that imports torch costs about two seconds, which
would eat the time budget of a test that kills dozens of writers. So the test starts this
script once as a *zygote*: it imports torch and stalwart, then reads one JSON command per line
on stdin and forks a fresh child per job (the zygote never runs a torch op or starts a thread,
so forking it is safe). Every child is a real process that the test, or the child itself,
kills with SIGKILL.

Commands (one JSON object per line; one JSON reply per line on stdout)::

    {"cmd": "spawn", "job": {...}}   -> {"pid": 1234}
    {"cmd": "wait", "pid": 1234}     -> {"pid": 1234, "status": -9}   (like Popen.returncode)

Ranks of a gloo world run :func:`rank_job` under ``stalwart.testing.run_ranks``.

A job saves ``expected_state(step, seed)`` for consecutive steps through a
:class:`RecordingStorage`, which logs every write and delete to ``job["oplog"]`` (so the test
knows which phase a kill landed in) and, when asked, SIGKILLs the process at an exact point:
before a write, after a prefix of its bytes was handed to the store, after the whole body was
handed over (before fsync and rename), or after it returned. After each ``save`` returns, the
step is appended to ``job["committed"]`` and fsync'd.

Job keys: ``root``, ``seed``, ``first_step``, ``n_steps``, ``oplog``, ``committed``, ``log``;
optional ``zstd`` (bool), ``keep_last`` (int), ``lease_s``, ``pause_s`` (sleep after each
save) and ``kill`` (a rule, see :class:`KillRule`).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import sys
import time
import traceback
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.checkpoint import Checkpointer, CheckpointOptions, KeepAll, KeepLast
from stalwart.storage.base import Buffer, ObjectInfo, Storage
from stalwart.storage.local import LocalStorage

CHUNK_BYTES = 256 << 10
"""Small chunks so that every tensor spans several chunks and several dedup decisions."""


# -- the deterministic state ----------------------------------------------------------------


@functools.lru_cache(maxsize=16)  # made once per process, never mutated
def _base(seed: int, name: str, shape: tuple[int, ...], kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    if kind == "randn":
        return torch.randn(shape, generator=g)
    if kind == "ints":  # small integers as float32: zstd shrinks these, so codecs mix
        return torch.randint(-8, 8, shape, generator=g).to(torch.float32)
    if kind == "bf16":
        return torch.randn(shape, generator=g).to(torch.bfloat16)
    raise ValueError(kind)


def _versioned(
    seed: int, name: str, version: int, shape: tuple[int, ...], kind: str
) -> torch.Tensor:
    # One add per version: every byte of every chunk changes, and it costs ~1 ms, so the
    # writer spends its time saving (where the kills should land), not making states.
    return _base(seed, name, shape, kind) + version


def expected_state(step: int, seed: int, *, ranks: Iterable[int] = ()) -> dict[str, Any]:
    """The state saved as ``step``: a pure function of ``(step, seed)``, about 5 MiB.

    ``w1`` and ``opt.m`` change every step, ``w2`` every other step and ``emb`` never, so each
    save writes new chunks and reuses (deduplicates against) chunks of earlier steps.
    ``ranks`` adds one tensor per rank that only that rank holds (``local.r<rank>``).
    """
    state: dict[str, Any] = {
        "model": {
            "w1": _versioned(seed, "w1", step, (512, 512), "randn"),
            "w2": _versioned(seed, "w2", step // 2, (256, 1024), "randn"),
            "emb": _base(seed, "emb", (1024, 1024), "bf16"),
        },
        "opt": {"m": _versioned(seed, "opt.m", step, (512, 512), "ints")},
        "meta": {"step": step, "tag": f"step-{step}", "counter": torch.tensor([step, -step])},
    }
    local = {f"r{r}": _versioned(seed, f"local{r}", step, (64, 1024), "randn") for r in ranks}
    if local:
        state["local"] = local
    return state


# -- a store that records and kills ---------------------------------------------------------


@dataclass(frozen=True)
class KillRule:
    """Where a job SIGKILLs itself: the ``nth`` (1-based) matching storage call.

    Attributes:
        op: ``write`` or ``delete``.
        prefix: the key prefix that matches (``packs/``, ``manifests/``).
        nth: which matching call, counted in this process.
        at: ``before`` the call; ``mid`` once ``fraction`` of the body was handed to the store
            (which writes it to its temporary, or still buffers it); ``body`` after the whole
            body was handed over (before fsync and rename); ``after`` the call returned.
        fraction: for ``mid``, the share of the body handed over before the kill, in [0, 1).
    """

    op: str
    prefix: str
    nth: int = 1
    at: str = "mid"
    fraction: float = 0.5

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> KillRule:
        return cls(**obj)


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # not reached: a signal sent to oneself arrives before kill() returns


class RecordingStorage:
    """Wrap a store: log every write and delete, and SIGKILL the process on a rule.

    The log is appended with unbuffered ``os.write`` calls (``B op key`` before a call,
    ``E op key`` after it), so it survives the kill and tells the test where the process was.
    """

    def __init__(self, inner: Storage, oplog_fd: int, kill: KillRule | None) -> None:
        self.inner = inner
        self.url = inner.url
        self._fd = oplog_fd
        self._kill = kill
        self._matches = 0

    def note(self, line: str) -> None:
        os.write(self._fd, f"{line} {time.time():.6f}\n".encode())

    def _armed(self, op: str, key: str) -> str | None:
        rule = self._kill
        if rule is None or rule.op != op or not key.startswith(rule.prefix):
            return None
        self._matches += 1
        return rule.at if self._matches == rule.nth else None

    def _stream(self, data: Iterable[Buffer], at: str) -> Iterator[Buffer]:
        assert self._kill is not None
        bufs = [memoryview(b).cast("B") for b in data]
        total = sum(len(b) for b in bufs)
        if at == "body":
            yield from bufs
            self.note(f"K body {total}")
            _die()
        cut = int(self._kill.fraction * total)
        done = 0
        for b in bufs:
            if done + len(b) > cut:
                yield b[: cut - done]  # the store writes (or buffers) this prefix ...
                self.note(f"K mid {cut}/{total}")
                _die()  # ... and asks for more: die with the temporary half written
            yield b
            done += len(b)
        _die()  # unreachable: cut < total

    def write(self, key: str, data: Iterable[Buffer]) -> int:
        at = self._armed("write", key)
        self.note(f"B write {key}")
        if at == "before":
            _die()
        if at in ("mid", "body"):
            data = self._stream(data, at)
        n = self.inner.write(key, data)
        self.note(f"E write {key}")
        if at == "after":
            _die()
        return n

    def delete(self, key: str) -> None:
        at = self._armed("delete", key)
        self.note(f"B delete {key}")
        if at == "before":
            _die()
        self.inner.delete(key)
        self.note(f"E delete {key}")
        if at == "after":
            _die()

    def read_into(self, key: str, offset: int, out: memoryview) -> int:
        return self.inner.read_into(key, offset, out)

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        return self.inner.read(key, offset, length)

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        return self.inner.list(prefix)

    def remove_stale_temps(self, older_than_s: float) -> int:
        return LocalStorage.remove_stale_temps(self.inner, older_than_s)  # type: ignore[arg-type]

    def close(self) -> None:
        self.inner.close()


# -- a job ----------------------------------------------------------------------------------


def options_for(job: dict[str, Any]) -> CheckpointOptions:
    keep = KeepLast(job["keep_last"]) if job.get("keep_last") else KeepAll()
    return CheckpointOptions(
        chunk_bytes=CHUNK_BYTES,
        compression="zstd" if job.get("zstd") else None,
        io_threads=2,
        keep=keep,
        lease_s=float(job.get("lease_s", 3600.0)),
    )


def run_job(job: dict[str, Any], rank: int | None = None) -> dict[str, Any]:
    """Save ``n_steps`` steps from ``first_step``, recording each committed step.

    A lone writer lets a failed save raise. A rank (``rank`` given, process group ready)
    stops at the first failed save, which is how it learns that a peer died, and returns
    ``{"failed": step, "error": message}``; ``{"failed": None}`` when every save returned.
    """
    kill = KillRule.from_json(job["kill"]) if job.get("kill") else None
    oplog = os.open(job["oplog"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    committed = os.open(job["committed"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    store = RecordingStorage(LocalStorage(job["root"]), oplog, kill)
    pause_s = float(job.get("pause_s", 0.0))
    torch.set_num_threads(1)
    first = job["first_step"]
    own = () if rank is None else [rank]
    with Checkpointer(store, options_for(job)) as ckpt:
        state = expected_state(first, job["seed"], ranks=own)  # before "ready", so that
        store.note("ready")  # kill delays count from the first save
        for step in range(first, first + job["n_steps"]):
            if step != first:
                state = expected_state(step, job["seed"], ranks=own)
            store.note(f"S {step}")
            try:
                # The first step may be the one a kill left in flight, committed or not:
                # the harness re-saves it on purpose, replacing it if it was committed.
                ckpt.save(step, state, overwrite=step == first)
            except Exception as e:
                if rank is None:
                    raise
                store.note(f"F {step} {type(e).__name__}")
                return {"failed": step, "error": f"{type(e).__name__}: {e}"}
            os.write(committed, f"{step}\n".encode())
            os.fsync(committed)
            store.note(f"C {step}")
            if pause_s:
                time.sleep(pause_s)
        store.note("done")
    return {"failed": None}


def rank_job(rank: int, world_size: int, jobs: list[dict[str, Any]]) -> dict[str, Any]:
    """``run_ranks`` body: rank ``rank`` runs ``jobs[rank]`` in the ready process group."""
    assert len(jobs) == world_size
    return run_job(jobs[rank], rank)


def _child(job: dict[str, Any]) -> None:
    log = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    code = 0
    try:
        run_job(job)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def zygote() -> None:
    """Serve spawn/wait commands until stdin closes; see the module docstring."""
    out = sys.stdout
    children: set[int] = set()
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "spawn":
            out.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(cmd["job"])
            children.add(pid)
            reply: dict[str, Any] = {"pid": pid}
        elif cmd["cmd"] == "wait":
            pid = int(cmd["pid"])
            _, status = os.waitpid(pid, 0)
            children.discard(pid)
            reply = {"pid": pid, "status": _returncode(status)}
        else:
            reply = {"error": f"unknown command {cmd['cmd']!r}"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    for pid in children:  # the test went away: leave no writer behind
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:
            pass


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    if sys.argv[1:] == ["zygote"]:
        zygote()
    else:  # one job, for debugging: python crash_worker.py '{"root": ..., ...}'
        print(run_job(json.loads(sys.argv[1])))
