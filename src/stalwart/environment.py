"""What stalwart's library learns from the machine it runs on: every environment variable it
reads, read here and nowhere else, and the host's attributes that fault records carry.

An explicit argument wins over the environment variable, which wins over the default; the
modules that own each setting (``checkpoint/options.py``, ``elastic/protocol.py``,
``elastic/job.py``) ask this module for the raw value, so an operator's knob is found in one
table:

    STALWART_IO_THREADS              checkpoint: CheckpointOptions.io_threads
    STALWART_COMPRESSION             checkpoint: CheckpointOptions.compression
    STALWART_LEASE_S                 checkpoint: CheckpointOptions.lease_s
    STALWART_GC_GRACE_S              checkpoint: CheckpointOptions.gc_grace_s
    STALWART_MAX_INFLIGHT_SAVES      checkpoint: CheckpointOptions.max_inflight_saves
    STALWART_EXIT_FLUSH_TIMEOUT_S    checkpoint: CheckpointOptions.exit_flush_timeout_s
    STALWART_PREEMPTION_SIGNALS      checkpoint: PreemptionGuard's signals
    STALWART_ELASTIC_STORE           elastic: the coordinator's host:port (set by stalwart run)
    STALWART_ELASTIC_WORKER          elastic: this worker's id
    STALWART_ELASTIC_EVENTS          elastic: the event files' folder
    STALWART_ELASTIC_TIMEOUT_S       elastic: each epoch's gloo timeout
    STALWART_ELASTIC_HANG_S          elastic: the hang timeout (heartbeat rate)
    STALWART_ELASTIC_STORE_FILE      elastic: where a re-hosted coordinator's address appears
    RANK, WORLD_SIZE                 torchrun's world (elastic.Job's fixed-world mode)

Each module keeps its defaults and parsing; this one only reads. The test helpers
(``stalwart.testing``) read their own chaos variables, and the launcher passes its whole
environment on to the workers it starts.

:func:`host_attributes` names the machine and the software a member ran on (hostname, CPU,
kernel, OS, Python, torch, CUDA runtime and driver, its GPU), so that a fault can be
attributed to a host or a device and a folder of runs analysed for the attribute values that
single out each kind of fault (``stalwart rca``; the rows are specified in docs/diagnose.md,
"Fleet logs").
"""

from __future__ import annotations

import functools
import importlib
import os
import platform
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from stalwart.errors import ConfigError

__all__ = [
    "CHECKPOINT_VARS",
    "ELASTIC_VARS",
    "HOST_KEYS",
    "TORCHRUN_VARS",
    "elastic_worker",
    "host_attributes",
    "read",
    "setting",
    "torchrun_world",
]

T = TypeVar("T")

CHECKPOINT_VARS = (
    "STALWART_IO_THREADS",
    "STALWART_COMPRESSION",
    "STALWART_LEASE_S",
    "STALWART_GC_GRACE_S",
    "STALWART_MAX_INFLIGHT_SAVES",
    "STALWART_EXIT_FLUSH_TIMEOUT_S",
    "STALWART_PREEMPTION_SIGNALS",
)
ELASTIC_VARS = (
    "STALWART_ELASTIC_STORE",
    "STALWART_ELASTIC_WORKER",
    "STALWART_ELASTIC_EVENTS",
    "STALWART_ELASTIC_TIMEOUT_S",
    "STALWART_ELASTIC_HANG_S",
    "STALWART_ELASTIC_STORE_FILE",
)
TORCHRUN_VARS = ("RANK", "WORLD_SIZE")
_KNOWN = frozenset(CHECKPOINT_VARS + ELASTIC_VARS + TORCHRUN_VARS)


def read(name: str) -> str | None:
    """The variable's value, stripped; None when unset or empty."""
    if name not in _KNOWN:
        raise ConfigError(f"{name} is not one of stalwart's variables: list it in {__name__}")
    raw = os.environ.get(name, "").strip()
    return raw or None


def setting(name: str, default: T, parse: Callable[[str], T]) -> Callable[[], T]:
    """A default factory: ``parse(value)`` when ``name`` is set and not empty, else ``default``.

    The factory raises :class:`~stalwart.errors.ConfigError` naming the variable when the
    value does not parse.
    """
    read(name)  # an unknown name fails now, not when the factory first runs

    def value() -> T:
        raw = read(name)
        if raw is None:
            return default
        try:
            return parse(raw)
        except ValueError as e:
            raise ConfigError(
                f"environment variable {name}={raw!r} does not parse ({e}); fix or unset it"
            ) from None

    return value


def elastic_worker() -> Mapping[str, str]:
    """The ``STALWART_ELASTIC_*`` variables that are set (``stalwart run`` sets them)."""
    return {name: value for name in ELASTIC_VARS if (value := read(name)) is not None}


