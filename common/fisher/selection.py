"""Submodel selection rules: which parameters each client holds.

FedFIbOS keeps the ``k = ceil(gamma * d)`` positions with the largest
``F_j^2 * x_j^2`` (client Fisher ``F`` times global value ``x``), which exactly
minimises the masking surrogate ``eps(S) = sum_{j not in S} F_j^2 x_j^2`` over all
``|S| = k``. FIARSE-style magnitude selection keeps the largest ``|x_j|``.

Guards (documented in docs/design/round.md, "Selection guards"), each optional:

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

import math
from collections.abc import Iterator, Mapping
from typing import Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from common.config.capacity import Capacity, capacity_fraction, ceil_times
from common.models.layout import ParamLayout, TensorSpec

Rule = Literal["fisher", "magnitude"]
_SCORE_BLOCK = (
    1 << 16
)  # positions per block when scores are cast to float64 (the buffer stays in L2)
RULES: tuple[str, ...] = ("fisher", "magnitude")


def budget(gamma: Capacity, d: int) -> int:
    """Number of parameters a client of capacity ``gamma`` holds: ``ceil(gamma * d)``, exactly.

    Computed in integer arithmetic on the rational the capacity stands for
    (:func:`common.config.capacity.capacity_fraction`: a float is the simplest rational that rounds
    to it, so ``budget(0.07, 100) == 7`` and ``budget(k / d, d) == k``; a fraction string is exact).

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
    """Raise ``ValueError`` unless every value is finite and non-negative (two reductions, no
    temporaries)."""
    if fisher.size and not (
        fisher.min() >= 0 and np.isfinite(fisher.max())
    ):  # NaN fails both comparisons
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
    # Block by block through explicit casts: the same products as np.multiply(..., dtype=float64),
    # without its buffered casting loop (about a third of the cost for ResNet-18).
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


def powered(fisher: NDArray, power: float) -> NDArray:
    """The estimate whose ``fisher`` rule (``F_j |x_j|``) ranks as ``F_j^power x_j^2`` does:
    ``F^(power / 2)``.

    ``power = 2`` is the definition (``fisher`` itself, not copied); ``1`` is ``F x^2``, the
    second-order change of the loss when a weight is zeroed; ``0`` ranks by ``|x|`` alone. The
    result is float32 (or ``fisher``'s float dtype), finite and non-negative when ``fisher`` is.

    Parameters
    ----------
    fisher : NDArray
        Flat, finite, non-negative Fisher estimate.
    power : float
        The exponent ``a`` of ``F^a x^2``, ``>= 0``.
    """
    if power < 0 or not math.isfinite(power):
        raise ValueError(f"power must be finite and >= 0, got {power}")
    if power == 2:
        return fisher
    f = np.asarray(fisher)
    dtype = f.dtype if f.dtype in (np.float32, np.float64) else np.float32
    if power == 0:
        return np.ones(f.shape, dtype=dtype)
    return np.power(f, power / 2, dtype=dtype)


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


#: Below this many free positions :func:`topk_mask` partitions every score (pruning would not pay
#: for its pass).
PRUNE_MIN_FREE = 1 << 16
#: Scores sampled (evenly spaced) to place the candidates' floor in :func:`topk_mask`.
PRUNE_SAMPLE = 1 << 16


