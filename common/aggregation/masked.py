"""Mask-aware aggregation of client updates.

For every flat position ``j``::

    x_j <- x_j + eta_g * sum_n w_n M_j^(n) delta_j^(n) / sum_n w_n M_j^(n)

where ``w_n`` is client ``n``'s example count and ``M^(n)`` its mask. Positions no
client held keep their value exactly. Buffers (e.g. BatchNorm running statistics)
use the same rule on ``delta = b_n - b`` with ``eta_g = 1``, i.e. an example-weighted
mean over the clients that held them (see :func:`average_held`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray


@dataclass(frozen=True)
class MaskedUpdate:
    """One client's contribution.

    Parameters
    ----------
    indices : NDArray[int32 or int64]
        Flat positions the client held, strictly increasing (a validated reply's are ``int32`` while
        ``d <= 2^31``: :func:`common.wire.mask_codec.position_dtype`).
    delta : NDArray[float32]
        The client's change at those positions (trained minus received), same length; read, never
        written (a validated reply's is a read-only view of the received array).
    weight : float
        Aggregation weight, normally the number of local training examples (> 0).
    """

    indices: NDArray[np.signedinteger]
    delta: NDArray[np.float32]
    weight: float


#: Positions per block of the accumulation: two float64 blocks of this size (16 MiB) bound the
#: temporaries.
AGGREGATION_BLOCK = 1 << 20


def check_updates(updates: Sequence[MaskedUpdate], d: int) -> None:
    """Raise ``ValueError`` unless every update pairs each index in ``[0, d)`` with a delta and has
    weight > 0.

    Parameters
    ----------
    updates : Sequence[MaskedUpdate]
        Client updates about to be aggregated.
    d : int
        Length of the global vector.
    """
    for u in updates:
        if u.indices.shape != u.delta.shape:
            raise ValueError("indices and delta differ in length")
        if u.indices.size and (u.indices.min() < 0 or u.indices.max() >= d):
            raise ValueError(f"update indices outside [0, {d})")
        if not u.weight > 0:
            raise ValueError(f"weight must be positive, got {u.weight}")


def aggregate_masked(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], server_lr: float = 1.0
) -> NDArray[np.float32]:
    """Apply the mask-aware weighted mean of ``updates`` to ``x`` (returns a new array).

    The sums are float64, accumulated one block of :data:`AGGREGATION_BLOCK`
    positions at a time (client order within a block, as a dense accumulation
    would), so the result is the same to the bit while no float64 array of
    length ``d`` is ever allocated. A client that held every position adds its
    delta as a slice, without index arithmetic.

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``; not modified.
    updates : Sequence[MaskedUpdate]
        Validated client updates (indices strictly increasing).
    server_lr : float
        Server step ``eta_g`` (1.0 = plain masked averaging).
    """
    d = x.shape[0]
    check_updates(updates, d)
    full = [
        u.indices.size == d for u in updates
    ]  # strictly increasing indices below d: exactly 0..d-1
    out = x.copy()
    scaled = np.empty(min(d, AGGREGATION_BLOCK), dtype=np.float64)
    for start in range(0, d, AGGREGATION_BLOCK):
        stop = min(start + AGGREGATION_BLOCK, d)
        num = np.zeros(stop - start, dtype=np.float64)
        den = np.zeros(stop - start, dtype=np.float64)
        for u, dense in zip(updates, full):
            if dense:
                num += np.multiply(
                    u.delta[start:stop], u.weight, out=scaled[: stop - start], dtype=np.float64
                )
                den += u.weight
                continue
            lo, hi = np.searchsorted(u.indices, (start, stop))
            if lo == hi:
                continue
            idx = np.subtract(
                u.indices[lo:hi], start, dtype=np.intp
            )  # one cast, then indexed twice per array
            num[idx] += np.multiply(u.delta[lo:hi], u.weight, dtype=np.float64)
            den[idx] += u.weight
        # x + eta * num / den where somebody held the position, in place on the block's float64
        # sums.
        held = den > 0
        block = out[start:stop]
        num *= server_lr
        np.divide(num, den, out=num, where=held)
        num += block
        np.copyto(block, num, where=held, casting="same_kind")
    return out


def average_held(
    current: NDArray[np.float32],
    values: Sequence[NDArray[np.float32]],
    masks: Sequence[NDArray[np.bool_]],
    weights: Sequence[float],
) -> NDArray[np.float32]:
    """Example-weighted mean of client values over the clients that held each position.

    Used for buffers: positions held by nobody keep ``current``.
    """
    updates = [
        MaskedUpdate(np.flatnonzero(m), (v[m] - current[m]).astype(np.float32), w)
        for v, m, w in zip(values, masks, weights)
    ]
    return aggregate_masked(current, updates, server_lr=1.0)
