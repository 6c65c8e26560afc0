"""``run_ranks``: run a function on every rank of a real ``torch.distributed`` world, on CPU.

Distributed code is tested in real processes, not by patching ``torch.distributed``: each rank
is a fresh process that joins a gloo process group through a ``FileStore`` in a temporary folder
(no ports, so tests never collide on a busy machine), runs a module-level function, and sends
its return value (or its traceback) back to the parent. A forkserver that imported torch
once forks the ranks: each starts in milliseconds, not in the seconds of ``import torch``.
The parent turns failures into one :class:`~stalwart.errors.DistributedError` that shows every
failing rank's traceback, kills the whole world on timeout (saying which ranks did not finish
and, where the platform allows, where they were stuck), and always reaps its children.

Ranks may be expected to die: ``expect_exit={2: -signal.SIGKILL}`` accepts rank 2 being
killed (a crash test), and its slot in the result is ``None``.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import select
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator, Mapping
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from stalwart.errors import ConfigError, DistributedError
from stalwart.processes import TORCH, Inherited, preloaded_context

__all__ = ["PRELOAD", "run_ranks"]

log = logging.getLogger(__name__)

PRELOAD = (*TORCH, "stalwart.checkpoint")
"""Modules the forkserver imports once, before it forks the first rank (fork copies them)."""
_KILL_GRACE_S = 5.0  # how long a killed child may take to be reaped
_STACK_DUMP_WAIT_S = 1.0  # how long hung ranks get to write their stacks before SIGKILL
_DUMP_SIGNAL = getattr(signal, "SIGUSR1", None)  # POSIX only; no stack dumps elsewhere


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout_s: float = 120,
    tmp_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    expect_exit: Mapping[int, int] | None = None,
    pg_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return their results.

    Each rank is forked by a forkserver that imported :data:`PRELOAD` (spawned where there is
    no forkserver). Before calling ``fn`` it calls ``torch.distributed.init_process_group(
    "gloo", store=FileStore(...), rank=rank, world_size=world_size)`` and
    ``torch.set_num_threads(1)`` (ranks share the machine's cores); afterwards it destroys the
    process group. The default process group is therefore ready inside ``fn``, and a CPU
    ``DeviceMesh("cpu", ...)`` can be built on it.

    ``fn`` and ``args`` are pickled, so ``fn`` must be a module-level function of an importable
    module (not a lambda, a closure or a function defined in a test body) and ``args`` and the
    return values must be picklable. The children get the parent's ``sys.path`` (test modules
    pytest made importable stay so) and ``os.environ`` as they are at the call.

    Example::

        # my_ranks.py
        def body(rank: int, world_size: int, root: str) -> int:
            Checkpointer(root).save(1, {"w": torch.ones(4)})
            return rank

        # test_my_job.py
        @pytest.mark.timeout(120)
        def test_save(tmp_path):
            assert run_ranks(my_ranks.body, 2, str(tmp_path)) == [0, 1]

    Args:
        fn: module-level function called as ``fn(rank, world_size, *args)`` on every rank.
        world_size: number of ranks (processes), at least 1.
        *args: extra positional arguments for ``fn``, the same on every rank.
        timeout_s: wall-clock limit for the whole world, start-up included; then every rank
            still running is killed and an error names them (with their stacks on POSIX).
        tmp_dir: folder for the ``FileStore`` file and stack dumps; a fresh temporary folder
            (removed afterwards) when ``None``.
        env: environment variables for the children only, on top of the parent's (not seen
            by :data:`PRELOAD`'s imports: a variable torch reads at import has no effect).
        expect_exit: ``{rank: exit code}`` for ranks that are expected to die without returning,
            such as ``{2: -signal.SIGKILL}`` for a rank killed by SIGKILL (negative codes are
            signals) or ``{1: 3}`` for ``os._exit(3)``. Their results are ``None``. A listed rank
            that returns normally, or dies with another code, is a failure.
        pg_timeout_s: the process group's collective timeout (default: ``timeout_s``).

    Returns:
        ``fn``'s return value on each rank, indexed by rank (``None`` for expected deaths).

    Raises:
        ConfigError: bad arguments, or ``fn``/``args`` cannot be pickled.
        DistributedError: a rank raised (every failing rank's traceback is in the message),
            died unexpectedly, or did not finish within ``timeout_s``.
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ConfigError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s!r}")
    expected = dict(expect_exit or {})
    bad_ranks = [r for r in expected if not 0 <= r < world_size]
    if bad_ranks:
        raise ConfigError(f"expect_exit names ranks {bad_ranks} outside 0..{world_size - 1}")
    if 0 in expected.values():
        raise ConfigError("expect_exit code 0 is a normal return; list only ranks that die")
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        job = pickle.dumps((fn, args))
    except Exception as e:
        raise ConfigError(
            f"run_ranks cannot send {name} and its arguments to the ranks ({e}); fn must be a "
            "module-level function of an importable module and the arguments picklable"
        ) from e

    environ = {**os.environ, **{str(k): str(v) for k, v in (env or {}).items()}}
    ctx = preloaded_context(PRELOAD)
    with _work_dir(tmp_dir) as work:
        store_path = str(work / f"filestore-{uuid.uuid4().hex}")
        dumps = [work / f"stacks-{uuid.uuid4().hex[:8]}-rank{r}.txt" for r in range(world_size)]
        procs: list[BaseProcess] = []
        conns: list[Connection] = []
        try:
            for rank in range(world_size):
                recv, send = ctx.Pipe(duplex=False)
                p = ctx.Process(
                    target=_child_main,
                    args=(
                        job,
                        Inherited(environ),
                        rank,
                        world_size,
                        store_path,
                        pg_timeout_s or timeout_s,
                        str(dumps[rank]),
                        send,
                    ),
                    name=f"run_ranks-{name}-rank{rank}",
                    daemon=True,
                )
                p.start()
                send.close()  # the child holds the only writing end now
                procs.append(p)
                conns.append(recv)
            outcomes = _collect(procs, conns, time.monotonic() + timeout_s)
            hung = [r for r, o in enumerate(outcomes) if o is None]
            lingering = [r for r, o in enumerate(outcomes) if o is not None and procs[r].is_alive()]
            stacks = _dump_stacks(procs, hung + lingering, dumps)
        finally:
            codes = _reap(procs)
            for c in conns:
                c.close()
        errors = _judge(outcomes, codes, expected)
        if hung:
            errors.append(
                f"rank(s) {hung} did not finish within timeout_s={timeout_s:g} and were killed"
            )
        if lingering:
            errors.append(
                f"rank(s) {lingering} returned but did not exit within timeout_s={timeout_s:g} "
                "(stuck tearing down the process group?) and were killed"
            )
        if stacks:
            errors.append(stacks.lstrip("\n"))
        if errors:
            raise DistributedError(
                f"run_ranks({name}, world_size={world_size}) failed:\n\n" + "\n\n".join(errors)
            )
        return [o[1] if o is not None and o[0] == "ok" else None for o in outcomes]


# -- parent side ---------------------------------------------------------------------------


@contextlib.contextmanager
def _work_dir(tmp_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    if tmp_dir is not None:
        path = Path(tmp_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    path = Path(tempfile.mkdtemp(prefix="stalwart-ranks-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


Outcome = tuple[str, Any]
"""``("ok", value)``, ``("error", traceback text)`` or ``("exit", None)`` (died silently)."""


def _collect(
    procs: list[BaseProcess], conns: list[Connection], deadline: float
) -> list[Outcome | None]:
    """Wait for every rank's message or death until ``deadline``; None marks a hung rank."""
    outcomes: list[Outcome | None] = [None] * len(procs)
    waiting: dict[Any, int] = {}
    for r, (p, c) in enumerate(zip(procs, conns, strict=True)):
        waiting[c] = r
        waiting[p.sentinel] = r
    while any(o is None for o in outcomes):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for ready in wait(list(waiting), timeout=left):
            if ready not in waiting:  # its twin (pipe or sentinel) was handled already
                continue
            r = waiting.pop(ready)
            if outcomes[r] is not None:
                continue
            if isinstance(ready, Connection):
                try:
                    outcomes[r] = _receive(ready)
                except (EOFError, OSError):
                    outcomes[r] = ("exit", None)  # died before it could answer
                    waiting.pop(procs[r].sentinel, None)
            else:
                # The process ended; a message it sent first is still in the pipe.
                conn = conns[r]
                try:
                    outcomes[r] = _receive(conn) if conn.poll() else ("exit", None)
                except (EOFError, OSError):  # killed while (not) writing its result
                    outcomes[r] = ("exit", None)
                waiting.pop(conn, None)
    # A rank that answered must also exit; give stragglers until the deadline.
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    return outcomes


