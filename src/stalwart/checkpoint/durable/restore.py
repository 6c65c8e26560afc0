"""Load one committed checkpoint into a state tree: check, read in place, restore statefuls.

The state's tensors receive their data in place (each rank reads the box it holds, whatever
the sharding at save time); tensors the state lacks are allocated from the checkpoint; then
stateful objects get their sub-trees through ``load_state_dict``.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import numpy as np
import torch

from stalwart.checkpoint.collective import Group
from stalwart.checkpoint.durable.aliases import share_aliases
from stalwart.checkpoint.durable.integrity import pack_problems
from stalwart.checkpoint.durable.lease import Lease
from stalwart.checkpoint.durable.manifest import Manifest, TensorEntry
from stalwart.checkpoint.durable.plan import local_box
from stalwart.checkpoint.durable.reshard import Box, read_boxes
from stalwart.checkpoint.durable.shared_read import can_share, read_shared, withdraw
from stalwart.checkpoint.fresh_optimizers import prime_fresh_optimizers
from stalwart.errors import (
    CorruptCheckpointError,
    StalwartError,
    StateMismatchError,
)
from stalwart.storage.base import Storage
from stalwart.tree import (
    FlatTree,
    dtype_from_name,
    dtype_name,
    flatten,
    get_path,
    is_stateful,
    iter_skeleton_tensors,
    unflatten,
)

__all__ = [
    "fill_tensor",
    "fill_plain_values",
    "fill_tensors",
    "load_step",
    "match_targets",
    "restore_statefuls",
]

STAGING_BYTES = 1 << 30
"""Most bytes staged on the CPU at once for targets not read in place (GPU, strided)."""

log = logging.getLogger(__name__)

E = TypeVar("E")


def load_step(
    m: Manifest,
    store: Storage,
    state: Any,
    *,
    strict: bool,
    where: str,
    io_pool: ThreadPoolExecutor,
    tensor_pool: ThreadPoolExecutor,
    lease_s: float,
    group: Group | None = None,
) -> tuple[Any, int, list[str]]:
    """Load manifest ``m`` into ``state``; return ``(tree, bytes_read, ignored_problems)``.

    With ``group`` the call is collective: boxes every rank loads alike are read once by
    the group (``shared_read.py``); ``bytes_read`` counts this rank's reads.

    Raises:
        StateMismatchError: keys, shapes or dtypes differ and ``strict`` is True.
        CorruptCheckpointError: a chunk is missing, truncated or fails its hash.
        StepRetiredError: the step was deleted (or replaced and its packs collected) while
            it was being loaded.
    """
    try:
        flat, targets, problems, tensors = _prepare(m, store, state, strict, where)
        lease = Lease(
            store, steps=[m.step], packs=m.packs(), lease_s=lease_s, reading=True
        ).__enter__()
    except BaseException:
        if group is not None:
            withdraw(group)  # the others are about to plan a shared read with this rank
        raise
    try:
        # Retention and gc keep the step from now on; it may have gone since ``m`` was read.
        try:
            lease.check_committed(m, where)
        except BaseException:
            if group is not None:
                withdraw(group)
            raise
        # One planned read of every tensor: chunks in pack order, read ahead and verified
        # in parallel on the I/O pool; staged copies (GPU targets) on the tensor pool.
        items = [(m.tensors[fqn], fqn, t) for fqn, t in tensors.items()]
        try:
            read = fill_tensors(store, items, where, io_pool, copy_pool=tensor_pool, group=group)
        except CorruptCheckpointError:
            lease.check_committed(m, where, deep=True)  # retired meanwhile, not damaged?
            raise
    finally:
        lease.__exit__(None, None, None)
    share_aliases(m.aliases, tensors, set(tensors) - set(targets), where)  # views, verified
    for fqn in targets:
        flat.leaves[fqn].write_back()  # numpy arrays the tree could not share memory with
    tree = unflatten(m.skeleton, tensors.__getitem__)
    restore_statefuls(flat, tree, strict=strict, where=where, problems=problems)
    fill_plain_values(state, tree)
    return tree, read, problems


def _prepare(
    m: Manifest, store: Storage, state: Any, strict: bool, where: str
) -> tuple[FlatTree, dict[str, torch.Tensor], list[str], dict[str, torch.Tensor]]:
    """The state's targets and every tensor to fill (those the state lacks allocated)."""
    prime_fresh_optimizers(state, sharded_only=True)  # moments then sharded too
    flat = flatten(state) if state is not None else FlatTree(skeleton={"k": "none"})
    targets, problems = match_targets(flat, m.tensors, _entry_problem, strict=strict, where=where)
    beyond = pack_problems(m, store)  # before any buffer is sized by a stored length
    if beyond:
        raise CorruptCheckpointError(f"{where}: {next(iter(beyond.values()))}", [*beyond.values()])
    tensors = dict(targets)
    for fqn in iter_skeleton_tensors(m.skeleton):
        if fqn in tensors:
            continue
        e = m.tensors.get(fqn)
        if e is None:
            raise CorruptCheckpointError(f"{where}: skeleton names unknown tensor {fqn!r}")
        tensors[fqn] = _allocate(e, fqn, where)
    return flat, targets, problems, tensors


