"""Compact wire encoding of a submodel mask.

A mask over ``d`` flat positions with ``k`` kept is sent as whichever of these is
smallest (a full mask is sent as zero bytes):

* ``bits``: packed bits, ``ceil(d / 8)`` bytes;
* ``indices``: sorted indices in the narrowest unsigned dtype that holds
  ``d - 1``, ``k * itemsize`` bytes;
* ``elias-fano``: the Elias-Fano code of the sorted indices. Each index is split
  into its ``L = floor(log2(d / k))`` low bits, stored verbatim, and its high part,
  stored in unary as one set bit at position ``high_j + j``. That is
  ``k (L + 2)`` bits or less, within about half a bit per kept position of the
  mask's entropy ``log2 C(d, k)``: near the information limit at every density
  where neither of the others is.

Layout of ``elias-fano`` (uint8): ``k`` as little-endian uint64, then the ``k * L``
low bits packed (most significant first), then the ``k + ((d - 1) >> L) + 1`` high
bits packed; padding bits are zero. Encoding and decoding are vectorised numpy,
and decoding validates every field, like the other kinds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import Literal

import numpy as np
from numpy.typing import NDArray

MaskKind = Literal["full", "bits", "indices", "elias-fano"]
MASK_KINDS: tuple[str, ...] = ("full", "bits", "indices", "elias-fano")
_EF_HEADER = 8  # bytes: k as little-endian uint64


def index_dtype(d: int) -> np.dtype:
    """Narrowest unsigned dtype able to hold every index below ``d``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if d - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def position_dtype(d: int) -> np.dtype:
    """Signed dtype of the positions of a model of ``d`` parameters: ``int32`` while every index
    fits, else ``int64``.

    Four bytes per kept position instead of eight for every model below 2^31 parameters; numpy
    indexes with either (the consumers cast a block at a time where they index repeatedly).
    """
    return np.dtype(np.int32) if d - 1 <= np.iinfo(np.int32).max else np.dtype(np.int64)


#: Bytes of packed bits unpacked at a time by :func:`packed_positions` (2^20 positions).
_POSITIONS_BLOCK = 1 << 17


