"""Submodel selection rules: which parameters each client holds.

FedFIbOS keeps the ``k = ceil(gamma * d)`` positions with the largest
``F_j^2 * x_j^2`` (client Fisher ``F`` times global value ``x``), which exactly
minimises the masking surrogate ``eps(S) = sum_{j not in S} F_j^2 x_j^2`` over all
``|S| = k``. FIARSE-style magnitude selection keeps the largest ``|x_j|``.

Guards (documented in README, "Selection guards"), each optional:

* ``keep_vectors``: 1-D tensors (biases, normalisation scales) are always kept.
* every output unit (row of a >=2-D tensor) keeps at least ``min_per_row`` of its
  highest-scoring weights, so no unit or layer is emptied.
* forced positions count toward the budget; when they alone exceed ``k`` the
  mask is exactly the forced set (the budget is then exceeded, and the reported
  density shows it).
* ties are broken by the lower flat index, so selection is deterministic.

Positions of tensors that cannot learn (``layout.inert``: a bias feeding a BatchNorm) never take
budget: below capacity 1 they are outside every mask.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from common.config.capacity import Capacity, capacity_fraction, ceil_times
from common.models.layout import ParamLayout

Rule = Literal["fisher", "magnitude"]
_SCORE_BLOCK = 1 << 16  # positions per block when scores are cast to float64 (the buffer stays in L2)
RULES: tuple[str, ...] = ("fisher", "magnitude")


def budget(gamma: Capacity, d: int) -> int:
    """Number of parameters a client of capacity ``gamma`` holds: ``ceil(gamma * d)``, exactly.

    Computed in integer arithmetic on the rational the capacity stands for
    (:func:`common.config.capacity.capacity_fraction`: a float is the simplest rational that rounds to it, so
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


def _check_fisher(fisher: NDArray) -> None:
    """Raise ``ValueError`` unless every value is finite and non-negative (two reductions, no temporaries)."""
    if fisher.size and not (fisher.min() >= 0 and np.isfinite(fisher.max())):  # NaN fails both comparisons
        raise ValueError("fisher must be finite and non-negative")


def fisher_scores(fisher: NDArray, x: NDArray) -> NDArray[np.float64]:
    """FedFIbOS ranking key ``F_j * |x_j|``, in float64.

    Ranking by ``F_j |x_j|`` orders positions exactly as ``F_j^2 x_j^2`` does
    (both are non-negative and squaring is monotone) without squaring tiny
    Fisher values toward underflow. The product of two float32 (or float16)
    values is exact in float64, so no two positions tie by rounding.
    """
    fisher = np.asarray(fisher)
    x = np.asarray(x)
    if fisher.shape != x.shape:
        raise ValueError(f"fisher shape {fisher.shape} differs from parameter shape {x.shape}")
    _check_fisher(fisher)
    # Block by block through explicit casts: the same products as np.multiply(..., dtype=float64), without
    # its buffered casting loop (about a third of the cost for ResNet-18).
    absx = np.abs(x).reshape(-1)
    flat = fisher.reshape(-1)
    out = np.empty(flat.shape, dtype=np.float64)
    wide = np.empty(min(flat.size, _SCORE_BLOCK), dtype=np.float64)
    for start in range(0, flat.size, _SCORE_BLOCK):
        span = slice(start, start + _SCORE_BLOCK)
        o, w = out[span], wide[: len(out[span])]
        o[...] = flat[span]
        w[...] = absx[span]
        o *= w
    return out.reshape(x.shape)


def magnitude_scores(x: NDArray) -> NDArray[np.float64]:
    """FIARSE ranking key ``|x_j|``."""
    return np.abs(np.asarray(x, dtype=np.float64))


def _float_scores(scores: NDArray) -> NDArray[np.floating]:
    """Scores as a float array (any float width keeps its order; integers become float64)."""
    scores = np.asarray(scores)
    return scores if scores.dtype.kind == "f" else scores.astype(np.float64)


def _check_finite(scores: NDArray[np.floating]) -> None:
    if scores.size and not (np.isfinite(scores.min()) and np.isfinite(scores.max())):
        raise ValueError("scores must be finite")


def topk_mask(scores: NDArray, k: int, forced: NDArray[np.bool_] | None = None) -> NDArray[np.bool_]:
    """Keep ``forced`` plus the ``k - |forced|`` highest-scoring other positions.

    Deterministic: among equal scores the lower index wins. Runs in O(d): one
    partition (introselect) finds the threshold score, then one comparison
    finishes the mask (when other free positions tie the threshold: two
    comparisons and a prefix of the tied positions); nothing is sorted.

    Parameters
    ----------
    scores : NDArray
        Finite ranking key per position, length ``d`` (any float dtype; compared as given).
    k : int
        Number of positions to keep, 0 <= k <= d.
    forced : NDArray[bool], optional
        Positions that are kept regardless of score (not modified).
    """
    scores = _float_scores(scores)
    d = scores.shape[0]
    if not 0 <= k <= d:
        raise ValueError(f"k must be in [0, {d}], got {k}")
    _check_finite(scores)
    mask = np.zeros(d, dtype=bool) if forced is None else np.array(forced, dtype=bool)
    n_forced = int(np.count_nonzero(mask))
    need = k - n_forced
    if need <= 0:
        return mask
    if need >= d - n_forced:
        mask[:] = True
        return mask
    # Forced positions sink below every finite score, so the need-th largest is a free position's.
    work = np.where(mask, -np.inf, scores) if n_forced else scores.copy()
    work.partition(d - need)
    threshold = work[d - need]
    del work
    # Usually no free position ties the threshold but itself: then the free positions at or above it are the mask.
    at_least = scores >= threshold
    free = ~mask if n_forced else None
    if free is not None:
        at_least &= free
    if int(np.count_nonzero(at_least)) == need:
        mask |= at_least
        return mask
    del at_least
    above = scores > threshold
    ties = scores == threshold
    if free is not None:
        above &= free
        ties &= free
    room = need - int(np.count_nonzero(above))
    mask |= above
    mask[np.flatnonzero(ties)[:room]] = True  # ascending index order, so the lowest indices win
    return mask


def row_guard(scores: NDArray, layout: ParamLayout, min_per_row: int) -> NDArray[np.bool_]:
    """The ``min_per_row`` highest-scoring positions of every row of every >=2-D tensor.

    Each tensor's rows are one contiguous ``(rows, per_row)`` block of the flat
    vector, so the guard is a per-row argmax (``min_per_row = 1``) or a per-row
    partition on that view: one pass per tensor, no sort. Ties go to the lower
    index, as in :func:`topk_mask`.
    """
    scores = np.asarray(scores)
    keep = np.zeros(layout.size, dtype=bool)
    if min_per_row <= 0:
        return keep
    m = min_per_row
    for t, start in zip(layout.tensors, layout.offsets[:-1].tolist()):
        if len(t.shape) < 2 or t.size == 0:
            continue
        rows, per_row = t.rows, t.size // t.rows
        kept = keep[start : start + t.size].reshape(rows, per_row)  # a view: writes land in keep
        if per_row <= m:
            kept[:] = True
            continue
        block = scores[start : start + t.size].reshape(rows, per_row)
        if m == 1:
            kept[np.arange(rows), block.argmax(axis=1)] = True  # argmax returns the first maximum
            continue
        mth = np.partition(block, per_row - m, axis=1)[:, per_row - m : per_row - m + 1]
        above = block > mth
        ties = block == mth
        room = m - np.count_nonzero(above, axis=1, keepdims=True)
        kept[:] = above | (ties & (np.cumsum(ties, axis=1, dtype=np.int32) <= room))
    return keep


def kept_vectors(layout: ParamLayout, keep_vectors: bool) -> NDArray[np.bool_]:
    """The 1-D positions the ``keep_vectors`` guard forces into every mask: those that can learn, or none."""
    if not keep_vectors:
        return np.zeros(layout.size, dtype=bool)
    return layout.always_kept & ~layout.inert_mask


def select_mask(
    layout: ParamLayout,
    x: NDArray,
    gamma: float,
    rule: Rule,
    fisher: NDArray | None = None,
    min_per_row: int = 1,
    keep_vectors: bool = True,
) -> NDArray[np.bool_]:
    """Flat submodel mask for one client.

    At capacity 1 (budget ``d``) the mask is every position and nothing is scored
    (the Fisher's values are then not read, only its shape checked).

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
    keep_vectors : bool
        Guard: every 1-D tensor that can learn is kept (``False``: they rank like any other position).

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
        fisher = np.asarray(fisher)
        if fisher.shape != x.shape:
            raise ValueError(f"fisher shape {fisher.shape} differs from parameter shape {x.shape}")
    elif rule != "magnitude":
        raise ValueError(f"unknown selection rule {rule!r}; expected one of {RULES}")
    k = budget(gamma, layout.size)
    if k >= layout.size:
        return np.ones(layout.size, dtype=bool)
    # |x| in x's own float dtype orders positions exactly as float64 would, at a fraction of the traffic.
    scores = fisher_scores(fisher, x) if rule == "fisher" else np.abs(_float_scores(x))
    forced = row_guard(scores, layout, min_per_row) | kept_vectors(layout, keep_vectors)
    inert = layout.inert_mask
    if not inert.any():
        return topk_mask(scores, k, forced)
    live = np.flatnonzero(~inert)
    forced &= ~inert
    mask = np.zeros(layout.size, dtype=bool)
    mask[live] = topk_mask(scores[live], min(k, live.size), forced[live])
    return mask


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
