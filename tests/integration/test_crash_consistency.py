"""Crash consistency of the commit protocol, with real processes killed by SIGKILL.

The claim under test (``checkpointer.py``): data first, then the manifest, atomically; a crash
at any instant leaves every earlier checkpoint loadable and no half checkpoint visible.

* Random kills: one writer process saves step after step on one root and is SIGKILLed by
  this test after a seeded random delay, many times over, so that kills land in the pack
  write, the manifest write, retention and between saves; garbage from every kill stays on
  the root for the next writer. After each kill a fresh reader checks the root.
* Exact kills: the writer kills itself at chosen points of the manifest write (before it,
  after a prefix of the body reached the temporary file, after the whole body, after the
  rename), of the pack write, and of retention.
* Two ranks under gloo (``run_ranks``): one rank dies while persisting a step, or rank 0
  while committing it; the survivor's save raises instead of hanging, and the step stays
  invisible (or, killed after the rename, complete).

After every kill a fresh reader asserts: every step a writer saw ``save`` return (and
retention did not delete) is listed; only steps whose manifest write began are listed; every
listed step loads (each chunk's hash is checked on load), equals the state regenerated from
its step number and passes ``verify``; temporaries are never listed. At the end
``gc(grace_s=0)`` must leave exactly the referenced packs and no temporaries, and every step
must still load.

Lone writers are forked from one zygote process that imported torch once
(``crash_worker.py``), which keeps dozens of kills within seconds. Randomness is in timing
only, from fixed seeds; the assertions do not depend on where a kill lands.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from stalwart.checkpoint import Checkpointer
from stalwart.checkpoint.durable.lease import read_leases
from stalwart.checkpoint.durable.manifest import step_from_key
from stalwart.storage.local import TEMP_PREFIX, LocalStorage
from stalwart.testing.run_ranks import run_ranks

pytestmark = pytest.mark.timeout(300)

WORKER = Path(__file__).with_name("crash_worker.py")
SEED = 20240611
N_RANDOM_KILLS = 32
GLOO_TIMEOUT_S = 15


if str(WORKER.parent) not in sys.path:  # ranks are spawned and import the worker by name
    sys.path.insert(0, str(WORKER.parent))

import crash_worker as worker  # noqa: E402

# -- the zygote that forks writers ----------------------------------------------------------


class Zygote:
    """Drive ``crash_worker.py zygote``: fork jobs, wait for them, kill them."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self._buf = b""
        self.live: set[int] = set()

    def _call(self, cmd: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(cmd) + "\n").encode())
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def _reply(self, timeout_s: float) -> dict[str, Any] | None:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the zygote exited with {self.proc.wait()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def spawn(self, job: dict[str, Any]) -> int:
        reply = self._call({"cmd": "spawn", "job": job}, timeout_s=30)
        assert reply is not None, "the zygote did not fork within 30 s"
        self.live.add(reply["pid"])
        return int(reply["pid"])

    def kill(self, pid: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def wait(self, pid: int, timeout_s: float) -> tuple[int, bool]:
        """Exit status of ``pid`` (negative: killed by that signal) and whether it timed out."""
        reply = self._call({"cmd": "wait", "pid": pid}, timeout_s)
        timed_out = reply is None
        if timed_out:
            self.kill(pid)
            reply = self._reply(30)
            assert reply is not None, f"process {pid} survived SIGKILL"
        self.live.discard(pid)
        return int(reply["status"]), timed_out

    def close(self) -> None:
        for pid in list(self.live):
            self.kill(pid)
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    try:
        yield z
    finally:
        z.close()


# -- what the writers said, and what a reader must find -------------------------------------


@dataclass
class Oplog:
    """The lines a writer logged before it died (see ``RecordingStorage``)."""

    lines: list[str]

    @classmethod
    def read(cls, path: Path) -> Oplog:
        text = path.read_text() if path.exists() else ""
        return cls([ln for ln in text.split("\n") if ln])  # a torn last line is dropped

    def steps_with(self, prefix: str) -> set[int]:
        """Steps whose manifest key follows ``prefix`` (like ``"B write "``) in the log."""
        out = set()
        for ln in self.lines:
            if ln.startswith(prefix):
                s = step_from_key(ln.split()[2])
                if s is not None:
                    out.add(s)
        return out

    def in_flight(self) -> int | None:
        """The step being saved when the writer died, if any."""
        started = [int(ln.split()[1]) for ln in self.lines if ln.startswith("S ")]
        done = {int(ln.split()[1]) for ln in self.lines if ln[:2] in ("C ", "F ")}
        return started[-1] if started and started[-1] not in done else None

    def phase(self) -> str:
        """Where the writer was when it died, from its last log line."""
        last = self.lines[-1] if self.lines else ""
        table = [
            ("", "startup"),
            ("ready", "startup"),
            ("S ", "plan and hash"),
            ("B write leases/", "lease"),
            ("E write leases/", "plan and hash"),
            ("B write packs/", "pack write"),
            ("E write packs/", "between pack and manifest"),
            ("B write manifests/", "manifest write"),
            ("E write manifests/", "after commit"),
            ("B delete leases/", "after commit"),
            ("E delete leases/", "after commit"),
            ("B delete manifests/", "retention"),
            ("E delete manifests/", "retention"),
            ("B delete packs/", "retention"),
            ("E delete packs/", "retention"),
            ("C ", "between saves"),
            ("K ", "self-kill"),
        ]
        best = "?"
        for prefix, name in table:
            if last.startswith(prefix):
                best = name  # the longest matching prefix wins: later, longer entries
        return best


def read_committed(path: Path) -> set[int]:
    """Steps a writer reported committed: its ``save`` returned."""
    text = path.read_text() if path.exists() else ""
    return {int(ln) for ln in text.split("\n")[:-1]}  # complete lines only


@dataclass
class History:
    """Everything the writers of one root said, over all their lives."""

    reported: set[int] = field(default_factory=set)
    """Steps whose ``save`` returned."""
    manifest_writes: set[int] = field(default_factory=set)
    """Steps whose manifest write began: the only steps that may ever be listed."""
    manifest_written: set[int] = field(default_factory=set)
    """Steps whose manifest write returned: committed, reported or not."""
    deleted: set[int] = field(default_factory=set)
    """Steps whose manifest retention began to delete."""

    def add(self, oplog: Oplog, committed: set[int], *, keep_last: int | None) -> None:
        self.reported |= committed
        self.manifest_writes |= oplog.steps_with("B write ")
        self.manifest_written |= oplog.steps_with("E write ")
        for s in sorted(oplog.steps_with("B delete ")):
            newer = {c for c in self.manifest_written | self.reported if c > s}
            assert keep_last is not None and len(newer) >= keep_last, (
                f"retention deleted step {s} with only {sorted(newer)} newer "
                f"(keep_last={keep_last})"
            )
            self.deleted.add(s)

    def must_exist(self) -> set[int]:
        return self.reported - self.deleted


def compare(got: Any, want: Any, path: str = "") -> list[str]:
    """Differences between a loaded tree and the expected one, as readable lines."""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            keys = sorted(got) if isinstance(got, dict) else type(got).__name__
            return [f"{path or '<root>'}: keys {keys}, expected {sorted(want)}"]
        return [p for k in want for p in compare(got[k], want[k], f"{path}.{k}".lstrip("."))]
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return [f"{path}: {type(got).__name__}, expected a tensor"]
        if got.dtype != want.dtype or got.shape != want.shape:
            return [
                f"{path}: {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
            ]
        if not torch.equal(got, want):
            return [f"{path}: values differ from the expected ones"]
        return []
    return [] if got == want and type(got) is type(want) else [f"{path}: {got!r} != {want!r}"]


def check_root(
    root: Path, history: History, where: str, *, ranks: tuple[int, ...] = ()
) -> list[int]:
    """Assert the invariants a crash must preserve; return the steps listed."""
    with Checkpointer(root) as ckpt:
        steps = ckpt.steps()
        ctx = f"{where}; listed steps {steps}; reported {sorted(history.reported)}"
        missing = history.must_exist() - set(steps)
        assert not missing, f"committed steps {sorted(missing)} were lost ({ctx})"
        ghosts = set(steps) - history.manifest_writes
        assert not ghosts, f"steps {sorted(ghosts)} listed but never written ({ctx})"
        for s in steps:
            try:
                got = ckpt.load(None, s)
            except Exception as e:
                pytest.fail(f"listed step {s} does not load: {type(e).__name__}: {e} ({ctx})")
            problems = compare(got, worker.expected_state(s, SEED, ranks=ranks))
            assert not problems, f"step {s} holds wrong data: {problems[:5]} ({ctx})"
            report = ckpt.verify(s)
            assert report.ok, f"step {s} fails verify: {report.damaged[:5]} ({ctx})"
        store = LocalStorage(root)
        keys = {i.key for i in store.list()}
        listed_temps = [k for k in keys if k.rsplit("/", 1)[-1].startswith(TEMP_PREFIX)]
        assert not listed_temps, f"temporaries listed as objects: {listed_temps} ({ctx})"
        bad = [k for k in keys if k.startswith("manifests/") and step_from_key(k) is None]
        assert not bad, f"unexpected objects under manifests/: {bad} ({ctx})"
    return steps


def temps_under(root: Path) -> list[Path]:
    return [p for p in root.rglob(f"{TEMP_PREFIX}*") if p.is_file()]


def expire_leases(store: LocalStorage) -> None:
    """Let every lease on ``store`` run out without waiting on the wall clock: read them with a
    clock set just past the last one's expiry, which removes them as expired."""
    expiries = []
    for info in store.list("leases/"):
        try:
            expiries.append(float(json.loads(store.read(info.key))["expires_unix"]))
        except Exception:
            continue
    if expiries:
        later = max(expiries) + 0.05
        read_leases(store, remove_expired=True, clock=lambda: later)


def collect_and_check(root: Path, history: History, where: str, **kw: Any) -> Any:
    """Let the writers' leases run out, gc with no grace, and check nothing but garbage went."""
    store = LocalStorage(root)
    expire_leases(store)
    with Checkpointer(root) as ckpt:
        report = ckpt.gc(grace_s=0)
        referenced = set().union(*(ckpt.manifest(s).packs() for s in ckpt.steps()))
    packs = {i.key for i in store.list("packs/")}
    leased = read_leases(store).packs
    assert packs == referenced, (
        f"{where}: after gc(grace_s=0), unreferenced packs {sorted(packs - referenced)} remain "
        f"(leased: {sorted(leased)}), referenced ones missing: {sorted(referenced - packs)}"
    )
    assert not temps_under(root), f"{where}: temporaries survived gc: {temps_under(root)}"
    check_root(root, history, f"{where}, after gc", **kw)
    return report


def job_for(tmp: Path, name: str, root: Path, first_step: int, n_steps: int, **kw: Any) -> dict:
    return {
        "root": str(root),
        "seed": SEED,
        "first_step": first_step,
        "n_steps": n_steps,
        "oplog": str(tmp / f"{name}.oplog"),
        "committed": str(tmp / f"{name}.committed"),
        "log": str(tmp / f"{name}.log"),
        # A writer's lease names every step it saw; a killed writer's lease must expire
        # before the next one's retention may delete anything (and before the final gc).
        "lease_s": 0.25,
        **kw,
    }


def child_log(job: dict) -> str:
    p = Path(job["log"])
    return p.read_text()[-3000:] if p.exists() else "(no output)"


def wait_ready(job: dict, pid: int, timeout_s: float = 30) -> None:
    path = Path(job["oplog"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_bytes().startswith(b"ready"):
            return
        time.sleep(0.001)
    pytest.fail(f"writer {pid} never became ready: {child_log(job)}")


# -- 1. random kills, many times, one root ---------------------------------------------------


def test_random_sigkill_never_loses_or_exposes_a_checkpoint(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "root"
    history = History()
    rng = random.Random(SEED)

    # A clean run first: earlier checkpoints to protect, and the time one save takes here.
    job = job_for(tmp_path, "calibrate", root, 0, 3)
    pid = zygote.spawn(job)
    status, _ = zygote.wait(pid, timeout_s=120)
    assert status == 0, child_log(job)
    oplog = Oplog.read(Path(job["oplog"]))
    history.add(oplog, read_committed(Path(job["committed"])), keep_last=None)
    check_root(root, history, "after the clean run")
    done = [float(ln.split()[2]) for ln in oplog.lines if ln.startswith("C ")]
    cycle_s = max(0.01, done[-1] - done[-2])  # one save plus making the next state
    max_delay_s = min(2.0, 6 * cycle_s)  # kills spread over about six saves

    next_step = 3
    phases: Counter[str] = Counter()
    for i in range(N_RANDOM_KILLS):
        keep_last = None if i % 3 == 0 else 4
        # Stratified delays: iteration i kills in the i-th slice of [0, max_delay_s).
        delay_s = (i + rng.random()) / N_RANDOM_KILLS * max_delay_s
        job = job_for(
            tmp_path,
            f"kill{i:02d}",
            root,
            next_step,
            1000,
            zstd=i % 2 == 1,
            keep_last=keep_last,
            pause_s=rng.choice([0.0, 0.002, 0.01]),
        )
        pid = zygote.spawn(job)
        wait_ready(job, pid)
        time.sleep(delay_s)
        zygote.kill(pid)
        status, _ = zygote.wait(pid, timeout_s=30)
        oplog = Oplog.read(Path(job["oplog"]))
        phase = oplog.phase()
        phases[phase] += 1
        committed = read_committed(Path(job["committed"]))
        where = (
            f"iteration {i} (kill {delay_s * 1e3:.1f} ms after ready, in {phase}; "
            f"zstd={i % 2 == 1}, keep_last={keep_last}; saved {sorted(committed)})"
        )
        assert status == -signal.SIGKILL, f"{where}: exit status {status}: {child_log(job)}"
        history.add(oplog, committed, keep_last=keep_last)
        steps = check_root(root, history, where)
        # Re-save the step that was in flight: it may have been committed (replace it) or not.
        flight = oplog.in_flight()
        next_step = flight if flight is not None else max([*steps, *history.reported]) + 1

    print(f"\nkill phases over {N_RANDOM_KILLS} kills: {dict(phases)}")
    print(f"temporaries left by the kills: {len(temps_under(root))}")
    report = collect_and_check(root, history, f"after {N_RANDOM_KILLS} kills")
    print(f"gc removed {len(report.deleted_packs)} garbage packs")


# -- 2. exact kill points in one process -----------------------------------------------------


@dataclass(frozen=True)
class Point:
    name: str
    kill: dict[str, Any]
    committed: bool  # whether the killed step must be visible (its manifest was renamed)
    leaves_temp: bool = False  # whether a temporary of the killed write must stay behind


COMMIT_POINTS = [
    Point(
        "before the manifest write", {"op": "write", "prefix": "manifests/", "at": "before"}, False
    ),
    *(
        Point(
            f"{f:.0%} into the manifest body",
            {"op": "write", "prefix": "manifests/", "at": "mid", "fraction": f},
            False,
            leaves_temp=True,
        )
        for f in (0.0, 0.3, 0.99)
    ),
    Point(
        "after the whole manifest body, before fsync and rename",
        {"op": "write", "prefix": "manifests/", "at": "body"},
        False,
        leaves_temp=True,
    ),
    Point(
        "after the manifest write returned",
        {"op": "write", "prefix": "manifests/", "at": "after"},
        True,
    ),
    Point("before the pack write", {"op": "write", "prefix": "packs/", "at": "before"}, False),
    Point(
        "half way into the pack",
        {"op": "write", "prefix": "packs/", "at": "mid", "fraction": 0.5},
        False,
        leaves_temp=True,
    ),
    Point(
        "after the pack, before the manifest",
        {"op": "write", "prefix": "packs/", "at": "after"},
        False,
    ),
]


def test_sigkill_inside_the_commit_leaves_no_half_checkpoint(
    zygote: Zygote, tmp_path: Path
) -> None:
    root = tmp_path / "root"
    history = History()
    first = 0
    orphans: list[str] = []
    for n, point in enumerate(COMMIT_POINTS):
        kill_step = first + 2  # two clean saves, then the third is killed
        job = job_for(
            tmp_path, f"p{n}", root, first, 3, kill={**point.kill, "nth": 3}, zstd=n % 2 == 1
        )
        before = set(os.listdir(root / "manifests")) if (root / "manifests").exists() else set()
        pid = zygote.spawn(job)
        status, _ = zygote.wait(pid, timeout_s=60)
        oplog = Oplog.read(Path(job["oplog"]))
        committed = read_committed(Path(job["committed"]))
        where = f"kill {point.name} of step {kill_step}"
        assert status == -signal.SIGKILL, f"{where}: exit status {status}: {child_log(job)}"
        assert committed == {first, first + 1}, f"{where}: reported {committed}"
        history.add(oplog, committed, keep_last=None)
        steps = check_root(root, history, where)
        assert (kill_step in steps) == point.committed, (
            f"{where}: step {kill_step} {'missing' if point.committed else 'visible'} in {steps}"
        )
        if point.leaves_temp and point.kill["prefix"] == "manifests/":
            new = [p for p in os.listdir(root / "manifests") if p not in before]
            temps = [p for p in new if p.startswith(TEMP_PREFIX)]
            assert temps, f"{where}: no temporary left in manifests/ ({new})"
            # The store may still hold handed-over bytes in its buffers: at most that many
            # reached the temporary (and it must stay invisible whatever it holds).
            size = (root / "manifests" / temps[0]).stat().st_size
            k_line = next(ln for ln in oplog.lines if ln.startswith("K "))
            handed = int(k_line.split()[2].split("/")[0])
            assert size <= handed, f"{where}: temporary holds {size} B, only {handed} handed over"
        if point.kill == {"op": "write", "prefix": "packs/", "at": "after"}:
            orphans += [
                ln.split()[2]
                for ln in oplog.lines
                if ln.startswith("E write packs/") and f"step-{kill_step:020d}" in ln
            ]
        first = kill_step + 1
    assert orphans, "the pack of the step killed before its manifest was not logged"
    report = collect_and_check(root, history, "after the exact kills")
    assert set(orphans) <= set(report.deleted_packs), (orphans, report.deleted_packs)


def test_sigkill_inside_retention_keeps_the_kept_steps(zygote: Zygote, tmp_path: Path) -> None:
    root = tmp_path / "root"
    history = History()
    job = job_for(tmp_path, "fill", root, 0, 5)
    status, _ = zygote.wait(zygote.spawn(job), timeout_s=60)
    assert status == 0, child_log(job)
    history.add(
        Oplog.read(Path(job["oplog"])), read_committed(Path(job["committed"])), keep_last=None
    )
    # KeepLast(2) after step 5 dooms steps 0..3: die after the first manifest delete; the
    # next life dooms the rest and dies before deleting their packs; the third dies right
    # after deleting a pack, before the save returns.
    first = 5
    for n, kill in enumerate(
        [
            {"op": "delete", "prefix": "manifests/", "nth": 1, "at": "after"},
            {"op": "delete", "prefix": "packs/", "nth": 1, "at": "before"},
            {"op": "delete", "prefix": "packs/", "nth": 1, "at": "after"},
        ]
    ):
        job = job_for(tmp_path, f"r{n}", root, first, 3, keep_last=2, kill=kill)
        expire_leases(LocalStorage(root))  # the previous writer's lease ran out: retention may run
        status, _ = zygote.wait(zygote.spawn(job), timeout_s=60)
        oplog = Oplog.read(Path(job["oplog"]))
        committed = read_committed(Path(job["committed"]))
        where = f"retention kill {kill} ({oplog.phase()}); reported {sorted(committed)}"
        assert status == -signal.SIGKILL, f"{where}: exit status {status}: {child_log(job)}"
        assert any(ln.startswith(f"B delete {kill['prefix']}") for ln in oplog.lines), where
        history.add(oplog, committed, keep_last=2)
        steps = check_root(root, history, where)
        assert first in steps, f"{where}: the step just committed is gone from {steps}"
        first = max([*steps, *history.reported]) + 1
    collect_and_check(root, history, "after the retention kills")


# -- 3. two ranks, one dies mid-save ---------------------------------------------------------


@dataclass(frozen=True)
class RankKill:
    name: str
    victim: int
    kill: dict[str, Any]
    committed: bool = False


def rank_kills() -> list[RankKill]:
    fraction = random.Random(SEED + 1).random()
    pack = {"op": "write", "prefix": "packs/"}
    manifest = {"op": "write", "prefix": "manifests/"}
    return [
        RankKill(
            f"rank 1 {fraction:.0%} into its pack", 1, {**pack, "at": "mid", "fraction": fraction}
        ),
        RankKill("rank 1 before its pack", 1, {**pack, "at": "before"}),
        RankKill("rank 1 after its pack, before the commit", 1, {**pack, "at": "after"}),
        RankKill(
            "rank 0 half way into the manifest", 0, {**manifest, "at": "mid", "fraction": 0.5}
        ),
        # The manifest is in place but rank 0 dies before telling rank 1: the step is
        # committed (and complete) although rank 1's save raised.
        RankKill("rank 0 after the manifest write", 0, {**manifest, "at": "after"}, True),
    ]


def test_rank_killed_mid_save_leaves_no_half_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "root"
    history = History()
    ranks = (0, 1)
    first = 0
    for n, case in enumerate(rank_kills()):
        kill_step = first + 2  # two clean saves, then the third is killed
        jobs = [
            job_for(
                tmp_path,
                f"c{n}-rank{r}",
                root,
                first,
                4,
                zstd=n % 2 == 0,
                kill={**case.kill, "nth": 3} if r == case.victim else None,
            )
            for r in ranks
        ]
        where = f"case {n}: {case.name}, killing step {kill_step}"
        t0 = time.monotonic()
        results = run_ranks(
            worker.rank_job,
            len(ranks),
            jobs,
            timeout_s=GLOO_TIMEOUT_S + 60,
            pg_timeout_s=GLOO_TIMEOUT_S,
            expect_exit={case.victim: -signal.SIGKILL},
            tmp_dir=tmp_path / f"world{n}",
        )
        survivor = 1 - case.victim
        outcome = results[survivor]
        assert outcome["failed"] == kill_step, f"{where}: rank {survivor} returned {outcome}"
        print(f"\n{where}: rank {survivor} raised {outcome['error'][:160]!r}")
        for r, j in enumerate(jobs):
            done = read_committed(Path(j["committed"]))
            assert done == {first, first + 1}, f"{where}: rank {r} reported {sorted(done)}"
            history.add(Oplog.read(Path(j["oplog"])), done, keep_last=None)
        steps = check_root(
            root, history, f"{where} (world done in {time.monotonic() - t0:.1f} s)", ranks=ranks
        )
        assert (kill_step in steps) == case.committed, (
            f"{where}: step {kill_step} {'missing' if case.committed else 'visible'} in {steps}"
        )
        first = kill_step + 1
    collect_and_check(root, history, "after the rank kills", ranks=ranks)