def _entry_problem(fqn: str, t: torch.Tensor, e: TensorEntry) -> str | None:
    if tuple(t.shape) != e.shape:
        return f"{fqn}: shape {list(t.shape)} in the state, {list(e.shape)} in the checkpoint"
    if dtype_name(t.dtype) != e.dtype:
        return f"{fqn}: dtype {dtype_name(t.dtype)} in the state, {e.dtype} in the checkpoint"
    return None


def match_targets(
    flat: FlatTree,
    entries: Mapping[str, E],
    problem: Callable[[str, torch.Tensor, E], str | None],
    *,
    strict: bool,
    where: str,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The state's tensors that may receive data, for disk and memory restores alike.

    ``problem(fqn, tensor, entry)`` says why a tensor cannot take its entry (None: it can).
    A tensor with no entry under a stateful object is left to its ``load_state_dict``
    (nn.Module raises on missing keys; TrainingState re-derives a new rank's RNG).

    Raises:
        StateMismatchError: problems were found and ``strict`` is True.
    """
    problems: list[str] = []
    targets: dict[str, torch.Tensor] = {}
    stateful_paths = [path for path, _ in flat.statefuls]
    for fqn, leaf in flat.leaves.items():
        e = entries.get(fqn)
        if e is None and any(leaf.path[: len(p)] == p for p in stateful_paths):
            continue
        found = f"{fqn}: in the state but not in the checkpoint" if e is None else None
        found = found or problem(fqn, leaf.tensor, e)  # type: ignore[arg-type]
        if found:
            problems.append(found)
        else:
            leaf.check_writable()  # a read-only numpy array: refuse before reading anything
            _check_no_overlap(fqn, leaf.tensor)
            targets[fqn] = leaf.tensor
    if problems and strict:
        raise StateMismatchError(
            f"the state does not match {where} ({len(problems)} problem(s)):\n  "
            + "\n  ".join(problems[:20])
            + ("\n  …" if len(problems) > 20 else "")
            + "\npass strict=False to load what matches and leave the rest untouched"
        )
    return targets, problems


def _check_no_overlap(fqn: str, t: torch.Tensor) -> None:
    """Refuse a target whose elements share memory (``expand``): no load can fill it."""
    local = local_box(t)[2]
    if local.numel() > 1 and torch._debug_has_internal_overlap(local) == 1:  # MemOverlap::Yes
        raise StateMismatchError(
            f"target tensor for {fqn!r} is an expanded or overlapping view (shape "
            f"{list(local.shape)}, strides {list(local.stride())}): several of its elements "
            "are one memory location, so it cannot receive distinct values; load into a "
            "contiguous tensor (t.contiguous() or t.clone()) and put that in the state"
        )


def fill_plain_values(state: Any, tree: Any) -> None:
    """Write the loaded plain values (ints, strings, ...) into ``state``'s dicts and lists.

    Tensors are loaded in place and stateful objects restore themselves; this makes the rest
    of "in place" true: ``{"model": m, "step": 0}`` holds the saved step after a load. Values
    A tuple of plain values is replaced whole; values in a tuple that also holds tensors, and
    a plain value at the root, cannot be replaced: they are in the returned tree only.
    """
    if isinstance(state, MutableMapping) and isinstance(tree, Mapping):
        pairs: Any = [(k, state[k], tree[k]) for k in list(state) if k in tree]
    elif isinstance(state, list) and isinstance(tree, (list, tuple)) and len(state) == len(tree):
        pairs = [(i, state[i], tree[i]) for i in range(len(state))]
    else:
        return
    for key, mine, loaded in pairs:
        if (_is_plain(mine) and _is_plain(loaded)) or (
            isinstance(mine, tuple) and not _holds_live(mine)  # immutable: replaced whole
        ):
            if mine is not loaded:
                state[key] = loaded
        elif not is_stateful(mine):
            fill_plain_values(mine, loaded)


def _holds_live(v: Any) -> bool:
    """True when ``v`` holds a tensor, an array or a stateful object anywhere."""
    if isinstance(v, (torch.Tensor, np.ndarray)) or is_stateful(v):
        return True
    if isinstance(v, Mapping):
        return any(_holds_live(x) for x in v.values())
    return isinstance(v, (list, tuple)) and any(_holds_live(x) for x in v)


def _is_plain(v: Any) -> bool:
    return not isinstance(v, (torch.Tensor, np.ndarray, Mapping, list, tuple)) and not (
        is_stateful(v)
    )


def restore_statefuls(
    flat: FlatTree, tree: Any, *, strict: bool, where: str, problems: list[str]
) -> None:
    """Hand each stateful object of ``flat`` its sub-tree of the loaded ``tree``."""
    for path, obj in reversed(flat.statefuls):
        try:
            sub = get_path(tree, path)
        except (KeyError, IndexError, TypeError):
            if strict:
                raise StateMismatchError(f"{'.'.join(map(str, path))}: not in {where}") from None
            problems.append(f"{'.'.join(map(str, path))}: not in the checkpoint")
            continue
        _restore_stateful(obj, sub, path, strict, where, problems)


def _allocate(e: TensorEntry, fqn: str, where: str) -> torch.Tensor:
    """A tensor for entry ``e``; a manifest asking for more memory than exists is refused."""
    try:
        return torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    except (RuntimeError, MemoryError) as err:
        raise CorruptCheckpointError(
            f"{where}: tensor {fqn!r} of shape {list(e.shape)} ({e.nbytes} bytes) cannot be "
            f"allocated ({err}); if the manifest is damaged load an earlier step or use "
            "fallback=True, else load into a state whose tensors are already allocated",
            [fqn],
        ) from err


def fill_tensor(
    store: Storage,
    entry: TensorEntry,
    fqn: str,
    target: torch.Tensor,
    where: str,
    pool: ThreadPoolExecutor,
) -> int:
    """Read ``target``'s box (local shard of a DTensor, or all of it) in place."""
    return fill_tensors(store, [(entry, fqn, target)], where, pool)


def fill_tensors(
    store: Storage,
    items: list[tuple[TensorEntry, str, torch.Tensor]],
    where: str,
    pool: ThreadPoolExecutor,
    *,
    copy_pool: ThreadPoolExecutor | None = None,
    group: Group | None = None,
) -> int:
    """Read each ``(entry, fqn, target)``'s box in place; return the stored bytes read.

    Contiguous CPU targets are filled directly; with ``group`` (collective then), boxes
    every rank wants are read once by the group and broadcast (``shared_read.py``). Others
    (GPU, strided) are read into CPU staging tensors, at most ``STAGING_BYTES`` at a time,
    and copied over once verified. ``copy_pool`` (not ``pool``) hashes and copies while
    ``pool`` reads ahead.
    """
    direct: list[Box] = []
    rest: list[tuple[TensorEntry, str, tuple[int, ...], torch.Tensor]] = []
    share = group is not None and can_share(group)
    try:
        for entry, fqn, target in items:
            offsets, _sizes, local = local_box(target)
            if local.numel() == 0:
                continue
            if local.is_contiguous() and local.device.type == "cpu":
                direct.append(Box(entry, fqn, offsets, local))
            else:
                rest.append((entry, fqn, offsets, local))
    except BaseException:
        if share and group is not None:
            withdraw(group)
        raise
    if share and group is not None:
        stats = read_shared(store, direct, group, pool=pool, where=where, verify_pool=copy_pool)
    else:
        stats = read_boxes(store, direct, pool=pool, where=where, verify_pool=copy_pool)
    return stats.bytes_read + _fill_staged(store, rest, where, pool, copy_pool)


def _fill_staged(
    store: Storage,
    rest: list[tuple[TensorEntry, str, tuple[int, ...], torch.Tensor]],
    where: str,
    pool: ThreadPoolExecutor,
    copy_pool: ThreadPoolExecutor | None,
) -> int:
    """Read GPU or strided targets through CPU staging, ``STAGING_BYTES`` at a time."""
    read = 0
    boxes: list[Box] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    copies: list[Future[torch.Tensor]] = []

    def flush() -> None:
        nonlocal read
        stats = read_boxes(store, boxes, pool=pool, where=where, verify_pool=copy_pool)
        read += stats.bytes_read
        for local, dest in staged:
            if copy_pool is None:
                local.copy_(dest)
            else:
                copies.append(copy_pool.submit(local.copy_, dest))
        boxes.clear()
        staged.clear()

    try:
        with torch.no_grad():
            staged_bytes = 0
            for entry, fqn, offsets, local in rest:
                dest = torch.empty(local.shape, dtype=local.dtype)
                boxes.append(Box(entry, fqn, offsets, dest))
                staged.append((local, dest))
                staged_bytes += dest.numel() * dest.element_size()
                if staged_bytes >= STAGING_BYTES:
                    flush()
                    staged_bytes = 0
            if boxes:
                flush()
    finally:
        wait(copies)
    for f in copies:
        f.result()
    return read


def _restore_stateful(
    obj: Any, sub: Any, path: tuple[Any, ...], strict: bool, where: str, problems: list[str]
) -> None:
    """Hand ``sub`` to ``obj.load_state_dict``, translating a refusal into our errors."""
    name = ".".join(map(str, path)) or "<root>"
    try:
        if not strict and "strict" in inspect.signature(obj.load_state_dict).parameters:
            obj.load_state_dict(sub, strict=False)  # nn.Module: load what matches
        else:
            obj.load_state_dict(sub)
    except StalwartError:
        raise
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        msg = f"{name}: {type(obj).__name__}.load_state_dict refused {where}: {e}"
        if strict:
            raise StateMismatchError(
                msg + "\npass strict=False to load what matches and leave the rest untouched"
            ) from e
        problems.append(msg)
        log.warning("%s", msg)