def _candidate_floor(scores: NDArray[np.floating], need: int) -> float | None:
    """A score probably at or below the ``need``-th largest, read off an evenly spaced sample;
    ``None``: no use.

    The sample's rank is set about five standard deviations above the expected one, so that at least
    ``need`` scores are at or above the floor unless the sample is badly unrepresentative (the
    caller counts, and falls back to the full partition when they are not). ``None`` when the floor
    would keep most of the scores.

    Parameters
    ----------
    scores : NDArray[floating]
        Finite scores, length ``d``.
    need : int
        How many of the largest scores the candidates must hold (``0 < need``).
    """
    d = scores.shape[0]
    sample = scores[:: max(1, d // PRUNE_SAMPLE)].copy()
    s = sample.size
    expected = need * s / d
    rank = math.ceil(expected + 5.0 * math.sqrt(expected) + 8.0)  # 1-based, from the top
    if 2 * rank > s:
        return None
    sample.partition(s - rank)
    return sample[s - rank]


def topk_mask(
    scores: NDArray, k: int, forced: NDArray[np.bool_] | None = None
) -> NDArray[np.bool_]:
    """Keep ``forced`` plus the ``k - |forced|`` highest-scoring other positions.

    Deterministic: among equal scores the lower index wins. Runs in O(d): one
    partition (introselect) finds the threshold score, then one comparison
    finishes the mask (when other free positions tie the threshold: two
    comparisons and a prefix of the tied positions); nothing is sorted.

    When at most half the free positions are kept, the partition runs on candidates only: a floor
    read off a sample of the scores (:func:`_candidate_floor`), every free position scoring at least
    the floor taken (one comparison over the scores), and, when they are at least ``k - |forced|``
    and at most half the positions, the threshold is their ``k - |forced|``-th largest score. Every
    free position that scores at least the threshold is a candidate, so the threshold, and the mask,
    are those of the full partition; the floor decides only how much is partitioned.

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
    threshold = _pruned_threshold(scores, mask, n_forced, need)
    if threshold is None:
        threshold = _full_threshold(scores, mask, n_forced, need)
    return _keep_from_threshold(scores, mask, n_forced, need, threshold)


def _full_threshold(
    scores: NDArray[np.floating],
    forced: NDArray[np.bool_],
    n_forced: int,
    need: int,
) -> np.floating:
    """The ``need``-th largest free score, by one partition of every score (:func:`topk_mask`).

    Parameters
    ----------
    scores : NDArray[floating]
        Finite scores, length ``d``.
    forced : NDArray[bool]
        The forced positions (not modified).
    n_forced : int
        Positions set in ``forced``.
    need : int
        Free positions to keep (``0 < need < d - n_forced``).
    """
    d = scores.shape[0]
    # Forced positions sink below every finite score, so the need-th largest is a free position's.
    work = np.where(forced, -np.inf, scores) if n_forced else scores.copy()
    work.partition(d - need)
    return work[d - need]


def _keep_from_threshold(
    scores: NDArray[np.floating],
    mask: NDArray[np.bool_],
    n_forced: int,
    need: int,
    threshold: np.floating,
) -> NDArray[np.bool_]:
    """Add to ``mask`` the ``need`` highest-scoring free positions, given the ``need``-th largest.

    Every free position above ``threshold`` is kept, and the positions tying it fill the remaining
    room in ascending index order, so the lower index wins (:func:`topk_mask`).

    Parameters
    ----------
    scores : NDArray[floating]
        Finite scores, length ``d``.
    mask : NDArray[bool]
        The forced positions; the kept ones are set in place, and it is returned.
    n_forced : int
        Positions set in ``mask`` on entry.
    need : int
        Free positions to keep (``0 < need < d - n_forced``).
    threshold : np.floating
        The ``need``-th largest score among the free positions.
    """
    # Usually no free position ties the threshold but itself: then the free positions at or above it
    # are the mask.
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


def _pruned_threshold(
    scores: NDArray[np.floating], forced: NDArray[np.bool_], n_forced: int, need: int
) -> np.floating | None:
    """The ``need``-th largest free score, partitioned among candidates only (:func:`topk_mask`).

    ``None`` when pruning does not apply: few free positions, more than half of them needed, or a
    floor that keeps fewer than ``need`` or more than half the free positions; the caller then
    partitions every score.

    Parameters
    ----------
    scores : NDArray[floating]
        Finite scores, length ``d``.
    forced : NDArray[bool]
        The forced positions (not modified).
    n_forced : int
        Positions set in ``forced``.
    need : int
        Free positions to keep (``0 < need < d - n_forced``).
    """
    free_count = scores.shape[0] - n_forced
    if free_count < PRUNE_MIN_FREE or 2 * need > free_count:
        return None
    floor = _candidate_floor(scores, need)
    if floor is None:
        return None
    candidate = scores >= floor
    if n_forced:
        candidate &= ~forced
    n = int(np.count_nonzero(candidate))
    if n < need or 2 * n > free_count:
        return None
    values = scores.take(np.flatnonzero(candidate))
    del candidate
    values.partition(n - need)
    return values[n - need]


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
        _guard_rows(scores[start : start + t.size].reshape(rows, per_row), kept, m)
    return keep


def _guard_rows(block: NDArray, kept: NDArray[np.bool_], m: int) -> None:
    """Set in ``kept`` the ``m`` highest-scoring positions of each row of ``block`` (ties to the
    lower index).

    Parameters
    ----------
    block : NDArray
        Scores, ``(rows, per_row)`` with ``per_row > m >= 1``.
    kept : NDArray[bool]
        Same shape, written in place (a view into the mask).
    """
    rows, per_row = block.shape
    if m == 1:
        kept[np.arange(rows), block.argmax(axis=1)] = True  # argmax returns the first maximum
        return
    mth = np.partition(block, per_row - m, axis=1)[:, per_row - m : per_row - m + 1]
    above = block > mth
    ties = block == mth
    room = m - np.count_nonzero(above, axis=1, keepdims=True)
    kept[:] = above | (ties & (np.cumsum(ties, axis=1, dtype=np.int32) <= room))


def kept_vectors(layout: ParamLayout, keep_vectors: bool) -> NDArray[np.bool_]:
    """The 1-D positions the ``keep_vectors`` guard forces into every mask: those that can learn, or
    none."""
    if not keep_vectors:
        return np.zeros(layout.size, dtype=bool)
    return layout.always_kept & ~layout.inert_mask


#: Positions scored at a time by :func:`_fisher_mask` (two float64 buffers of this size stay in L2).
_FUSED_BLOCK = 1 << 16


def _fisher_floor(fisher: NDArray, x: NDArray, k: int) -> float | None:
    """:func:`_candidate_floor` of the ``fisher`` rule's scores, from the sampled positions' scores
    alone."""
    stride = max(1, x.size // PRUNE_SAMPLE)
    sample = fisher[::stride].astype(np.float64)
    sample *= np.abs(x[::stride]).astype(np.float64)
    return _candidate_floor(sample, max(1, k * sample.size // x.size))


def _rounded_candidates(
    fisher: NDArray,
    x: NDArray[np.float32],
    floor: float,
    floor32: np.float32,
    product: NDArray,
    magnitude: NDArray,
) -> tuple[NDArray[np.intp], NDArray[np.float64]] | None:
    """A block's positions scoring at least ``floor``, and their float64 scores, found on float32
    products.

    The float32 product ``fisher * |x|`` rounds the exact float64 one monotonically, so every
    position scoring at least ``floor`` has a product at least ``floor32`` (``floor`` rounded):
    those positions, with their exact scores made afterwards and the ones below ``floor`` dropped,
    are the float64 pass's candidates. ``None`` when a product leaves float32's range or ``x`` is
    not finite: the block is then scored in float64.

    Parameters
    ----------
    fisher : NDArray
        The block's Fisher values (float32 or float16: their product with a float32 is exact in
        float64).
    x : NDArray[float32]
        The block's global values.
    floor, floor32 : float, np.float32
        The candidate floor, and it rounded to float32.
    product, magnitude : NDArray[float32]
        Scratch space of the block's length.
    """
    np.abs(x, out=magnitude)
    with np.errstate(over="ignore", invalid="ignore"):  # seen below, and left to the float64 pass
        np.multiply(fisher, magnitude, out=product)
    if not np.isfinite(product.max()):
        return None
    local = np.flatnonzero(product >= floor32)
    exact = fisher.take(local).astype(np.float64)
    exact *= np.abs(x.take(local)).astype(np.float64)
    above = exact >= floor
    if not above.all():  # rounded up to the floor from below it
        local, exact = local[above], exact[above]
    return local, exact


class _BlockGuard(NamedTuple):
    """How the guards treat every block of one tensor in :func:`_fisher_mask`.

    Parameters
    ----------
    per_row : int
        Positions per row (a 1-D tensor is one row); blocks hold whole rows.
    keep_all : bool
        The guards keep every position: a 1-D tensor under ``keep_vectors``, or rows of at most
        ``min_per_row`` positions.
    rows_kept : int
        Positions the row guard keeps in each row; 0 when it reads no scores of the tensor.
    """

    per_row: int
    keep_all: bool
    rows_kept: int


def _block_guard(
    tensor: TensorSpec,
    size: int,
    min_per_row: int,
    keep_vectors: bool,
) -> _BlockGuard:
    """The guards of one tensor's blocks.

    Parameters
    ----------
    tensor : TensorSpec
        The tensor.
    size : int
        Its number of positions (``tensor.size``, which is a product on every call).
    min_per_row, keep_vectors
        The guards, as in :func:`select_mask`.
    """
    if len(tensor.shape) < 2:
        return _BlockGuard(size, keep_vectors, 0)
    per_row = size // tensor.rows
    if min_per_row <= 0:
        return _BlockGuard(per_row, False, 0)
    return _BlockGuard(per_row, per_row <= min_per_row, min_per_row)


class _Scratch:
    """Buffers :func:`_fisher_mask` scores its blocks in, reused block after block (kept in cache).

    A row longer than a block gets buffers of its own, which later blocks reuse. The float32 pair is
    empty unless ``rounded``.

    Parameters
    ----------
    d : int
        Positions in the model.
    rounded : bool
        Whether candidates may be found on float32 products (:func:`_rounded_candidates`).
    """

    def __init__(self, d: int, rounded: bool) -> None:
        self.rounded = rounded
        n = min(d, _FUSED_BLOCK)
        self._wide = np.empty(n, dtype=np.float64), np.empty(n, dtype=np.float64)
        n = n if rounded else 0
        self._narrow = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)

    def float64(self, n: int) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Two distinct float64 buffers of length ``n``."""
        if n > self._wide[0].size:
            self._wide = np.empty(n, dtype=np.float64), np.empty(n, dtype=np.float64)
        return self._wide[0][:n], self._wide[1][:n]

    def float32(self, n: int) -> tuple[NDArray[np.float32], NDArray[np.float32]]:
        """Two distinct float32 buffers of length ``n``."""
        if n > self._narrow[0].size:
            self._narrow = np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)
        return self._narrow[0][:n], self._narrow[1][:n]


