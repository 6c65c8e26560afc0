"""GPU staging: stall and bandwidth of eager and lazy saves, and exactness on the device.

Runs in well under five minutes on one GPU (``--mib 1024 --reps 5``); on a machine without
CUDA it runs the same code on CPU so that the script itself stays tested.

For each rep, interleaved:
- ``copy``: a plain ``tensor.to("cpu", non_blocking=True)`` into reused pinned buffers plus a
  synchronize (the floor for getting bytes off the device);
- ``eager``: ``Checkpointer.save_async`` blocking time (copies enqueued on a side stream, the
  training stream ordered after them);
- ``lazy``: ``save_async(lazy=True)`` blocking time with the optimizer guarded, and the time
  ``optimizer.step()`` then waits for the copy.
Then exactness: after a queue of kernels, a lazy save followed at once by BN-changing
forwards and an optimizer step must hold the values of the call, byte for byte.

    python bench/gpu_staging.py --mib 1024 --reps 5
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

import stalwart


def _model(mib: int, device: str) -> torch.nn.Module:
    width = 4096
    layers = max(1, mib * 2**20 // (width * width * 4))
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=False), torch.nn.BatchNorm1d(width)]
    return torch.nn.Sequential(*mods).to(device)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=1024, help="parameter bytes (MiB)")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = _model(args.mib, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    x = torch.randn(64, 4096, device=device)
    model(x).sum().backward()
    opt.step()
    nbytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    pinned = [
        torch.empty(p.shape, dtype=p.dtype, pin_memory=device == "cuda")
        for p in model.state_dict().values()
    ]
    rows: dict[str, list[float]] = {"copy": [], "eager": [], "lazy": [], "lazy_step_wait": []}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = stalwart.Checkpointer(tmp, stalwart.CheckpointOptions(keep=stalwart.KeepLast(1)))
        ckpt.guard(opt)
        for rep in range(args.reps + 1):  # the first rep warms buffers and is dropped
            _sync(device)
            t0 = time.perf_counter()
            for dst, src in zip(pinned, model.state_dict().values(), strict=True):
                dst.copy_(src, non_blocking=True)
            _sync(device)
            copy_s = time.perf_counter() - t0

            _sync(device)
            t0 = time.perf_counter()
            pending = ckpt.save_async(2 * rep, {"model": model})
            eager_s = time.perf_counter() - t0
            pending.wait()

            _sync(device)
            t0 = time.perf_counter()
            pending = ckpt.save_async(2 * rep + 1, {"model": model}, lazy=True)
            lazy_s = time.perf_counter() - t0
            model(x).sum().backward()
            t1 = time.perf_counter()
            opt.step()  # waits for the lazy copy still in flight
            _sync(device)
            wait_s = time.perf_counter() - t1
            opt.zero_grad()
            pending.wait()
            if rep:
                for k, v in (("copy", copy_s), ("eager", eager_s), ("lazy", lazy_s)):
                    rows[k].append(v)
                rows["lazy_step_wait"].append(wait_s)

        # exactness under a queue of kernels and an immediate optimizer step
        exact = True
        for step in range(100, 103):
            for _ in range(10):
                model(x).sum().backward()
            want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            pending = ckpt.save_async(step, {"model": model}, lazy=True)
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
            pending.wait()
            got = ckpt.load(None, step)["model"]
            exact &= all(torch.equal(got[k], v) for k, v in want.items())
        ckpt.close()

    copy_med = statistics.median(rows["copy"])
    print(f"device {device}, {nbytes / 2**20:.0f} MiB of state, {args.reps} reps (medians, range)")
    for k, v in rows.items():
        med = statistics.median(v)
        extra = (
            f"  {med / copy_med:.2f}x copy" if k != "copy" else f"  {nbytes / med / 1e9:.2f} GB/s"
        )
        print(f"  {k:15s} {med * 1e3:9.2f} ms  ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f}){extra}")
    print(f"  lazy exact under the next optimizer step: {exact}")


if __name__ == "__main__":
    main()