def _receive(conn: Connection) -> Outcome:
    # Plain pickle, not the Connection's ForkingPickler: torch registers reducers there that
    # pass tensors through shared memory owned by the sender, which is about to exit.
    outcome: Outcome = pickle.loads(conn.recv_bytes())
    return outcome


def _dump_stacks(procs: list[BaseProcess], hung: list[int], dumps: list[Path]) -> str:
    """Ask hung ranks for their Python stacks (SIGUSR1 + faulthandler); return the text."""
    if _DUMP_SIGNAL is None or not hung:
        return ""
    for r in hung:
        pid = procs[r].pid
        if procs[r].is_alive() and pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, _DUMP_SIGNAL)
    time.sleep(_STACK_DUMP_WAIT_S)
    parts = []
    for r in hung:
        try:
            text = dumps[r].read_text(errors="replace").strip()
        except OSError:
            continue
        if text:
            parts.append(f"\n--- rank {r} stacks ---\n{text}")
    return "".join(parts)


def _reap(procs: list[BaseProcess]) -> list[int | None]:
    """Kill every child still running, wait for all: no orphans, no zombies; exit codes."""
    for p in procs:
        if p.is_alive():
            p.kill()
    codes: list[int | None] = []
    for p in procs:
        p.join(_KILL_GRACE_S)
        codes.append(p.exitcode)
        if p.is_alive():  # pragma: no cover - SIGKILL is not ignorable
            log.error("rank process %s (pid %s) survived SIGKILL", p.name, p.pid)
        else:
            p.close()
    return codes


