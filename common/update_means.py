"""Two published alternatives to the mask-aware holder mean (:func:`common.aggregation.aggregate_masked`).

Both take the same validated :class:`~common.aggregation.MaskedUpdate` list and differ only in the
denominator of each position's mean:

* :func:`nonzero_mean_step` (FIARSE): ``x_j += eta_g * sum_n delta_j^(n) / #{n : delta_j^(n) != 0}``,
  unweighted, counting only the clients whose update actually moved position ``j``;
* :func:`participant_mean_step` (CA-HFP, reconstruct-then-FedAvg):
  ``x_j += eta_g * sum_n p_n M_j^(n) delta_j^(n)`` with ``p_n = w_n / sum_m w_m`` over *all* the
  round's accepted clients (``sum_n p_n = 1``): a position few clients held moves by their share only,
  because each reconstructed model carries the global value (delta 0) where its client held nothing.

Positions no update moved keep their value exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from common.aggregation import MaskedUpdate, check_updates


def nonzero_mean_step(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], server_lr: float = 1.0
) -> NDArray[np.float32]:
    """``x + eta_g * sum delta / count(delta != 0)`` per position (a new array; ``x`` is not modified).

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``.
    updates : Sequence[MaskedUpdate]
        Validated client updates; their weights are checked but not used (the published rule is unweighted).
    server_lr : float
        Server step ``eta_g`` (FIARSE's ``lr_global``, 1.0 by default).
    """
    d = x.shape[0]
    num = np.zeros(d, dtype=np.float64)
    count = np.zeros(d, dtype=np.int64)
    check_updates(updates, d)
    for u in updates:
        num[u.indices] += u.delta.astype(np.float64)
        count[u.indices] += u.delta != 0
    moved = count > 0
    out = x.copy()
    out[moved] = (x[moved].astype(np.float64) + server_lr * num[moved] / count[moved]).astype(x.dtype)
    return out


def participant_mean_step(
    x: NDArray[np.float32], updates: Sequence[MaskedUpdate], server_lr: float = 1.0
) -> NDArray[np.float32]:
    """``x + eta_g * sum_n p_n M^(n) delta^(n)``, ``p_n = w_n / sum_m w_m`` over all ``updates`` (a new array).

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
        num[u.indices] += u.weight * u.delta.astype(np.float64)
        total += u.weight
    if total == 0.0:
        return x.copy()
    return (x.astype(np.float64) + server_lr * num / total).astype(x.dtype)
