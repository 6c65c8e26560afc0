"""A Checkpointer made per save reuses the staging buffer of the previous one (same root).

Real saves on tmp dirs: the second Checkpointer's save_async takes the buffer the first
one's save gave back (no new allocation, the pages already faulted in), and loads back
exactly what was saved.
"""

from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path

import torch

import stalwart
from stalwart.checkpoint.buffer_pool import HOST_BUFFERS, HostBufferPool


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 256, generator=g), "b": torch.randn(256, generator=g)}


def test_a_second_checkpointer_reuses_the_first_ones_buffer(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path) as first:
        p1 = first.save_async(1, _state(1))
        p1.wait()
    made = HOST_BUFFERS.made
    second = stalwart.Checkpointer(tmp_path)
    p2 = second.save_async(2, _state(2))
    p2.wait()
    assert p2.slot is p1.slot  # the same host buffer ...
    assert HOST_BUFFERS.made == made  # ... none made for the new Checkpointer
    assert p2.slot is not None and p2.slot.allocations == 1  # and never reallocated
    assert p2.slot.reused_bytes > 0
    state = {k: torch.zeros_like(v) for k, v in _state(2).items()}
    second.load(state, step=2)
    assert all(torch.equal(state[k], v) for k, v in _state(2).items())
    second.close()


def test_another_root_gets_a_buffer_of_its_own(tmp_path: Path) -> None:
    with stalwart.Checkpointer(tmp_path / "a") as a:
        pa = a.save_async(1, _state(1))
        pa.wait()
    with stalwart.Checkpointer(tmp_path / "b") as b:
        pb = b.save_async(1, _state(1))
        pb.wait()
    assert pa.slot is not pb.slot


def test_a_buffer_goes_back_only_once_its_save_is_done() -> None:
    pool = HostBufferPool()
    buf = pool.take("root")
    busy: Future[None] = Future()
    pool.give_when_done("root", buf, [busy])
    assert pool.take("root") is not buf  # still in use: a fresh one
    busy.set_result(None)
    assert pool.take("root") is buf  # done: handed out again
    pool.give("root", buf)
    assert pool.take("elsewhere") is not buf  # buffers are reused by root


def test_the_pool_keeps_at_most_keep_free_buffers() -> None:
    pool = HostBufferPool(keep=2)
    bufs = [pool.take("r") for _ in range(3)]
    for b in bufs:
        pool.give("r", b)
    assert [b for _, b in pool.free] == bufs[1:]
    pool.clear()
    assert pool.free == []