def torchrun_world() -> tuple[int, int] | None:
    """``(RANK, WORLD_SIZE)`` under torchrun; None when either is unset.

    Raises:
        ConfigError: one of them is not an integer.
    """
    rank, size = read("RANK"), read("WORLD_SIZE")
    if rank is None or size is None:
        return None
    try:
        return int(rank), int(size)
    except ValueError:
        raise ConfigError(f"RANK={rank!r} / WORLD_SIZE={size!r} must be integers") from None


HOST_KEYS = (
    "hostname",
    "cpu_model",
    "kernel",
    "os",
    "python",
    "torch",
    "cuda_runtime",
    "cuda_driver",
    "gpu_count",
)
"""The keys :func:`host_attributes` always returns (each device adds its own)."""


def host_attributes(device: int | None = None) -> dict[str, str]:
    """This host's attributes as flat text, for fault records and fleet root-cause analysis.

    Always the keys of ``HOST_KEYS``: ``hostname``, ``cpu_model``, ``kernel`` (``uname -r``),
    ``os`` (the distribution's name and version), ``python``, ``torch`` (its version),
    ``cuda_runtime`` (the CUDA version torch was built with), ``cuda_driver`` (the NVIDIA
    driver's version) and ``gpu_count``. Without ``device``, ``gpu<i>_name`` and
    ``gpu<i>_uuid`` for every CUDA device this process sees; with ``device`` (the index a
    member computes on), that device alone as ``device_index``, ``device_name`` and
    ``device_uuid``.

    Whatever cannot be known here (no torch, no CUDA, no such device, another OS) is an empty
    string, never an error. The host's part is read once per process and cached; every call
    returns a fresh dict. Naming the devices asks torch, which initializes CUDA in this
    process when it is available: call this in the process that uses the device, not in a
    parent before it forks workers.
    """
    out = dict(_host())
    devices = _devices()
    if device is None:
        for i, (name, uuid) in enumerate(devices):
            out[f"gpu{i}_name"], out[f"gpu{i}_uuid"] = name, uuid
        return out
    name, uuid = devices[device] if 0 <= device < len(devices) else ("", "")
    out.update(device_index=str(device), device_name=name, device_uuid=uuid)
    return out


@functools.cache
def _host() -> dict[str, str]:
    torch = _torch()
    version = getattr(torch, "version", None)  # a foreign module: absent in a stripped build
    return {
        "hostname": _quietly(socket.gethostname),
        "cpu_model": _quietly(_cpu_model),
        "kernel": _quietly(platform.release),
        "os": _quietly(_os_name),
        "python": platform.python_version(),
        "torch": str(getattr(torch, "__version__", "") or ""),
        "cuda_runtime": str(getattr(version, "cuda", "") or ""),
        "cuda_driver": _quietly(_nvidia_driver),
        "gpu_count": str(len(_devices())),
    }


@functools.cache
def _devices() -> tuple[tuple[str, str], ...]:
    """(name, UUID) of every CUDA device torch sees, in its index order."""
    torch = _torch()
    try:
        if torch is None or not torch.cuda.is_available():
            return ()
        out = []
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            uuid = str(getattr(props, "uuid", "") or "")  # torch >= 2.2 has it
            if uuid and not uuid.startswith(("GPU-", "MIG-")):
                uuid = f"GPU-{uuid}"  # as nvidia-smi and NVML print it
            out.append((str(props.name), uuid))
        return tuple(out)
    except Exception:  # a broken driver or device must not stop a fault from being recorded
        return ()


def _torch() -> Any:
    try:
        return importlib.import_module("torch")
    except Exception:  # not installed, or a broken install: the attributes say ""
        return None


def _quietly(read: Callable[[], str]) -> str:
    try:
        return str(read() or "").strip()
    except Exception:  # an attribute is best effort: unknown is "", never an error
        return ""


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model", "cpu model") and value.strip():
                return value.strip()
    return platform.processor() or platform.machine()


def _os_name() -> str:
    try:
        release = platform.freedesktop_os_release()
    except OSError:
        return platform.platform(terse=True)
    return (
        release.get("PRETTY_NAME") or f"{release.get('NAME', '')} {release.get('VERSION_ID', '')}"
    )


def _nvidia_driver() -> str:
    """The NVIDIA kernel module's version (``550.54.15``), read from /proc without NVML."""
    version = Path("/proc/driver/nvidia/version")
    if not version.exists():
        return ""
    first = version.read_text(errors="replace").splitlines()[0]  # NVRM version: ... Module  X  ...
    words = first.split()
    for i, word in enumerate(words):
        if word == "Module" and i + 1 < len(words):
            return words[i + 1]
    return ""