def packed_positions(packed: NDArray[np.uint8], d: int, kept: int) -> NDArray[np.signedinteger]:
    """The set positions of a packed mask of ``d`` bits, increasing, as :func:`position_dtype`
    (``int32`` mostly).

    The same positions as ``np.flatnonzero(np.unpackbits(packed, count=d))``, without the unpacked
    mask (``d`` bytes) or an int64 array of them (8 bytes per position): blocks of 2^20 bits are
    unpacked one at a time (8 MiB of int64 positions at most) and their positions written into the
    result. A full mask (``kept == d``) is ``arange(d)``.

    Parameters
    ----------
    packed : NDArray[uint8]
        ``ceil(d / 8)`` bytes, most significant bit first (``np.packbits``); padding bits are
        ignored.
    d : int
        Bits of the mask.
    kept : int
        Set bits among the first ``d``; ``ValueError`` when the mask holds another number.
    """
    dt = position_dtype(d)
    if packed.dtype != np.uint8 or packed.shape != ((d + 7) // 8,):
        raise ValueError(
            f"packed mask must be uint8[{(d + 7) // 8}], got {packed.dtype}{list(packed.shape)}"
        )
    if kept == d:
        # Every bit set: its whole bytes are 0xFF and the last one's leading d % 8 bits are set,
        # read off the packed bytes (d / 8 of them) instead of the d unpacked bits; counted only to
        # say what is wrong.
        whole, rest = divmod(d, 8)
        full = bool(np.all(packed[:whole] == 0xFF))
        if full and rest:
            full = int(packed[whole]) >> (8 - rest) == (1 << rest) - 1
        if not full:
            n = int(np.count_nonzero(np.unpackbits(packed, count=d).view(np.bool_)))
            raise ValueError(f"packed mask holds {n} set positions, expected {kept}")
        return np.arange(d, dtype=dt)
    out = np.empty(kept, dtype=dt)
    n = 0
    for start in range(0, packed.size, _POSITIONS_BLOCK):
        bits = np.unpackbits(
            packed[start : start + _POSITIONS_BLOCK], count=min(8 * _POSITIONS_BLOCK, d - 8 * start)
        )
        pos = np.flatnonzero(
            bits.view(np.bool_)
        )  # numpy's fast path is for booleans (several times uint8's)
        if n + pos.size > kept:
            raise ValueError(f"packed mask holds more than {kept} set positions")
        pos += 8 * start
        out[n : n + pos.size] = pos  # below d: fits the dtype
        n += pos.size
    if n != kept:
        raise ValueError(f"packed mask holds {n} set positions, expected {kept}")
    return out


def elias_fano_low_bits(d: int, k: int) -> int:
    """Low bits per index of the Elias-Fano code of ``k`` indices below ``d``: ``floor(log2(d /
    k))``."""
    if k <= 0 or d <= k:
        return 0
    return (
        d // k
    ).bit_length() - 1  # floor(log2(d / k)) in integers: floor(d / k) has the same bit length


def elias_fano_bytes(d: int, k: int) -> int:
    """Size of the ``elias-fano`` encoding of ``k`` indices below ``d`` (bytes, header included)."""
    low = elias_fano_low_bits(d, k)
    high = k + ((d - 1) >> low) + 1 if d > 0 else 0
    return _EF_HEADER + (k * low + 7) // 8 + (high + 7) // 8


def _uint_dtype(width: int) -> np.dtype:
    """Big-endian unsigned dtype of at least ``width`` bits."""
    for nbytes in (1, 2, 4, 8):
        if width <= 8 * nbytes:
            return np.dtype(f">u{nbytes}")
    raise ValueError(f"no integer dtype holds {width} bits")


def _pack_fixed(values: NDArray[np.int64], width: int) -> NDArray[np.uint8]:
    """The ``width`` low bits of each value, most significant first, packed (``ceil(len * width /
    8)`` bytes).

    Up to 8 bits a value, eight values at a time are joined into one 64-bit word (value ``j`` of a
    group shifted left by ``width * (7 - j)``) whose ``width`` low bytes, big-endian, are the
    group's bits: the same bytes as unpacking every value to bits and packing them again (zero
    padding at the end), without the ``8 * len`` bytes of unpacked bits.
    """
    if 0 < width <= 8:
        count = values.size
        groups = np.zeros((count + 7) // 8 * 8, dtype=np.uint64)
        groups[:count] = values & ((1 << width) - 1)
        shifts = (width * np.arange(7, -1, -1)).astype(np.uint64)
        words = np.bitwise_or.reduce(groups.reshape(-1, 8) << shifts, axis=1)
        packed = words.astype(">u8").view(np.uint8).reshape(-1, 8)[:, 8 - width :].reshape(-1)
        return np.ascontiguousarray(packed[: (count * width + 7) // 8])
    dt = _uint_dtype(width)
    as_bytes = values.astype(dt).view(np.uint8).reshape(values.size, dt.itemsize)
    return np.packbits(np.unpackbits(as_bytes, axis=1)[:, 8 * dt.itemsize - width :])


def _unpack_fixed(bits: NDArray[np.uint8], count: int, width: int) -> NDArray[np.int64]:
    """Inverse of :func:`_pack_fixed` on already unpacked bits (``count * width`` of them)."""
    dt = _uint_dtype(width)
    padded = np.zeros((count, 8 * dt.itemsize), dtype=np.uint8)
    padded[:, 8 * dt.itemsize - width :] = bits[: count * width].reshape(count, width)
    return np.packbits(padded, axis=1).view(dt).reshape(count).astype(np.int64)


def encode_elias_fano(indices: NDArray, d: int) -> NDArray[np.uint8]:
    """Elias-Fano code of strictly increasing ``indices`` below ``d`` (layout in the module
    docstring)."""
    idx = np.asarray(indices, dtype=np.int64)
    k = idx.size
    low = elias_fano_low_bits(d, k)
    high_bits = np.zeros(k + ((d - 1) >> low) + 1, dtype=np.uint8)
    high_bits[(idx >> low) + np.arange(k, dtype=np.int64)] = 1
    parts = [
        np.frombuffer(np.array(k, dtype="<u8").tobytes(), dtype=np.uint8),
        _pack_fixed(idx & ((1 << low) - 1), low) if low else np.zeros(0, dtype=np.uint8),
        np.packbits(high_bits),
    ]
    return np.concatenate(parts)


def decode_elias_fano(data: NDArray, d: int) -> NDArray[np.int64]:
    """Strictly increasing indices below ``d`` from :func:`encode_elias_fano`; ``ValueError`` when
    inconsistent."""
    if data.dtype != np.uint8 or data.ndim != 1 or data.size < _EF_HEADER:
        raise ValueError(f"elias-fano mask must be 1-D uint8 of at least {_EF_HEADER} bytes")
    k = int(np.frombuffer(data[:_EF_HEADER].tobytes(), dtype="<u8")[0])
    if not 0 < k < d:
        raise ValueError(f"elias-fano mask declares k={k} kept, outside (0, {d})")
    if data.size != elias_fano_bytes(d, k):
        want = elias_fano_bytes(d, k)
        raise ValueError(
            f"elias-fano mask of k={k} among d={d} must be {want} bytes, got {data.size}"
        )
    low = elias_fano_low_bits(d, k)
    n_low, n_high = k * low, k + ((d - 1) >> low) + 1
    low_end = _EF_HEADER + (n_low + 7) // 8
    low_bits = np.unpackbits(data[_EF_HEADER:low_end])
    high_bits = np.unpackbits(data[low_end:])
    if low_bits[n_low:].any() or high_bits[n_high:].any():
        raise ValueError("elias-fano mask has set padding bits")
    ones = np.flatnonzero(high_bits)
    if ones.size != k:
        raise ValueError(f"elias-fano mask has {ones.size} high parts, expected k={k}")
    idx = (ones - np.arange(k, dtype=np.int64)) << low
    if low:
        idx |= _unpack_fixed(low_bits, k, low)
    if idx[-1] >= d or np.any(idx[1:] <= idx[:-1]):
        raise ValueError("elias-fano mask indices must be strictly increasing and below d")
    return idx


def mask_kind(d: int, k: int) -> tuple[MaskKind, int]:
    """The kind :func:`encode_mask` picks for ``k`` set positions of ``d``, and its size in bytes.

    The size depends on the counts alone, not on where the positions are. Among equal sizes
    ``indices`` is preferred to ``bits``, and both to ``elias-fano``.
    """
    if k == d:
        return "full", 0
    sizes = {
        "indices": k * index_dtype(d).itemsize,
        "bits": (d + 7) // 8,
        "elias-fano": elias_fano_bytes(d, k) if k > 0 else None,
    }
    kind = min((n for n, b in sizes.items() if b is not None), key=lambda n: sizes[n])
    return kind, int(sizes[kind])  # type: ignore[return-value]


#: Bytes of ``indices`` and ``elias-fano`` encodings :func:`encode_mask` keeps for masks it meets
#: again.
ENCODING_CACHE_BYTES = 32 << 20


class EncodingCache:
    """Encodings of recent masks by content (their packed bits' BLAKE2b digest), least recently used
    dropped first.

    Between Fisher refreshes the server sends a client the same mask round after round (held masks),
    and every client ranked by the prior at a capacity level the same one: their ``indices`` or
    ``elias-fano`` code is then looked up (one ``packbits`` and one hash of ``d / 8`` bytes) instead
    of recomputed. Keyed by content, so a changed mask is simply another key. The arrays handed out
    are read-only: callers share them.

    Parameters
    ----------
    limit : int
        Bytes of encodings kept at most.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.nbytes = 0
        self.hits = 0
        self._entries: OrderedDict[tuple[int, str, bytes], NDArray] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, str, bytes]) -> NDArray | None:
        """The encoding stored under ``key``, now the most recently used; ``None`` if none is."""
        data = self._entries.get(key)
        if data is not None:
            self._entries.move_to_end(key)
            self.hits += 1
        return data

    def put(self, key: tuple[int, str, bytes], data: NDArray) -> None:
        """Keep ``data`` (made read-only) under ``key``, dropping the least recently used beyond
        :attr:`limit`."""
        if data.nbytes > self.limit or key in self._entries:
            return
        data.flags.writeable = False
        self._entries[key] = data
        self.nbytes += data.nbytes
        while self.nbytes > self.limit:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes

    def clear(self) -> None:
        """Drop every encoding."""
        self._entries.clear()
        self.nbytes = self.hits = 0


#: The cache :func:`encode_mask` uses.
ENCODINGS = EncodingCache(ENCODING_CACHE_BYTES)


def encode_mask(
    mask: NDArray[np.bool_], positions: NDArray[np.signedinteger] | None = None
) -> tuple[MaskKind, NDArray]:
    """Encode a boolean mask as its smallest kind (:func:`mask_kind`); returns ``(kind, array)``.

    ``indices`` and ``elias-fano`` codes are kept by content (:class:`EncodingCache`,
    :data:`ENCODINGS`): a mask met again (a held mask, a capacity level's prior-ranked mask) is
    looked up, and its array is then read-only and shared. ``bits`` costs one ``packbits``, the
    key's price, and is not kept.

    Parameters
    ----------
    mask : NDArray[bool]
        The mask, flat.
    positions : NDArray[int], optional
        ``np.flatnonzero(mask)`` when the caller has it (then not computed again).
    """
    mask = np.asarray(mask, dtype=bool)
    d = mask.shape[0]
    kind, _ = mask_kind(d, int(np.count_nonzero(mask)))
    if kind == "full":
        return "full", np.zeros(0, dtype=np.uint8)
    if kind == "bits":
        return "bits", np.packbits(mask)
    key = (d, kind, hashlib.blake2b(np.packbits(mask).data, digest_size=16).digest())
    data = ENCODINGS.get(key)
    if data is None:
        at = np.flatnonzero(mask) if positions is None else positions
        if kind == "indices":
            data = at.astype(index_dtype(d))
        else:
            data = encode_elias_fano(at, d)
        ENCODINGS.put(key, data)
    return kind, data


def decode_mask(kind: str, data: NDArray, d: int) -> NDArray[np.bool_]:
    """Decode and validate a mask of length ``d``.

    Raises ``ValueError`` with the reason when the encoding is inconsistent
    (wrong kind, dtype or length, indices out of range, unsorted or repeated,
    non-zero padding bits, a declared count that does not match).
    """
    data = np.asarray(data)
    if kind == "full":
        if data.size != 0:
            raise ValueError("a 'full' mask carries no data")
        return np.ones(d, dtype=bool)
    if kind == "bits":
        if data.dtype != np.uint8 or data.shape != ((d + 7) // 8,):
            raise ValueError(
                f"bit mask must be uint8[{(d + 7) // 8}], got {data.dtype}{list(data.shape)}"
            )
        bits = np.unpackbits(data)
        if bits[d:].any():
            raise ValueError("bit mask has set padding bits")
        return bits[:d].astype(bool)
    if kind == "indices":
        want = index_dtype(d)
        if data.dtype != want or data.ndim != 1:
            raise ValueError(
                f"index mask for d={d} must be 1-D {want}, got {data.dtype}{list(data.shape)}"
            )
        idx = data.astype(np.int64)
        if idx.size and (idx[-1] >= d or np.any(np.diff(idx) <= 0)):
            raise ValueError("index mask must be strictly increasing and below d")
        mask = np.zeros(d, dtype=bool)
        mask[idx] = True
        return mask
    if kind == "elias-fano":
        mask = np.zeros(d, dtype=bool)
        mask[decode_elias_fano(data, d)] = True
        return mask
    raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")


def mask_digest(kind: str, data: NDArray) -> str:
    """Short content hash of an encoded mask; a reply must echo the one it was sent."""
    h = hashlib.sha256(kind.encode())
    h.update(np.ascontiguousarray(data).tobytes())
    return h.hexdigest()[:16]
