"""Erasure codecs over equal-length byte pieces, and the rotating stripe layout of a group.

A codec turns ``k`` data pieces into ``m`` parity pieces and rebuilds any pieces from any
``k`` survivors. The contract is two methods on ``uint8`` numpy arrays, so that the group
exchange (``erasure.py``) never cares which code runs:

* :class:`XorCodec` — ``m = 1``, parity is the XOR of the data (RAID-5); numpy runs it at
  memory speed and releases the GIL.
* :class:`ReedSolomonCodec` — any ``m``, through pyeclib (BSD; its wheels ship ISA-L and
  liberasurecode). pyeclib prefixes each fragment with a small header and otherwise leaves
  data fragments equal to the data, so survivors keep raw pieces and the parity holders keep
  the ``k + m`` headers (the codec's ``meta``) to rebuild fragments at decode time.

Pieces are indexed ``0 .. k-1`` (data) and ``k .. k+m-1`` (parity).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from stalwart.errors import ConfigError, CorruptCheckpointError, require

__all__ = [
    "ErasureCodec",
    "ReedSolomonCodec",
    "StripeLayout",
    "XorCodec",
    "make_codec",
]

PIECE_ALIGN = 64
"""Piece lengths are multiples of this (SIMD-friendly; what pyeclib needs to add no padding)."""


class ErasureCodec(Protocol):
    """Encode ``k`` equal pieces into ``m`` parity pieces; rebuild from any ``k``.

    Two methods because that is all a group exchange needs: it moves pieces between ranks,
    and calls the codec once per stripe where the pieces meet.
    """

    name: str
    k: int
    m: int

    def meta_nbytes(self) -> int:
        """Length of the ``meta`` that :meth:`encode` returns (the same for every stripe)."""
        ...

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> bytes:
        """Write the ``m`` parity pieces of ``data`` (``k`` pieces) into ``parity``.

        Returns codec metadata that :meth:`decode` needs with any survivors (may be empty).
        """
        ...

    def decode(
        self, pieces: Mapping[int, np.ndarray], meta: bytes, want: Sequence[int]
    ) -> dict[int, np.ndarray]:
        """Rebuild the pieces ``want`` from at least ``k`` of the stripe's pieces.

        Raises:
            CorruptCheckpointError: fewer than ``k`` pieces, or mismatched lengths.
        """
        ...


def _check_pieces(k: int, m: int, pieces: Mapping[int, np.ndarray]) -> int:
    if len(pieces) < k:
        raise CorruptCheckpointError(
            f"cannot rebuild a {k}+{m} stripe from {len(pieces)} piece(s); it needs {k}"
        )
    lengths = {len(p) for p in pieces.values()}
    if len(lengths) != 1:
        raise CorruptCheckpointError(f"stripe pieces differ in length: {sorted(lengths)}")
    return lengths.pop()


def _words(a: np.ndarray) -> np.ndarray:
    """View as uint64 when possible (8x fewer numpy elements; same bytes)."""
    if a.nbytes % 8 == 0 and a.ctypes.data % 8 == 0:
        return a.view(np.uint64)
    return a


class XorCodec:
    """Single parity: the XOR of ``k`` data pieces (``m = 1``)."""

    name = "xor"
    m = 1

    def __init__(self, k: int) -> None:
        if k < 1:
            raise ConfigError(f"XorCodec needs k >= 1, got {k}")
        self.k = k

    def meta_nbytes(self) -> int:
        return 0

    @staticmethod
    def _xor_into(out: np.ndarray, srcs: Sequence[np.ndarray]) -> None:
        o = _words(out)
        if not srcs:
            o[...] = 0
            return
        if len(srcs) == 1:
            o[...] = _words(srcs[0])
            return
        np.bitwise_xor(_words(srcs[0]), _words(srcs[1]), out=o)
        for s in srcs[2:]:
            np.bitwise_xor(o, _words(s), out=o)

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> bytes:
        if len(data) != self.k or len(parity) != 1:
            raise ConfigError(f"XorCodec(k={self.k}) encodes {self.k} pieces into 1")
        self._xor_into(parity[0], list(data))
        return b""

    def decode(
        self, pieces: Mapping[int, np.ndarray], meta: bytes, want: Sequence[int]
    ) -> dict[int, np.ndarray]:
        size = _check_pieces(self.k, 1, pieces)
        out: dict[int, np.ndarray] = {}
        for i in want:
            if i in pieces:
                out[i] = pieces[i]
                continue
            others = [p for j, p in sorted(pieces.items()) if j != i][: self.k]
            dest = np.empty(size, dtype=np.uint8)
            self._xor_into(dest, others)
            out[i] = dest
        return out


class ReedSolomonCodec:
    """Reed-Solomon ``k + m`` through pyeclib (ISA-L Cauchy by default).

    Args:
        k: data pieces per stripe.
        m: parity pieces per stripe (losses tolerated).
        backend: a pyeclib ``ec_type`` available in its wheel: ``isa_l_rs_cauchy``
            (fastest here), ``isa_l_rs_vand`` or ``liberasurecode_rs_vand``.

    Raises:
        MissingDependencyError: pyeclib is not installed (``pip install 'stalwart[ec]'``).
        ConfigError: the backend is unknown or unusable.
    """

    name = "rs"

    def __init__(self, k: int, m: int, backend: str = "isa_l_rs_cauchy") -> None:
        if k < 1 or m < 1:
            raise ConfigError(f"ReedSolomonCodec needs k >= 1 and m >= 1, got k={k}, m={m}")
        ec_iface = require(
            "pyeclib.ec_iface", "ec", "Reed-Solomon erasure coding (m >= 2; m=1 uses XOR)"
        )
        try:
            self._driver: Any = ec_iface.ECDriver(k=k, m=m, ec_type=backend)
        except Exception as e:  # pyeclib raises its own ECDriverError family
            raise ConfigError(
                f"pyeclib cannot build {backend!r} with k={k}, m={m} ({e}); use "
                "isa_l_rs_cauchy, isa_l_rs_vand or liberasurecode_rs_vand"
            ) from e
        self.k, self.m, self.backend = k, m, backend
        probe = [np.full(PIECE_ALIGN, i + 1, dtype=np.uint8) for i in range(k)]
        frags = self._driver.encode(b"".join(p.data for p in probe))
        self.header_nbytes = len(frags[0]) - PIECE_ALIGN
        self._check_layout(frags, probe)
        self._headers: dict[int, list[bytes]] = {}  # piece size -> the k + m headers

    def _check_layout(self, frags: Sequence[bytes], data: Sequence[np.ndarray]) -> None:
        """Data fragments must be header + the piece, unpadded (survivors keep raw pieces)."""
        h = self.header_nbytes
        size = len(data[0])
        ok = len(frags) == self.k + self.m and h >= 0
        ok = ok and all(len(f) == h + size for f in frags)
        ok = ok and all(
            np.array_equal(np.frombuffer(frags[i], dtype=np.uint8, offset=h), data[i])
            for i in range(self.k)
        )
        if not ok:
            raise ConfigError(
                f"pyeclib backend {self.backend!r} does not keep data fragments equal to the "
                "data pieces; choose isa_l_rs_cauchy, isa_l_rs_vand or liberasurecode_rs_vand"
            )

    def meta_nbytes(self) -> int:
        return (self.k + self.m) * self.header_nbytes

    def encode(self, data: Sequence[np.ndarray], parity: Sequence[np.ndarray]) -> bytes:
        if len(data) != self.k or len(parity) != self.m:
            raise ConfigError(f"RS {self.k}+{self.m} encodes {self.k} pieces into {self.m}")
        k, h, size = self.k, self.header_nbytes, len(data[0])
        headers = self._headers.get(size)
        if headers is None:
            frags = self._driver.encode(b"".join(p.data for p in data))
            self._check_layout(frags, data)
            headers = [bytes(f[:h]) for f in frags]
            self._headers = {size: headers}  # one size in steady state; keep only the last
            payloads = {k + i: frags[k + i] for i in range(self.m)}
        else:
            # Same piece size as before: "reconstruct" the parity fragments from the data
            # fragments. The result is the same bytes (headers do not depend on the data) and
            # pyeclib's reconstruct path runs 2-4x faster than its encode here, which
            # allocates and fills all k + m output fragments.
            frags = [b"".join((headers[i], data[i].data)) for i in range(k)]
            payloads = self._reconstruct(frags, list(range(k, k + self.m)), size)
        for i, p in enumerate(parity):
            p[...] = np.frombuffer(payloads[k + i], dtype=np.uint8, offset=h)
        return b"".join(headers)

    def _reconstruct(self, frags: list[bytes], missing: list[int], size: int) -> dict[int, bytes]:
        """``index -> fragment`` (header + payload) for each of ``missing``."""
        try:
            rebuilt = self._driver.reconstruct(frags, sorted(missing))
            by_index = {
                int(self._driver.get_metadata(f, formatted=True)["index"]): f for f in rebuilt
            }
        except Exception as e:  # pyeclib raises its own ECDriverError family
            raise CorruptCheckpointError(f"Reed-Solomon reconstruct failed: {e}") from e
        for i in missing:
            f = by_index.get(i)
            if f is None or len(f) != self.header_nbytes + size:
                raise CorruptCheckpointError(
                    f"Reed-Solomon reconstruct did not return piece {i} of {size} bytes"
                )
        return by_index

    def decode(
        self, pieces: Mapping[int, np.ndarray], meta: bytes, want: Sequence[int]
    ) -> dict[int, np.ndarray]:
        size = _check_pieces(self.k, self.m, pieces)
        k, h = self.k, self.header_nbytes
        if len(meta) != self.meta_nbytes():
            raise CorruptCheckpointError(
                f"RS stripe metadata is {len(meta)} bytes, expected {self.meta_nbytes()}"
            )
        out = {i: pieces[i] for i in want if i in pieces}
        missing = [i for i in want if i not in pieces]
        if not missing:
            return out
        chosen = sorted(pieces)[:k]  # data pieces sort first: the cheapest decode
        # pyeclib wants bytes (a bytearray aborts the process); one copy per fragment.
        frags = [b"".join((meta[i * h : (i + 1) * h], pieces[i].data)) for i in chosen]
        got = self._reconstruct(frags, missing, size)
        for i in missing:
            out[i] = np.frombuffer(got[i], dtype=np.uint8, offset=h).copy()
        return out


def make_codec(spec: str | ErasureCodec, k: int, m: int) -> ErasureCodec:
    """Resolve ``"auto"`` (XOR for ``m = 1``, else RS), ``"xor"``, ``"rs"``, ``"rs:<backend>"``.

    Raises:
        ConfigError: unknown name, XOR with ``m != 1``, or a codec whose k/m differ.
    """
    if not isinstance(spec, str):
        if (spec.k, spec.m) != (k, m):
            raise ConfigError(f"codec is {spec.k}+{spec.m} but the group is {k}+{m}")
        return spec
    if spec == "auto":
        spec = "xor" if m == 1 else "rs"
    if spec == "xor":
        if m != 1:
            raise ConfigError(f"the XOR codec tolerates one loss (m=1), not m={m}; use 'rs'")
        return XorCodec(k)
    if spec == "rs" or spec.startswith("rs:"):
        backend = spec.partition(":")[2] or "isa_l_rs_cauchy"
        return ReedSolomonCodec(k, m, backend)
    raise ConfigError(f"unknown codec {spec!r}; use 'auto', 'xor', 'rs' or 'rs:<pyeclib ec_type>'")


@dataclass(frozen=True)
class StripeLayout:
    """Which member holds what in a group of ``n = k + m`` members and ``n`` stripes.

    In stripe ``j`` the parity holders are members ``j, j+1, …, j+m-1`` (mod ``n``) and the
    data members are the next ``k`` (``j+m, …, j+m+k-1``, mod ``n``), in that order, which
    is also their piece index in the stripe. Every member is a data member in exactly ``k``
    stripes, so its blob is cut into ``k`` pieces, the ``p``-th going to the ``p``-th such
    stripe (ascending ``j``); and it holds parity in ``m`` stripes. Every stripe involves all
    ``n`` members once, so losing any ``m`` members costs each stripe at most ``m`` pieces.
    """

    k: int
    m: int

    def __post_init__(self) -> None:
        if self.k < 1 or self.m < 1:
            raise ConfigError(f"erasure groups need k >= 1 and m >= 1, got k={self.k}, m={self.m}")

    @property
    def n(self) -> int:
        return self.k + self.m

    def parity_holders(self, j: int) -> tuple[int, ...]:
        return tuple((j + i) % self.n for i in range(self.m))

    def data_members(self, j: int) -> tuple[int, ...]:
        return tuple((j + self.m + i) % self.n for i in range(self.k))

    def members(self, j: int) -> tuple[int, ...]:
        """Holder of each piece of stripe ``j``, by piece index (data first, then parity)."""
        return self.data_members(j) + self.parity_holders(j)

    def data_stripes(self, member: int) -> tuple[int, ...]:
        """Stripes where ``member`` is a data member; the p-th receives its p-th piece."""
        return tuple(j for j in range(self.n) if member in self.data_members(j))

    def parity_stripes(self, member: int) -> tuple[int, ...]:
        return tuple(j for j in range(self.n) if member in self.parity_holders(j))

    def piece_index(self, member: int, j: int) -> int:
        """``member``'s piece index in stripe ``j`` (``0..k-1`` data, ``k..n-1`` parity)."""
        return self.members(j).index(member)

    def encoder(self, j: int) -> int:
        """The member that gathers stripe ``j``'s data and computes its parity."""
        return j % self.n
