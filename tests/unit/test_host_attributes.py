"""``stalwart.environment.host_attributes``: flat text, every documented key, empty strings for
what this machine cannot say, cached, and one device's attributes on request."""

from __future__ import annotations

import platform
import socket

from stalwart.environment import HOST_KEYS, host_attributes


def test_every_key_is_text_and_known_ones_are_filled() -> None:
    attrs = host_attributes()
    assert set(HOST_KEYS) <= set(attrs)
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in attrs.items())
    assert attrs["hostname"] == socket.gethostname()
    assert attrs["python"] == platform.python_version()
    assert attrs["kernel"] == platform.release()
    assert attrs["torch"]  # torch is installed wherever stalwart's tests run
    n = int(attrs["gpu_count"])
    assert {k for k in attrs if k.startswith("gpu") and k != "gpu_count"} == {
        f"gpu{i}_{what}" for i in range(n) for what in ("name", "uuid")
    }
    if attrs["torch"].endswith("+cpu"):  # a CPU build knows no CUDA runtime and no device
        assert attrs["cuda_runtime"] == "" and n == 0


def test_a_device_is_named_alone_and_a_missing_one_is_empty() -> None:
    attrs = host_attributes()
    n = int(attrs["gpu_count"])
    mine = host_attributes(device=0)
    assert set(mine) == set(HOST_KEYS) | {"device_index", "device_name", "device_uuid"}
    assert mine["device_index"] == "0"
    if n:
        assert mine["device_name"] == attrs["gpu0_name"]
        assert mine["device_uuid"] == attrs["gpu0_uuid"]
    missing = host_attributes(device=n + 3)
    assert missing["device_index"] == str(n + 3)
    assert missing["device_name"] == missing["device_uuid"] == ""


def test_cached_but_every_call_gets_its_own_dict() -> None:
    first = host_attributes()
    first["hostname"] = "changed by the caller"
    assert host_attributes()["hostname"] == socket.gethostname()