def _judge(
    outcomes: list[Outcome | None], codes: list[int | None], expected: dict[int, int]
) -> list[str]:
    """Turn outcomes and exit codes into error paragraphs (empty when all went as planned)."""
    errors = []
    for r, o in enumerate(outcomes):
        if o is None:
            continue  # reported as hung by the caller
        code = codes[r]
        if r in expected:
            if o[0] == "exit" and code == expected[r]:
                continue
            got = "returned normally" if o[0] == "ok" else f"exited with {_describe_code(code)}"
            errors.append(
                f"rank {r} was expected to exit with {_describe_code(expected[r])} but {got}"
                + (f":\n{o[1]}" if o[0] == "error" else "")
            )
        elif o[0] == "error":
            errors.append(f"rank {r} raised:\n{o[1]}")
        elif o[0] == "exit":
            errors.append(
                f"rank {r} exited with {_describe_code(code)} without returning a result "
                "(crashed, killed, or called os._exit); pass expect_exit if that is intended"
            )
    return errors


def _describe_code(code: int | None) -> str:
    if code is None:
        return "an unknown code"
    if code < 0:
        try:
            return f"code {code} (signal {signal.Signals(-code).name})"
        except ValueError:
            return f"code {code} (signal {-code})"
    return f"code {code}"


# -- child side ----------------------------------------------------------------------------


def _child_main(
    job: bytes,
    inherited: Inherited,
    rank: int,
    world_size: int,
    store_path: str,
    pg_timeout_s: float,
    dump_path: str,
    conn: Connection,
) -> None:
    """Entry point of one rank: join the group, run ``fn``, answer, leave the group.

    ``job``, ``(fn, args)`` pickled, is unpickled (importing ``fn``'s module) once the
    caller's environment and output are adopted. Every rank passes a barrier before ``fn``:
    a rank that dies at once must not fail a peer still connecting its gloo mesh.
    """
    inherited.adopt()
    _exit_with_caller(conn)
    if _DUMP_SIGNAL is not None:
        dump = open(dump_path, "w")  # noqa: SIM115 - must stay open for the process' lifetime
        faulthandler.register(_DUMP_SIGNAL, file=dump, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: Outcome
    try:
        fn, args = pickle.loads(job)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout_s),
        )
        dist.barrier()
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException:
        outcome = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:  # the return value does not pickle: say so instead
        outcome = ("error", f"rank {rank}: cannot send the result back:\n{traceback.format_exc()}")
        payload = pickle.dumps(outcome)
    conn.send_bytes(payload)
    conn.close()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    if outcome[0] == "error":
        sys.exit(1)


def _exit_with_caller(conn: Connection) -> None:
    """Exit when the caller dies (a test runner killed hard), so no rank is orphaned.

    The caller holds the only reading end of ``conn``: its death closes it, and the writing
    end polls as an error. (A forked rank's parent is the forkserver, which lives as long as
    any rank it forked does, so watching the parent would wait forever.)
    """
    fd = os.dup(conn.fileno())  # stays valid after the rank closes conn

    def watch() -> None:
        poller = select.poll()
        poller.register(fd, 0)  # only POLLERR / POLLHUP: the reader is gone
        while not poller.poll():
            pass
        os._exit(70)

    threading.Thread(target=watch, name="run_ranks-caller-watch", daemon=True).start()
