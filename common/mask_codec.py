"""Compact wire encoding of a submodel mask.

A mask over ``d`` flat positions with ``k`` kept is sent either as packed bits
(``ceil(d / 8)`` bytes) or as sorted indices in the narrowest unsigned dtype that
holds ``d - 1`` (``k * itemsize`` bytes), whichever is smaller; a full mask is
sent as zero bytes.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

MaskKind = Literal["full", "bits", "indices"]
MASK_KINDS: tuple[str, ...] = ("full", "bits", "indices")


def index_dtype(d: int) -> np.dtype:
    """Narrowest unsigned dtype able to hold every index below ``d``."""
    for dt in (np.uint8, np.uint16, np.uint32):
        if d - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.uint64)


def encode_mask(mask: NDArray[np.bool_]) -> tuple[MaskKind, NDArray]:
    """Encode a boolean mask; returns ``(kind, array)``."""
    mask = np.asarray(mask, dtype=bool)
    d = mask.shape[0]
    k = int(mask.sum())
    if k == d:
        return "full", np.zeros(0, dtype=np.uint8)
    idx_bytes = k * index_dtype(d).itemsize
    bit_bytes = (d + 7) // 8
    if idx_bytes < bit_bytes:
        return "indices", np.flatnonzero(mask).astype(index_dtype(d))
    return "bits", np.packbits(mask)


def decode_mask(kind: str, data: NDArray, d: int) -> NDArray[np.bool_]:
    """Decode and validate a mask of length ``d``.

    Raises ``ValueError`` with the reason when the encoding is inconsistent
    (wrong kind, dtype or length, indices out of range, unsorted or repeated,
    non-zero padding bits).
    """
    data = np.asarray(data)
    if kind == "full":
        if data.size != 0:
            raise ValueError("a 'full' mask carries no data")
        return np.ones(d, dtype=bool)
    if kind == "bits":
        if data.dtype != np.uint8 or data.shape != ((d + 7) // 8,):
            raise ValueError(f"bit mask must be uint8[{(d + 7) // 8}], got {data.dtype}{list(data.shape)}")
        bits = np.unpackbits(data)
        if bits[d:].any():
            raise ValueError("bit mask has set padding bits")
        return bits[:d].astype(bool)
    if kind == "indices":
        want = index_dtype(d)
        if data.dtype != want or data.ndim != 1:
            raise ValueError(f"index mask for d={d} must be 1-D {want}, got {data.dtype}{list(data.shape)}")
        idx = data.astype(np.int64)
        if idx.size and (idx[-1] >= d or np.any(np.diff(idx) <= 0)):
            raise ValueError("index mask must be strictly increasing and below d")
        mask = np.zeros(d, dtype=bool)
        mask[idx] = True
        return mask
    raise ValueError(f"unknown mask kind {kind!r}; expected one of {MASK_KINDS}")


def mask_digest(kind: str, data: NDArray) -> str:
    """Short content hash of an encoded mask; a reply must echo the one it was sent."""
    import hashlib

    h = hashlib.sha256(kind.encode())
    h.update(np.ascontiguousarray(data).tobytes())
    return h.hexdigest()[:16]
