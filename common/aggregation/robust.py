"""Robust mask-aware aggregation: what one malicious node's update can do to a position is bounded.

The default holder mean (:func:`common.aggregation.masked.aggregate_masked`) lets one node move any
position it holds without bound: scaling its delta by 1000 scales its pull by 1000. The rules here
bound that pull, each over the nodes that hold the position, so that a small node's positions are
judged by the nodes that share them:

* ``trimmed`` (:func:`trimmed_holder_mean_step`): per position, the holders' deltas sorted,
  ``floor(trim h)`` cut at each end (``h`` holders), the rest averaged unweighted; ``trim = 0.5``
  gives the median. With fewer than three holders nothing is cut (there is no majority to trust).
* ``norm-clip`` (:func:`clip_to_median_norm`): every update scaled down to ``factor`` times the
  median norm of the round's updates, then the holder mean; a scaled update is then worth no more
  than an honest one.

Positions no update moved keep their value exactly, as in the holder mean.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate, aggregate_masked, check_updates

#: The rules ``robust-aggregation`` accepts beside ``mean`` (the method's own mean, which is not
#: computed here).
ROBUST_RULES: tuple[str, ...] = ("trimmed", "norm-clip")

#: Positions per block: a block holds one float32 value per update and position.
ROBUST_BLOCK = 1 << 16


def trimmed_holder_mean_step(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], trim: float, server_lr: float = 1.0
) -> NDArray[np.float32]:
    """``x + eta_g * trimmed mean of the holders' deltas`` per position (a new array; ``x`` is not
    modified).

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``.
    updates : Sequence[MaskedUpdate]
        Validated client updates (indices strictly increasing); weights are not used.
    trim : float
        Share cut at each end of a position's sorted holder deltas, in ``[0, 0.5]`` (``0.5``: the
        median).
    server_lr : float
        Server step ``eta_g``.
    """
    if not 0 <= trim <= 0.5:
        raise ValueError(f"trim={trim!r} is outside [0, 0.5]")
    d = x.shape[0]
    check_updates(updates, d)
    out = x.copy()
    for start in range(0, d, ROBUST_BLOCK):
        stop = min(start + ROBUST_BLOCK, d)
        block = np.full((len(updates), stop - start), np.nan, dtype=np.float32)
        for row, u in zip(block, updates, strict=True):
            lo, hi = np.searchsorted(u.indices, (start, stop))
            row[u.indices[lo:hi] - start] = u.delta[lo:hi]
        holders = np.sum(~np.isnan(block), axis=0)
        held = holders > 0
        if not held.any():
            continue
        out[start:stop][held] += np.float32(server_lr) * _trimmed_means(
            block[:, held], holders[held], trim
        )
    return out


def _trimmed_means(
    block: NDArray[np.float32], holders: NDArray[np.intp], trim: float
) -> NDArray[np.float32]:
    """Per column of ``block`` (NaN: not held), the mean of the held values with ``floor(trim h)``
    cut each end, at least one when ``trim > 0`` and ``h >= 3``."""
    ordered = np.sort(
        block, axis=0
    )  # NaN sorts last: a column's first ``h`` rows are its holders' values
    # At least one value cut at each end once three hold a position: a share of a few holders rounds
    # to none, and one attacker among the three capacity-1 nodes would then go through untrimmed.
    share = np.floor(trim * holders).astype(np.intp)
    cut = np.where(holders >= 3, np.maximum(share, 1 if trim > 0 else 0), 0)
    cut = np.minimum(
        cut, (holders - 1) // 2
    )  # keep at least one value (two, the middle ones, for an even h)
    sums = np.concatenate(
        [
            np.zeros((1, ordered.shape[1])),
            np.cumsum(np.nan_to_num(ordered, nan=0.0), axis=0, dtype=np.float64),
        ]
    )
    cols = np.arange(ordered.shape[1])
    kept = holders - 2 * cut
    total = sums[holders - cut, cols] - sums[cut, cols]
    return (total / kept).astype(np.float32)


def clip_to_median_norm(updates: Sequence[MaskedUpdate], factor: float) -> list[MaskedUpdate]:
    """Each update's delta scaled down to ``factor`` times the median L2 norm of the round's deltas.

    Parameters
    ----------
    updates : Sequence[MaskedUpdate]
        The round's updates.
    factor : float
        Multiple of the median norm an update may reach (> 0).
    """
    if not factor > 0:
        raise ValueError(f"factor={factor!r} must be > 0")
    if not updates:
        return []
    norms = np.array([np.sqrt(np.sum(np.square(u.delta, dtype=np.float64))) for u in updates])
    bound = factor * float(np.median(norms))
    out = []
    for u, norm in zip(updates, norms, strict=True):
        scale = min(1.0, bound / norm) if norm > 0 else 1.0
        out.append(
            u
            if scale == 1.0
            else replace(u, delta=(u.delta * np.float32(scale)).astype(np.float32))
        )
    return out


def robust_mean_step(
    x: NDArray[np.float32],
    updates: Sequence[MaskedUpdate],
    rule: str,
    trim: float,
    clip_factor: float,
    server_lr: float = 1.0,
) -> NDArray[np.float32]:
    """The round's step under ``rule`` (one of :data:`ROBUST_RULES`)."""
    if rule == "trimmed":
        return trimmed_holder_mean_step(x, updates, trim, server_lr)
    if rule == "norm-clip":
        return aggregate_masked(x, clip_to_median_norm(updates, clip_factor), server_lr)
    raise ValueError(f"unknown robust aggregation {rule!r}; expected one of {ROBUST_RULES}")