def _exact_scores(
    fisher: NDArray, x: NDArray, scores: NDArray[np.float64], magnitude: NDArray[np.float64]
) -> NDArray[np.float64]:
    """A block's scores ``F_j |x_j|`` in float64, written into ``scores``, which is returned.

    Parameters
    ----------
    fisher, x : NDArray
        The block's Fisher values and global values.
    scores, magnitude : NDArray[float64]
        Scratch space of the block's length.

    Raises ``ValueError`` when a score is not finite.
    """
    scores[...] = fisher
    magnitude[...] = x
    np.abs(magnitude, out=magnitude)
    scores *= magnitude  # exact for float32 operands, as fisher_scores computes it
    if not np.isfinite(scores.max()):  # non-negative or NaN: the maximum shows both NaN and inf
        raise ValueError("scores must be finite")
    return scores


def _block_candidates(
    fisher: NDArray,
    x: NDArray,
    kept: NDArray[np.bool_],
    floor: float,
    floor32: np.float32,
    guard: _BlockGuard,
    scratch: _Scratch,
) -> tuple[NDArray[np.intp], NDArray[np.float64]] | None:
    """A block's candidates (positions outside the guards scoring at least ``floor``), and scores.

    The guards' positions of the block are set in ``kept``; ``None`` when the guards keep the whole
    block.

    Parameters
    ----------
    fisher, x : NDArray
        The block's Fisher values and global values: whole rows of one tensor.
    kept : NDArray[bool]
        The block's part of the mask (a view, all ``False`` on entry).
    floor, floor32 : float, np.float32
        The candidate floor, and it rounded to float32.
    guard : _BlockGuard
        The guards of the block's tensor.
    scratch : _Scratch
        The buffers the block is scored in.
    """
    n = fisher.size
    # Float32 products carry half the traffic of float64 ones (_rounded_candidates), but only a
    # block whose scores no guard reads can use them.
    if scratch.rounded and not (guard.keep_all or guard.rows_kept):
        picked = _rounded_candidates(fisher, x, floor, floor32, *scratch.float32(n))
        if picked is not None:
            return picked
    scores = _exact_scores(fisher, x, *scratch.float64(n))
    if guard.keep_all:
        kept[:] = True
        return None
    if guard.rows_kept:
        rows = n // guard.per_row
        block = scores.reshape(rows, guard.per_row)
        _guard_rows(block, kept.reshape(rows, guard.per_row), guard.rows_kept)
    local = np.flatnonzero(scores >= floor)
    # The guard's positions are forced, not candidates (few of them).
    local = local[~kept.take(local)]
    return local, scores.take(local)


