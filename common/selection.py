"""Submodel selection rules: which parameters each client holds.

FedFIbOS keeps the ``k = ceil(gamma * d)`` positions with the largest
``F_j^2 * x_j^2`` (client Fisher ``F`` times global value ``x``), which exactly
minimises the masking surrogate ``eps(S) = sum_{j not in S} F_j^2 x_j^2`` over all
``|S| = k``. FIARSE-style magnitude selection keeps the largest ``|x_j|``.

Guards (documented in README, "Selection guards"):

* 1-D tensors (biases, normalisation scales) are always kept: they are a tiny
  share of ``d`` and a unit without its bias shifts every activation.
* every output unit (row of a >=2-D tensor) keeps at least ``min_per_row`` of its
  highest-scoring weights, so no unit or layer is emptied.
* forced positions count toward the budget; when they alone exceed ``k`` the
  mask is exactly the forced set (the budget is then exceeded, and the reported
  density shows it).
* ties are broken by the lower flat index, so selection is deterministic.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.layout import ParamLayout
from common.rational import Capacity, capacity_fraction, ceil_times

Rule = Literal["fisher", "magnitude"]
RULES: tuple[str, ...] = ("fisher", "magnitude")


def budget(gamma: Capacity, d: int) -> int:
    """Number of parameters a client of capacity ``gamma`` holds: ``ceil(gamma * d)``, exactly.

    Computed in integer arithmetic on the rational the capacity stands for
    (:func:`common.rational.capacity_fraction`: a float is the simplest rational that rounds to it, so
    ``budget(0.07, 100) == 7`` and ``budget(k / d, d) == k``; a fraction string is exact).

    Parameters
    ----------
    gamma : float, Fraction or str
        Capacity, the fraction of the global model the client can hold, in (0, 1].
    d : int
        Total number of trainable parameters.
    """
    exact = capacity_fraction(gamma)
    if not 0 < exact.numerator <= exact.denominator:
        raise ValueError(f"capacity gamma must be in (0, 1], got {gamma}")
    if d < 0:
        raise ValueError(f"d must be non-negative, got {d}")
    return min(d, ceil_times(exact, d))


def fisher_scores(fisher: NDArray, x: NDArray) -> NDArray[np.float64]:
    """FedFIbOS ranking key ``F_j * |x_j|``.

    Ranking by ``F_j |x_j|`` orders positions exactly as ``F_j^2 x_j^2`` does
    (both are non-negative and squaring is monotone) without squaring tiny
    Fisher values toward underflow.
    """
    fisher = np.asarray(fisher, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    if fisher.shape != x.shape:
        raise ValueError(f"fisher shape {fisher.shape} differs from parameter shape {x.shape}")
    if not np.all(np.isfinite(fisher)) or np.any(fisher < 0):
        raise ValueError("fisher must be finite and non-negative")
    return fisher * np.abs(x)


def magnitude_scores(x: NDArray) -> NDArray[np.float64]:
    """FIARSE ranking key ``|x_j|``."""
    return np.abs(np.asarray(x, dtype=np.float64))


def topk_mask(scores: NDArray, k: int, forced: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """Keep ``forced`` plus the ``k - |forced|`` highest-scoring other positions.

    Deterministic: among equal scores the lower index wins. Runs in O(d) using a
    partition around the threshold instead of a full sort.

    Parameters
    ----------
    scores : NDArray
        Finite ranking key per position, length ``d``.
    k : int
        Number of positions to keep, 0 <= k <= d.
    forced : NDArray[bool], optional
        Positions that are kept regardless of score.
    """
    scores = np.asarray(scores, dtype=np.float64)
    d = scores.shape[0]
    if not 0 <= k <= d:
        raise ValueError(f"k must be in [0, {d}], got {k}")
    if not np.all(np.isfinite(scores)):
        raise ValueError("scores must be finite")
    mask = np.zeros(d, dtype=bool) if forced is None else forced.copy()
    free = np.flatnonzero(~mask)
    need = k - int(mask.sum())
    if need <= 0 or free.size == 0:
        return mask
    if need >= free.size:
        mask[free] = True
        return mask
    s = scores[free]
    threshold = np.partition(s, free.size - need)[free.size - need]
    above = free[s > threshold]
    ties = free[s == threshold]  # ascending index order, so the lowest indices win
    mask[above] = True
    mask[ties[: need - above.size]] = True
    return mask


def row_guard(scores: NDArray, layout: ParamLayout, min_per_row: int) -> NDArray[np.bool_]:
    """The ``min_per_row`` highest-scoring positions of every row of every >=2-D tensor."""
    keep = np.zeros(layout.size, dtype=bool)
    if min_per_row <= 0:
        return keep
    eligible = np.flatnonzero(~layout.always_kept)
    if eligible.size == 0:
        return keep
    rows = layout.row_ids[eligible]
    order = np.lexsort((eligible, -np.asarray(scores, dtype=np.float64)[eligible], rows))
    sorted_rows = rows[order]
    starts = np.flatnonzero(np.r_[True, sorted_rows[1:] != sorted_rows[:-1]])
    rank = np.arange(order.size) - np.repeat(starts, np.diff(np.r_[starts, order.size]))
    keep[eligible[order[rank < min_per_row]]] = True
    return keep


def select_mask(
    layout: ParamLayout,
    x: NDArray,
    gamma: float,
    rule: Rule,
    fisher: NDArray | None = None,
    min_per_row: int = 1,
) -> NDArray[np.bool_]:
    """Flat submodel mask for one client.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout (defines ``d``, rows and 1-D tensors).
    x : NDArray
        Current global parameters, flat, length ``d``.
    gamma : float
        Client capacity in (0, 1]; the budget is ``ceil(gamma * d)`` positions.
    rule : {"fisher", "magnitude"}
        ``fisher`` ranks by ``F_j^2 x_j^2`` (needs ``fisher``); ``magnitude`` by ``|x_j|``.
    fisher : NDArray, optional
        Diagonal Fisher estimate for this client, flat, length ``d``.
    min_per_row : int
        Guard: positions kept per output unit (0 disables the guard).

    Returns
    -------
    NDArray[bool]
        The mask, length ``d``; ``True`` = the client holds and trains this position.
    """
    x = np.asarray(x)
    if x.shape != (layout.size,):
        raise ValueError(f"x has shape {x.shape}, expected ({layout.size},)")
    if rule == "fisher":
        if fisher is None:
            raise ValueError("rule 'fisher' needs a Fisher estimate")
        scores = fisher_scores(fisher, x)
    elif rule == "magnitude":
        scores = magnitude_scores(x)
    else:
        raise ValueError(f"unknown selection rule {rule!r}; expected one of {RULES}")
    k = budget(gamma, layout.size)
    forced = layout.always_kept | row_guard(scores, layout, min_per_row)
    return topk_mask(scores, k, forced)


def select_submodel(
    params: Mapping[str, NDArray],
    gamma: float,
    rule: Rule = "fisher",
    fisher: Mapping[str, NDArray] | None = None,
    min_per_row: int = 1,
) -> dict[str, NDArray[np.bool_]]:
    """Select a submodel on named arrays (the entry point for engineers).

    Parameters
    ----------
    params : Mapping[str, NDArray]
        Global model tensors by name (e.g. a ``state_dict`` as numpy arrays).
    gamma : float
        Capacity in (0, 1].
    rule : {"fisher", "magnitude"}
        Selection rule.
    fisher : Mapping[str, NDArray], optional
        Diagonal Fisher per tensor, same names and shapes as ``params``.
    min_per_row : int
        Guard: positions kept per output unit.

    Returns
    -------
    dict[str, NDArray[bool]]
        One boolean mask per tensor, shaped like it.
    """
    layout = ParamLayout.from_arrays(params)
    x = layout.flatten(params)
    f = None if fisher is None else layout.flatten(fisher)
    mask = select_mask(layout, x, gamma, rule, f, min_per_row)
    return {name: m.copy() for name, m in layout.unflatten(mask).items()}


def masking_error(fisher: NDArray, x: NDArray, mask: NDArray[np.bool_]) -> float:
    """The surrogate ``eps(S) = sum_{j not in S} F_j^2 x_j^2`` of a mask."""
    f = np.asarray(fisher, dtype=np.float64)
    v = np.asarray(x, dtype=np.float64)
    return float(np.sum((f[~mask] * v[~mask]) ** 2))
