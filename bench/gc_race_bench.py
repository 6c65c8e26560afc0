"""Two writers, a loader and ``gc --grace-s 0`` racing on one root (issue 23, item 4).

Four processes share one checkpoint root for ``--minutes``:

``writer-a``, ``writer-b``  save even and odd steps, interleaved, with ``KeepLast`` retention,
                            deduplicating against each other (a frozen tensor shared by all
                            steps, one shared by pairs of steps, one new per step);
``loader``                  loads a random listed step and checks every tensor against the
                            state that step was saved from;
``gc``                      runs ``Checkpointer(root).gc(grace_s=0)`` in a loop.

Reported, and what they must be:

``lost_committed_steps``   0. A committed step that is listed at the end but does not load
                           and verify, or one of the ``--keep-last`` newest committed steps
                           missing at the end.
``misleading_errors``      0. Any failed save or gc, and any failed load except
                           ``StepRetiredError`` / ``CheckpointNotFoundError`` for a step
                           retention took meanwhile (a ``CorruptCheckpointError`` or an
                           ``ObjectNotFoundError`` is misleading; so is wrong data).
``unreferenced_fraction``  < 0.10. Bytes of packs no manifest references after a final
                           ``gc(grace_s=0)`` with no process running, over all pack bytes.

Run:  .venv/bin/python bench/gc_race_bench.py --minutes 10 [--seed 23] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import stalwart
from stalwart.checkpoint.policy import KeepLast
from stalwart.errors import CheckpointNotFoundError, StepRetiredError
from stalwart.storage import LocalStorage

ELEMS = 16 << 10  # 64 KiB per tensor
CHUNK = 16 << 10


def make_state(step: int) -> dict[str, Any]:
    """The state saved as ``step``: what every load of it must return."""
    g = torch.Generator().manual_seed(step)
    return {
        "frozen": torch.ones(ELEMS),
        "shared": torch.full((ELEMS,), float(step // 2)),  # a writes 2k, b 2k+1: same bytes
        "w": torch.randn(ELEMS, generator=g),
        "step": step,
    }


def _options(keep_last: int) -> stalwart.CheckpointOptions:
    return stalwart.CheckpointOptions(chunk_bytes=CHUNK, keep=KeepLast(keep_last), io_threads=2)


def _record(out: Path, kind: str, detail: str) -> None:
    with out.open("a") as f:
        f.write(json.dumps([kind, detail]) + "\n")


def writer(root: str, parity: int, keep_last: int, stop: Any, out: str) -> None:
    log = Path(out)
    logging.basicConfig(level=logging.ERROR)  # "not deduplicating against step n": expected
    with stalwart.Checkpointer(root, _options(keep_last)) as ck:
        step = parity
        while not stop.is_set():
            try:
                ck.save(step, make_state(step))
                _record(log, "committed", str(step))
            except Exception as e:
                _record(log, "misleading", f"save {step}: {type(e).__name__}: {e}")
            # Next: the first step of our parity past the newest listed, so that the two
            # writers interleave (and each one's retention judges the other's steps).
            newest = max(ck.steps(), default=step)
            step = max(step, newest) + 1
            step += (step - parity) % 2


def loader(root: str, seed: int, stop: Any, out: str) -> None:
    log, rng = Path(out), random.Random(seed)
    logging.basicConfig(level=logging.ERROR)
    with stalwart.Checkpointer(root) as ck:
        while not stop.is_set():
            steps = ck.steps()
            if not steps:
                time.sleep(0.01)
                continue
            step = rng.choice(steps)
            try:
                tree = ck.load(None, step)
            except (StepRetiredError, CheckpointNotFoundError) as e:
                _record(log, f"retired:{type(e).__name__}", str(step))
                continue
            except Exception as e:
                _record(log, "misleading", f"load {step}: {type(e).__name__}: {e}")
                continue
            want = make_state(step)
            bad = [k for k in ("frozen", "shared", "w") if not torch.equal(tree[k], want[k])]
            if bad or tree["step"] != step:
                _record(log, "misleading", f"load {step}: wrong data in {bad or ['step']}")
            else:
                _record(log, "loaded", str(step))


def collector(root: str, stop: Any, out: str) -> None:
    log = Path(out)
    while not stop.is_set() and not Path(root).is_dir():
        time.sleep(0.005)  # before the first save: "the root does not exist" is right, not news
    while not stop.is_set():
        try:
            with stalwart.Checkpointer(root) as ck:
                r = ck.gc(grace_s=0)
            _record(log, "gc", f"{len(r.deleted_packs)} {r.temps_removed}")
        except Exception as e:
            _record(log, "misleading", f"gc: {type(e).__name__}: {e}")
        time.sleep(0.005)


def final_check(root: Path, committed: set[int], keep_last: int) -> dict[str, Any]:
    """gc with nothing running, then every listed step must load exactly; count the bytes."""
    with stalwart.Checkpointer(root) as ck:
        ck.gc(grace_s=0)
        listed = ck.steps()
        lost = [s for s in sorted(committed)[-keep_last:] if s not in listed]
        referenced: set[str] = set()
        for step in listed:
            try:
                tree = ck.load(None, step)
                ok = ck.verify(step).ok and all(
                    torch.equal(tree[k], v)
                    for k, v in make_state(step).items()
                    if isinstance(v, torch.Tensor)
                )
                referenced |= ck.manifest(step).packs()
            except Exception:
                ok = False
            if not ok:
                lost.append(step)
    packs = LocalStorage(root).list("packs/")
    total = sum(i.size for i in packs)
    unreferenced = sum(i.size for i in packs if i.key not in referenced)
    return {
        "listed_steps": listed,
        "lost_committed_steps": sorted(set(lost)),
        "pack_bytes": total,
        "unreferenced_bytes": unreferenced,
        "unreferenced_fraction": unreferenced / total if total else 0.0,
        "temporaries_left": [str(p) for p in root.rglob(".tmp-*")],
    }


def run(minutes: float, seed: int, keep_last: int, root: Path) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    logs = {n: root.parent / f"{n}.log" for n in ("writer-a", "writer-b", "loader", "gc")}
    procs = [
        ctx.Process(target=writer, args=(str(root), 0, keep_last, stop, str(logs["writer-a"]))),
        ctx.Process(target=writer, args=(str(root), 1, keep_last, stop, str(logs["writer-b"]))),
        ctx.Process(target=loader, args=(str(root), seed, stop, str(logs["loader"]))),
        ctx.Process(target=collector, args=(str(root), stop, str(logs["gc"]))),
    ]
    for p in procs:
        p.start()
    time.sleep(minutes * 60)
    stop.set()
    for p in procs:
        p.join(120)
    counts: Counter[str] = Counter()
    misleading: list[str] = []
    committed: set[int] = set()
    for path in logs.values():
        for line in path.read_text().splitlines() if path.exists() else []:
            kind, detail = json.loads(line)
            counts[kind] += 1
            if kind == "misleading":
                misleading.append(detail)
            elif kind == "committed":
                committed.add(int(detail))
    result = final_check(root, committed, keep_last)
    return {
        "minutes": minutes,
        "seed": seed,
        "keep_last": keep_last,
        "exit_codes": [p.exitcode for p in procs],
        "saves_committed": len(committed),
        "loads_ok": counts["loaded"],
        "loads_of_retired_steps": sum(v for k, v in counts.items() if k.startswith("retired:")),
        "gc_runs": counts["gc"],
        "misleading_errors": len(misleading),
        "misleading_examples": misleading[:10],
        **result,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=23)
    ap.add_argument("--keep-last", type=int, default=3)
    ap.add_argument("--root", type=Path, default=None, help="a fresh folder (default: a temp one)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="gc-race-") as tmp:
        root = args.root or Path(tmp) / "root"
        report = run(args.minutes, args.seed, args.keep_last, root)
    text = json.dumps(report, indent=2)
    sys.stdout.write(text + "\n")
    if args.json:
        args.json.write_text(text)
    ok = (
        not report["lost_committed_steps"]
        and report["misleading_errors"] == 0
        and report["unreferenced_fraction"] < 0.10
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