def _fused_blocks(
    layout: ParamLayout,
    bounds: list[int],
    sizes: list[int],
    fisher: NDArray,
    x: NDArray,
    floor: float,
    mask: NDArray[np.bool_],
    min_per_row: int,
    keep_vectors: bool,
) -> Iterator[tuple[int, NDArray[np.intp], NDArray[np.float64]]]:
    """The pass of :func:`_fisher_mask`: each block's offset, candidates and their scores, in order.

    Blocks are whole rows of one tensor that can learn, scored one at a time; the guards' positions
    are set in ``mask`` as their blocks are reached, and blocks without candidates are not yielded.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    bounds, sizes : list[int]
        The tensors' offsets (``layout.offsets``) and sizes.
    fisher, x : NDArray
        The Fisher estimate and global values, flat (``x`` of a float dtype).
    floor : float
        The candidate floor (:func:`_fisher_floor`).
    mask : NDArray[bool]
        All ``False`` on entry, length ``d``; the guards' positions are set in place.
    min_per_row, keep_vectors
        The guards, as in :func:`select_mask`.
    """
    rounded = x.dtype == np.float32 and fisher.dtype in (np.float32, np.float16)
    scratch = _Scratch(layout.size, rounded)
    # A floor beyond float32's range rounds to inf: no finite product reaches it.
    with np.errstate(over="ignore"):
        floor32 = np.float32(floor)
    for t, start, size in zip(layout.tensors, bounds[:-1], sizes):
        if size == 0 or t.name in layout.inert:
            continue
        guard = _block_guard(t, size, min_per_row, keep_vectors)
        per_row = guard.per_row
        step = max(1, _FUSED_BLOCK // per_row) * per_row if per_row <= _FUSED_BLOCK else per_row
        for lo in range(start, start + size, step):
            hi = min(lo + step, start + size)
            kept = mask[lo:hi]
            block = _block_candidates(fisher[lo:hi], x[lo:hi], kept, floor, floor32, guard, scratch)
            if block is not None and block[0].size:
                yield lo, *block


def _fisher_mask(
    layout: ParamLayout, x: NDArray, fisher: NDArray, k: int, min_per_row: int, keep_vectors: bool
) -> NDArray[np.bool_] | None:
    """:func:`select_mask`'s ``fisher`` mask below capacity 1 in one pass, without the scores of
    every position.

    The same mask as ``topk_mask(fisher_scores(fisher, x), k, row_guard(...) | kept_vectors(...))``
    (inert positions left out), to the bit: the scores are the same float64 products, made one block
    of whole rows at a time in a buffer that stays in cache. In the same pass each row's guard is
    taken from its block (rows are independent), every block is checked finite, and every free
    position scoring at least a floor read off a sample of the scores (:func:`_candidate_floor`) is
    kept as a candidate, with its score. The threshold is then the ``k - |forced|``-th largest
    candidate score: every free position scoring at least it is a candidate (there are at least that
    many), so it is the full partition's threshold, and the mask is finished from the candidates,
    ties to the lower index as in :func:`topk_mask`.

    ``None`` when it does not apply and the caller takes the general path: a model of fewer than
    :data:`PRUNE_MIN_FREE` positions that can learn, more than half of them kept, values of ``x``
    that are not floats, or a floor that keeps fewer than ``k - |forced|`` positions or more than
    half of them (the sample was unrepresentative: the general path gives the same mask, slower).

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    x, fisher : NDArray
        Global values and the Fisher estimate, flat, length ``d`` (shapes checked by the caller).
    k : int
        Positions to keep (``k < d``).
    min_per_row, keep_vectors
        The guards, as in :func:`select_mask`.

    Raises ``ValueError`` as the general path does: a Fisher that is not finite and non-negative,
    scores that are not finite.
    """
    fl, xf = fisher.reshape(-1), x.reshape(-1)
    _check_fisher(fl)  # every position, inert ones too, as fisher_scores checks it
    if xf.dtype.kind != "f":
        return None
    bounds = layout.offsets.tolist()
    sizes = [
        b - a for a, b in zip(bounds[:-1], bounds[1:])
    ]  # TensorSpec.size is a product on every call
    live = layout.size - sum(n for t, n in zip(layout.tensors, sizes) if t.name in layout.inert)
    if live < PRUNE_MIN_FREE or 2 * k > live:
        return None
    floor = _fisher_floor(fl, xf, k)
    if floor is None:
        return None
    # The forced positions first; the kept ones are added at the end.
    mask = np.zeros(layout.size, dtype=bool)
    blocks = _fused_blocks(layout, bounds, sizes, fl, xf, floor, mask, min_per_row, keep_vectors)
    candidates = _gathered(blocks, live // 2)
    if candidates is None:
        return None
    return _finish_fused(layout, mask, *candidates, min(k, live), live)


def _gathered(
    blocks: Iterator[tuple[int, NDArray[np.intp], NDArray[np.float64]]], limit: int
) -> tuple[list[NDArray[np.intp]], list[NDArray[np.float64]], int] | None:
    """The blocks' candidates: flat positions and scores (an array of each per block), and count.

    ``None`` as soon as they are more than ``limit`` (the blocks after are then not scored).

    Parameters
    ----------
    blocks : Iterator[tuple[int, NDArray[intp], NDArray[float64]]]
        Each block's offset, its candidates' positions in the block and their scores
        (:func:`_fused_blocks`).
    limit : int
        Most candidates worth keeping.
    """
    positions: list[NDArray[np.intp]] = []
    values: list[NDArray[np.float64]] = []
    found = 0
    for lo, local, exact in blocks:
        found += local.size
        if found > limit:
            return None
        positions.append(local + lo)
        values.append(exact)
    return positions, values, found


def _finish_fused(
    layout: ParamLayout,
    mask: NDArray[np.bool_],
    positions: list[NDArray[np.intp]],
    values: list[NDArray[np.float64]],
    found: int,
    k: int,
    live: int,
) -> NDArray[np.bool_] | None:
    """:func:`_fisher_mask`'s mask from the guards' positions and the candidates.

    ``None`` when the candidates are fewer than the positions still to keep.

    Parameters
    ----------
    layout : ParamLayout
        The model's layout.
    mask : NDArray[bool]
        The guards' positions; the kept ones are set in place, and it is returned.
    positions, values : list[NDArray]
        The candidates' flat positions, ascending, and their scores, one array of each per block.
    found : int
        The number of candidates.
    k : int
        Positions to keep, at most ``live``.
    live : int
        Positions that can learn.
    """
    n_forced = int(np.count_nonzero(mask))
    need = k - n_forced
    if need <= 0:
        return mask
    if need >= live - n_forced:
        mask[:] = True
        if layout.inert:
            mask &= ~layout.inert_mask
        return mask
    if found < need:
        return None
    where = np.concatenate(positions)
    score = np.concatenate(values)
    ranked = score.copy()
    ranked.partition(found - need)
    threshold = ranked[found - need]
    del ranked
    at_least = score >= threshold
    if int(np.count_nonzero(at_least)) == need:
        mask[where[at_least]] = True
        return mask
    above = score > threshold
    room = need - int(np.count_nonzero(above))
    mask[where[above]] = True
    mask[where[score == threshold][:room]] = (
        True  # ascending index order, so the lowest indices win
    )
    return mask


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
        Guard: every 1-D tensor that can learn is kept (``False``: they rank like any other
        position).

    Returns
    -------
    NDArray[bool]
        The mask, length ``d``; ``True`` = the client holds and trains this position.
    """
    x, fisher = _checked_inputs(layout, x, rule, fisher)
    k = budget(gamma, layout.size)
    if k >= layout.size:
        return np.ones(layout.size, dtype=bool)
    if rule == "fisher":
        fused = _fisher_mask(layout, x, fisher, k, min_per_row, keep_vectors)
        if fused is not None:
            return fused
    return _ranked_mask(layout, x, rule, fisher, k, min_per_row, keep_vectors)


def _checked_inputs(
    layout: ParamLayout, x: NDArray, rule: Rule, fisher: NDArray | None
) -> tuple[NDArray, NDArray | None]:
    """``x`` and ``fisher`` as arrays (``fisher`` as given for ``magnitude``), or ``ValueError``.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout (defines ``d``).
    x : NDArray
        Current global parameters, flat, length ``d``.
    rule : {"fisher", "magnitude"}
        The selection rule; ``fisher`` needs ``fisher`` of ``x``'s shape.
    fisher : NDArray, optional
        Diagonal Fisher estimate, flat, length ``d``.
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
    return x, fisher


def _ranked_mask(
    layout: ParamLayout,
    x: NDArray,
    rule: Rule,
    fisher: NDArray | None,
    k: int,
    min_per_row: int,
    keep_vectors: bool,
) -> NDArray[np.bool_]:
    """:func:`select_mask`'s mask below capacity 1 on the general path: every position is scored.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout.
    x, fisher : NDArray
        Global values and (for ``fisher``) the Fisher estimate, flat, length ``d``, checked.
    rule : {"fisher", "magnitude"}
        The selection rule.
    k : int
        Positions to keep (``k < d``).
    min_per_row, keep_vectors
        The guards, as in :func:`select_mask`.
    """
    # |x| in x's own float dtype orders positions exactly as float64 would, at a fraction of the
    # traffic.
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
