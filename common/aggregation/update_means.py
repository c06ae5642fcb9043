"""Published alternatives to the mask-aware holder mean
(:func:`common.aggregation.masked.aggregate_masked`).

They take the same validated :class:`~common.aggregation.masked.MaskedUpdate` list and differ only
in the weights and the denominator of each position's mean:

* :func:`nonzero_mean_step` (FIARSE): ``x_j += eta_g * sum_n delta_j^(n) / #{n : delta_j^(n) !=
  0}``, unweighted, counting only the clients whose update actually moved position ``j``;
* :func:`participant_mean_step` (CA-HFP, reconstruct-then-FedAvg): ``x_j += eta_g * sum_n p_n
  M_j^(n) delta_j^(n)`` with ``p_n = w_n / sum_m w_m`` over *all* the round's accepted clients
  (``sum_n p_n = 1``): a position few clients held moves by their share only, because each
  reconstructed model carries the global value (delta 0) where its client held nothing;
* :func:`update_count_mean_step` (FedRolex, ``--weighting avg``): the holder mean with every holder
  counting once, except at the positions the published server weights by how often they have been
  updated (the classifier and every 1-D tensor), where that count also grows with each client
  already added in the round.

Positions no update moved keep their value exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate, aggregate_masked, check_updates


def nonzero_mean_step(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], server_lr: float = 1.0
) -> NDArray[np.float32]:
    """``x + eta_g * sum delta / count(delta != 0)`` per position (a new array; ``x`` is not
    modified).

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``.
    updates : Sequence[MaskedUpdate]
        Validated client updates; their weights are checked but not used (the published rule is
        unweighted).
    server_lr : float
        Server step ``eta_g`` (FIARSE's ``lr_global``, 1.0 by default).
    """
    d = x.shape[0]
    num = np.zeros(d, dtype=np.float64)
    count = np.zeros(d, dtype=np.int64)
    check_updates(updates, d)
    for u in updates:
        idx = u.indices.astype(
            np.intp, copy=False
        )  # int32 indices cast once, not at each of four indexings
        num[idx] += u.delta.astype(np.float64)
        count[idx] += u.delta != 0
    moved = count > 0
    out = x.copy()
    out[moved] = (x[moved].astype(np.float64) + server_lr * num[moved] / count[moved]).astype(
        x.dtype
    )
    return out


def participant_mean_step(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], server_lr: float = 1.0
) -> NDArray[np.float32]:
    """``x + eta_g * sum_n p_n M^(n) delta^(n)``, ``p_n = w_n / sum_m w_m`` over all ``updates`` (a
    new array).

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``.
    updates : Sequence[MaskedUpdate]
        Validated client updates (the round's participants); ``weight`` is the example count.
    server_lr : float
        Server step ``eta_g`` (1.0 = FedAvg over the reconstructed models).
    """
    d = x.shape[0]
    num = np.zeros(d, dtype=np.float64)
    total = 0.0
    check_updates(updates, d)
    for u in updates:
        idx = u.indices.astype(np.intp, copy=False)
        num[idx] += u.weight * u.delta.astype(np.float64)
        total += u.weight
    if total == 0.0:
        return x.copy()
    return (x.astype(np.float64) + server_lr * num / total).astype(x.dtype)


def update_count_mean_step(
    x: NDArray[np.float32],
    updates: Sequence[MaskedUpdate],
    counted: NDArray[np.int64],
    counts: NDArray[np.int64],
    fixed: NDArray[np.bool_],
    server_lr: float = 1.0,
) -> tuple[NDArray[np.float32], NDArray[np.int64]]:
    """FedRolex's published ``combine`` with ``--weighting avg``; returns the new ``x`` and the new
    counts.

    Every position outside ``counted`` moves by the unweighted mean of its holders' deltas. At a
    ``counted`` position ``j``, the ``n``-th holder of the round (in ``updates`` order) weighs
    ``counts_j + h_j(n)``, where ``h_j(n)`` is the number of earlier holders of ``j`` in this round
    (0 where ``fixed``): the published server reads its running counts from the dict it increments
    once the first tensor is done. Every holder adds 1 to the count of the positions it held.

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``; not modified.
    updates : Sequence[MaskedUpdate]
        Validated client updates, in the order the server adds them; their weights are not used.
    counted : NDArray[int64]
        The count-weighted positions, strictly increasing.
    counts : NDArray[int64]
        One count per ``counted`` position before the round (1 + the times it has been updated); not
        modified.
    fixed : NDArray[bool]
        One flag per ``counted`` position: ``True`` where the count does not grow within the round
        (the first tensor of the published ``state_dict``).
    server_lr : float
        Server step ``eta_g`` (1.0 = the published replacement by the weighted mean).
    """
    check_updates(updates, x.shape[0])
    if not (counted.shape == counts.shape == fixed.shape):
        raise ValueError("counted, counts and fixed differ in length")
    out = aggregate_masked(x, [replace(u, weight=1.0) for u in updates], server_lr)
    running = counts.astype(np.int64)
    num = np.zeros(counted.size, dtype=np.float64)
    den = np.zeros(counted.size, dtype=np.float64)
    for u in updates:
        if u.indices.size == 0:
            continue
        pos = np.searchsorted(u.indices, counted)
        at = np.minimum(pos, u.indices.size - 1)
        held = (pos < u.indices.size) & (u.indices[at] == counted)
        weight = np.where(fixed, counts, running)[held].astype(np.float64)
        num[held] += weight * u.delta[at[held]].astype(np.float64)
        den[held] += weight
        running[held] += 1
    moved = den > 0
    where = counted[moved]
    out[where] = (x[where].astype(np.float64) + server_lr * num[moved] / den[moved]).astype(x.dtype)
    return out, running
