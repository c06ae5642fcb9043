"""FedGMR asynchronous mask-aware aggregation: apply one client update the moment it arrives.

The server keeps a version counter ``v`` (number of updates applied so far) and,
per flat position ``j``, the version ``c_j`` of the last update that changed it.
A reply trained on the model sent at version ``v_s`` has

* version staleness ``tau = v - v_s`` (updates applied since it was sent);
* overlap ``o = |{j in M : c_j > v_s}| / |M|``: the share of the reply's mask
  ``M`` that the current model changed since it was sent. Positions nobody
  touched meanwhile are exactly as the client saw them, so staleness only
  matters on the overlap (FedGMR weights a contribution by the intersection of
  its mask with the current global model's changes);
* effective staleness ``o * tau`` and weight ``s = (1 + o * tau) ** (-a)``
  (polynomial staleness decay, ``a`` = ``staleness_exponent``; ``s = 1`` for a
  fresh reply or one whose positions were untouched).

The update is ``x_j <- x_j + eta * s * delta_j`` for ``j`` in ``M``; other
positions keep their value exactly (the single-reply case of the mask-aware
mean in :mod:`common.aggregation.masked`: each held position moves by its holder's
delta, whatever the reply's density). A reply with ``tau > max_staleness`` is
dropped without changing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate


class TooStale(ValueError):
    """A reply older than the staleness bound; the message is the logged reason."""


def staleness_weight(staleness: float, exponent: float) -> float:
    """Polynomial staleness weight ``(1 + staleness) ** (-exponent)``.

    Parameters
    ----------
    staleness : float
        Effective staleness in applied updates, ``>= 0``.
    exponent : float
        Decay exponent ``a >= 0`` (0 = no down-weighting).
    """
    if not staleness >= 0 or not exponent >= 0:
        raise ValueError(f"staleness and exponent must be >= 0, got {staleness}, {exponent}")
    return float((1.0 + staleness) ** (-exponent))


def mask_overlap(
    indices: NDArray[np.int64], last_changed: NDArray[np.int64], sent_version: int
) -> float:
    """Share of ``indices`` changed by an update applied after ``sent_version``.

    Parameters
    ----------
    indices : NDArray[int64]
        Flat positions of the reply's mask.
    last_changed : NDArray[int64]
        Per position, the version of the last applied update that changed it (0 = never).
    sent_version : int
        Version of the global model the reply was trained from.
    """
    if indices.size == 0:
        return 0.0
    return float(np.count_nonzero(last_changed[indices] > sent_version) / indices.size)


@dataclass(frozen=True)
class AsyncStep:
    """The outcome of applying one reply.

    Parameters
    ----------
    x : NDArray[float32]
        New global vector.
    last_changed : NDArray[int64]
        New per-position version of the last change.
    version : int
        New version (old version + 1).
    staleness : int
        Version staleness ``tau`` of the reply (applied updates since it was sent).
    overlap : float
        Share of the reply's mask changed since it was sent, in [0, 1].
    weight : float
        Staleness weight ``s`` actually applied, in (0, 1].
    """

    x: NDArray[np.float32]
    last_changed: NDArray[np.int64]
    version: int
    staleness: int
    overlap: float
    weight: float


def apply_async_update(
    x: NDArray[np.float32],
    last_changed: NDArray[np.int64],
    version: int,
    update: MaskedUpdate,
    sent_version: int,
    server_lr: float,
    staleness_exponent: float,
    max_staleness: int,
) -> AsyncStep:
    """Fold one reply into the global model (returns new arrays; inputs are not modified).

    Parameters
    ----------
    x : NDArray[float32]
        Current global vector, length ``d``.
    last_changed : NDArray[int64]
        Per position, version of the last update that changed it, length ``d``.
    version : int
        Current version: updates applied so far.
    update : MaskedUpdate
        The validated reply (positions and ``trained - received`` deltas; its weight is not used:
        one reply at a time has nothing to be averaged with).
    sent_version : int
        Version of the model the reply was trained from, ``<= version``.
    server_lr : float
        Server step ``eta > 0``.
    staleness_exponent : float
        ``a >= 0`` in ``(1 + o * tau) ** (-a)``.
    max_staleness : int
        Replies with ``tau > max_staleness`` raise :class:`TooStale`.
    """
    if not 0 <= sent_version <= version:
        raise ValueError(f"sent_version must be in [0, {version}], got {sent_version}")
    if update.indices.shape != update.delta.shape:
        raise ValueError("indices and delta differ in length")
    tau = version - sent_version
    if tau > max_staleness:
        raise TooStale(f"staleness {tau} exceeds gmr-max-staleness={max_staleness}")
    overlap = mask_overlap(update.indices, last_changed, sent_version)
    weight = staleness_weight(overlap * tau, staleness_exponent)
    new_x = x.copy()
    idx = update.indices
    new_x[idx] = (
        x[idx].astype(np.float64) + server_lr * weight * update.delta.astype(np.float64)
    ).astype(x.dtype)
    new_changed = last_changed.copy()
    new_changed[idx] = version + 1
    return AsyncStep(new_x, new_changed, version + 1, tau, overlap, weight)
