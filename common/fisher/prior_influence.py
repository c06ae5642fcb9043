"""How far one client, whatever it uploads, can move a mask ranked by the trimmed Fisher prior.

The global prior is the per-position trimmed mean of the ``n`` clients' Fisher
estimates (``k >= 1`` values cut at each end). A trimmed mean is
non-decreasing in every input, so replacing any one client's value by anything
moves a position no lower than replacing the *largest* value by ``0`` and no
higher than replacing the *smallest* value by ``+inf``. Those two extremes are
the window ``sorted[k-1 : n-k-1]`` and ``sorted[k+1 : n-k+1]``: an interval
``[lo, hi]`` per position that holds for every possible upload of any one
client, honest or not, and is attained by an attacker that knows the others.

From the score interval ``[lo, hi] * |x|`` follows which positions of a
capacity-``gamma`` mask (:func:`common.fisher.selection.select_mask`) are decided no
matter what that client sends: certainly kept when even the lowest score beats
the highest possible selection threshold, certainly dropped when even the
highest score loses to the lowest possible threshold and to the row guard.
Every other position is *contested*. Two masks built from priors that differ
in one client's upload can only differ on contested positions, so the share of
contested positions is a certified bound on the share of entries one poisoning
client can flip, over all attacks (no attack has to be imagined to use it).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np
from numpy.typing import NDArray

from common.fisher.selection import budget, kept_vectors
from common.models.layout import ParamLayout


def trim_count(trim: float, n: int) -> int:
    """Values cut at each end of ``n`` by the prior with ``fisher-trim = trim`` (0 below three
    clients)."""
    if trim <= 0 or n < 3:
        return 0
    return max(1, int(trim * n))


#: Up to this many rows the columns are sorted by a sorting network (below): past it ``np.sort`` is
#: faster.
NETWORK_MAX_ROWS = 160
_TILE = 1 << 16  # columns sorted together: a tile of rows stays in cache through the network


@lru_cache(maxsize=64)
def _sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Comparators ``(i, j)``, ``i < j``, of Batcher's odd-even merge sort of ``n`` inputs (any
    ``n``)."""
    pairs = []
    p = 1
    while p < n:
        k = p
        while k >= 1:
            j = k % p
            while j + k < n:
                for i in range(min(k, n - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
                j += 2 * k
            k //= 2
        p *= 2
    return tuple(pairs)


def sort_columns(values: NDArray) -> NDArray:
    """``np.sort(values, axis=0)`` (float16 is returned as float32, exactly), fast for few rows.

    Sorting each column of a ``(clients, positions)`` stack along the short,
    strided axis is slow in numpy; a sorting network instead runs the same
    ``O(n log^2 n)`` comparators on every column at once as elementwise
    ``minimum``/``maximum`` of whole rows, tile by tile. The values sorted are
    the same, so everything computed from them is too.
    """
    values = np.asarray(values)
    n = values.shape[0]
    dtype = (
        np.dtype(np.float32) if values.dtype == np.float16 else values.dtype
    )  # fp16 min/max are slow
    if n > NETWORK_MAX_ROWS:
        return np.sort(values, axis=0).astype(dtype, copy=False)
    out = np.empty(values.shape, dtype=dtype)
    network = _sorting_network(n)
    for start in range(0, values.shape[1], _TILE):
        cols = slice(start, start + _TILE)
        rows = [values[r, cols].astype(dtype) for r in range(n)]
        spare = np.empty_like(rows[0]) if n else None
        for i, j in network:
            np.minimum(rows[i], rows[j], out=spare)
            np.maximum(rows[i], rows[j], out=rows[j])
            rows[i], spare = spare, rows[i]
        for r in range(n):
            out[r, cols] = rows[r]
    return out


def trimmed_mean_bounds(
    values: NDArray, k: int
) -> tuple[NDArray[np.float32], NDArray[np.float32], NDArray[np.float32]]:
    """Trimmed mean per column and the interval any one row's replacement can move it to.

    Parameters
    ----------
    values : NDArray
        Shape ``(n, m)``: one non-negative Fisher estimate per row (client), ``m`` positions.
    k : int
        Rows cut at each end per column, ``1 <= k`` and ``2k < n``.

    Returns
    -------
    mean, lo, hi : NDArray[float32]
        The trimmed mean (as :class:`common.fisher.state.FisherState` computes it)
        and, per column, its smallest and largest value over every replacement
        of one row by any non-negative values.
    """
    values = np.asarray(values)
    if values.ndim != 2:
        raise ValueError(f"values must be 2-D (clients x positions), got shape {values.shape}")
    n = values.shape[0]
    if not (k >= 1 and 2 * k < n):
        raise ValueError(f"need 1 <= k and 2k < n, got k={k}, n={n}")
    s = sort_columns(values)
    mean = s[k : n - k].mean(axis=0, dtype=np.float64).astype(np.float32)
    lo = s[k - 1 : n - k - 1].mean(axis=0, dtype=np.float64).astype(np.float32)
    hi = s[k + 1 : n - k + 1].mean(axis=0, dtype=np.float64).astype(np.float32)
    return mean, lo, hi


def contested_positions(
    layout: ParamLayout,
    x: NDArray,
    gamma: float,
    lo: NDArray,
    hi: NDArray,
    min_per_row: int = 1,
    keep_vectors: bool = True,
) -> NDArray[np.bool_]:
    """Positions whose membership in the Fisher-ranked mask depends on one client's upload.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout.
    x : NDArray
        Global parameters, flat, length ``d``.
    gamma : float
        Capacity of the mask, in (0, 1].
    lo, hi : NDArray
        Per-position bounds of the Fisher estimate the mask is ranked by (``lo <= hi``).
    min_per_row : int
        The selection's row guard (positions kept per output unit).
    keep_vectors : bool
        The selection's vector guard (1-D tensors always kept).

    Returns
    -------
    NDArray[bool]
        ``True`` where the mask may differ between two estimates inside ``[lo, hi]``;
        outside these positions every such mask agrees.
    """
    return contested_by_level(layout, x, [gamma], lo, hi, min_per_row, keep_vectors)[0]


def contested_by_level(
    layout: ParamLayout,
    x: NDArray,
    gammas: Sequence[float],
    lo: NDArray,
    hi: NDArray,
    min_per_row: int = 1,
    keep_vectors: bool = True,
) -> list[NDArray[np.bool_]]:
    """:func:`contested_positions` for several capacities at once (the same arrays, in the order of
    ``gammas``).

    What does not depend on the capacity (the score bounds, the row guard's bounds)
    is computed once, and the thresholds of every level come from one multi-rank
    partition of each bound instead of two partitions per level.

    Parameters
    ----------
    layout, x, lo, hi, min_per_row, keep_vectors
        As for :func:`contested_positions`.
    gammas : Sequence[float]
        Capacities, each in (0, 1].
    """
    s_lo, s_hi = _score_bounds(layout, x, lo, hi)
    # Inert positions are in no mask below capacity 1 and take no budget
    # (common.fisher.selection.select_mask).
    forced = kept_vectors(layout, keep_vectors)
    eligible = ~forced & ~layout.inert_mask
    n_eligible = int(np.count_nonzero(eligible))
    # The guard keeps the top min_per_row of every row: how many positions that is does not depend
    # on scores.
    guard = sum(
        t.rows * min(t.size // t.rows, max(min_per_row, 0))
        for t in layout.tensors
        if len(t.shape) >= 2
    )
    # Positions chosen by score beyond always-kept and guard; at or past n_eligible - guard every
    # one is kept.
    needs = [budget(g, layout.size) - int(np.count_nonzero(forced)) - guard for g in gammas]
    open_needs = [need for need in needs if need < n_eligible - guard]
    if n_eligible == 0 or not open_needs:
        return [np.zeros(layout.size, dtype=bool) for _ in gammas]
    if min_per_row > 0:
        not_guard, in_guard = _row_guard_bounds(layout, s_lo, s_hi, min_per_row)
    else:
        not_guard, in_guard = eligible, np.zeros(layout.size, dtype=bool)
    unsure = guard - int(np.count_nonzero(in_guard & eligible))
    ranked = sorted({need for need in open_needs if need > 0})
    thresholds = _threshold_bounds(s_lo, s_hi, eligible & ~in_guard, ranked, unsure)
    candidates = (
        eligible & ~in_guard
    )  # contested positions are eligible and not surely in the guard
    out = []
    for need in needs:
        if need < n_eligible - guard:
            out.append(_contested_level(s_lo, s_hi, candidates, not_guard, thresholds.get(need)))
        else:
            out.append(np.zeros(layout.size, dtype=bool))  # every position is decided
    return out


def _score_bounds(
    layout: ParamLayout, x: NDArray, lo: NDArray, hi: NDArray
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """The score interval ``[lo, hi] * |x|`` of every position, in float64, checked.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout (defines ``d``).
    x : NDArray
        Global parameters, flat, length ``d``.
    lo, hi : NDArray
        Per-position bounds of the Fisher estimate, length ``d`` (``lo <= hi``, else ValueError).
    """
    # lo, hi and |x| are float32 in practice: their float64 products are exact, so no bound is lost
    # to rounding.
    absx = np.abs(np.asarray(x))
    s_lo = np.multiply(lo, absx, dtype=np.float64)
    s_hi = np.multiply(hi, absx, dtype=np.float64)
    del absx
    if s_lo.shape != (layout.size,) or s_hi.shape != (layout.size,):
        raise ValueError(f"lo and hi must have shape ({layout.size},)")
    if np.any(s_lo > s_hi):
        raise ValueError("lo must not exceed hi")
    return s_lo, s_hi


def _threshold_bounds(
    s_lo: NDArray[np.float64],
    s_hi: NDArray[np.float64],
    rest: NDArray[np.bool_],
    needs: list[int],
    unsure: int,
) -> dict[int, tuple[float, float]]:
    """The lowest and highest selection threshold each ``need`` can have, by need.

    The threshold is the need-th largest score among the eligible positions outside the guard. Those
    lie among the positions not surely in the guard (``rest``), less the ``unsure`` others the guard
    takes: so the threshold is at most their need-th largest ``hi`` and at least their
    ``(need + unsure)``-th largest ``lo``.

    Parameters
    ----------
    s_lo, s_hi : NDArray[float64]
        Lowest and highest score of every position.
    rest : NDArray[bool]
        The eligible positions not surely in the row guard.
    needs : list[int]
        Positions chosen by score, ascending, distinct and positive.
    unsure : int
        Positions the guard takes that are not surely in it.
    """
    # Positions outside rest sink to -inf, below every score, instead of being gathered out.
    t_hi = _kth_largest(np.where(rest, s_hi, -np.inf), needs)
    t_lo = _kth_largest(np.where(rest, s_lo, -np.inf), [need + unsure for need in needs])
    return {need: (t_lo[i], t_hi[i]) for i, need in enumerate(needs)}


def _contested_level(
    s_lo: NDArray[np.float64],
    s_hi: NDArray[np.float64],
    candidates: NDArray[np.bool_],
    not_guard: NDArray[np.bool_],
    thresholds: tuple[float, float] | None,
) -> NDArray[np.bool_]:
    """The contested positions of one capacity that leaves some positions to choose by score.

    Parameters
    ----------
    s_lo, s_hi : NDArray[float64]
        Lowest and highest score of every position.
    candidates : NDArray[bool]
        The eligible positions not surely in the row guard.
    not_guard : NDArray[bool]
        The positions surely outside the row guard.
    thresholds : tuple[float, float] or None
        Lowest and highest selection threshold (:func:`_threshold_bounds`); ``None`` when no
        position is chosen by score.
    """
    contested = np.zeros(s_lo.size, dtype=bool)
    if thresholds is not None:
        low_threshold, high_threshold = thresholds
        # Surely above the highest threshold: surely kept.
        np.greater(s_lo, high_threshold, out=contested)
        np.logical_not(contested, out=contested)
        contested &= candidates
    else:
        low_threshold = np.inf  # only the guard is kept beyond the always-kept positions
        contested[:] = candidates
    contested &= ~(not_guard & (s_hi < low_threshold))
    return contested


def _kth_largest(values: NDArray[np.float64], ks: Sequence[int]) -> list[float]:
    """The ``k``-th largest entry for each ``k`` in ``ks`` (each ``1 <= k <= len``), by one in-place
    partition."""
    if not ks:
        return []
    values.partition([values.size - k for k in ks])
    return [float(values[values.size - k]) for k in ks]


def _row_guard_bounds(
    layout: ParamLayout, lo: NDArray[np.float64], hi: NDArray[np.float64], m: int
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """Positions surely outside and surely inside the row guard (top ``m`` scores of each row),
    length ``d``.

    Outside for sure: ``m`` other positions of the row score higher whatever happens
    (``hi`` below the row's ``m``-th largest ``lo``; a position among those ``m``
    has ``hi >= lo >=`` that value, so it is never wrongly excluded). Inside for sure:
    fewer than ``m`` others can reach its lowest score (``lo`` above the ``m``-th
    largest ``hi`` among the *other* positions), or the row has at most ``m`` positions.
    Rows are contiguous runs of the flat vector, so each tensor is one ``(rows, per_row)`` block.
    With ``m = 1`` only a row's largest ``hi`` can be surely inside (every other position's
    ``lo`` is at most its own ``hi``, below that maximum), so row maxima replace the partitions.
    """
    not_guard = np.zeros(layout.size, dtype=bool)
    in_guard = np.zeros(layout.size, dtype=bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1].tolist()):
        if len(t.shape) < 2 or t.size == 0:
            continue
        per_row = t.size // t.rows
        block = slice(start, start + t.size)
        if per_row <= m:
            in_guard[block] = True
            continue
        lo_b, hi_b = lo[block].reshape(t.rows, per_row), hi[block].reshape(t.rows, per_row)
        if m == 1:
            rows = np.arange(t.rows)
            top = hi_b.argmax(axis=1)
            others = hi_b.copy()
            others[rows, top] = -np.inf
            second_hi = others.max(
                axis=1
            )  # the others' largest hi, seen from the row's top position
            np.less(
                hi_b, lo_b.max(axis=1, keepdims=True), out=not_guard[block].reshape(t.rows, per_row)
            )
            # A tie for the row's largest hi makes second_hi == top_hi >= lo: never surely inside.
            in_guard[block].reshape(t.rows, per_row)[rows, top] = lo_b[rows, top] > second_hi
            continue
        mth_lo = np.partition(lo_b, per_row - m, axis=1)[:, per_row - m]
        top = np.partition(hi_b, (per_row - m - 1, per_row - m), axis=1)
        mth_hi, next_hi = top[:, per_row - m], top[:, per_row - m - 1]
        # Without this position the others' m-th largest hi is the next one when it is itself among
        # the top m.
        others_mth_hi = np.where(hi_b >= mth_hi[:, None], next_hi[:, None], mth_hi[:, None])
        not_guard[block] = (hi_b < mth_lo[:, None]).ravel()
        in_guard[block] = (lo_b > others_mth_hi).ravel()
    return not_guard, in_guard
