"""The round's update means as running sums: one client update added at a time, the mean applied
once at the end.

Each class here is the incremental form of one batch rule: it keeps the per-position sums the batch
function builds (float64, length ``d``), takes the round's updates one by one through
:meth:`RunningSum.add` and gives the new global vector with :meth:`RunningSum.apply`. Every
position's sum is then built from the same float64 operations, in the same client order, as the
batch function builds it, so for the same updates in the same order the result is the same to the
bit (``tests/test_running_sums.py``):

===========================  ==============================================================================
running sum                  batch rule
===========================  ==============================================================================
:class:`HolderSum`           :func:`common.aggregation.masked.aggregate_masked` (example-weighted holder mean)
:class:`ParticipantSum`      :func:`common.aggregation.update_means.participant_mean_step`
:class:`NonzeroSum`          :func:`common.aggregation.update_means.nonzero_mean_step` (FIARSE)
:class:`UpdateCountSum`      :func:`common.aggregation.update_means.update_count_mean_step` (FedRolex ``avg``)
===========================  ==============================================================================

A client's update can be dropped as soon as it has been added: what the round holds is the sums (16
bytes per position, 8 for :class:`ParticipantSum`), whatever the number of clients. The sums are a
buffer of their own; the global vector is read, never written, until :meth:`RunningSum.apply`
returns a new one, so a round that is abandoned (too few replies) leaves it as it was. Float64
addition is not associative: the same updates added in another order may differ in the last bits of
a sum, and so, rarely, in a float32 result; the strategy therefore adds them in the clients' stable
key order (:mod:`server.grid_io`).
"""  # noqa: E501

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import AGGREGATION_BLOCK, MaskedUpdate, check_updates


class RunningSum(Protocol):
    """An update mean built one client at a time."""

    def add(self, update: MaskedUpdate) -> None:
        """Add one validated client update; ``ValueError`` (and nothing added) when it does not
        fit."""
        ...

    def apply(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """The new global vector: ``x`` moved by the mean of the updates added (``x`` is not
        modified)."""
        ...


def _chunks(n: int) -> range:
    """Starts of the chunks of :data:`AGGREGATION_BLOCK` entries that bound each float64
    temporary."""
    return range(0, n, AGGREGATION_BLOCK)


def _positions(indices: NDArray[np.signedinteger]) -> NDArray[np.intp]:
    """A chunk of an update's indices as numpy's index type: cast once (``int32`` ones), not at
    every indexing.

    ``a[idx] += v`` indexes twice (read, then write), and numpy casts non-``intp`` indices at each.
    """
    return indices.astype(np.intp, copy=False)


#: Update entries added at a time by :class:`HolderSum` and :class:`ParticipantSum` (their two
#: buffers stay in L2).
ADD_BLOCK = 1 << 16


def _scatter_add(
    sums: tuple[NDArray[np.float64], ...], update: MaskedUpdate, terms: tuple[float | None, ...]
) -> None:
    """Add ``w delta`` (a term ``None``) or the constant term to each of ``sums`` at the update's
    positions.

    ``np.add.at`` with ``intp`` positions and float64 values adds each entry in place (numpy 1.25
    and later have its fast path), as ``a[idx] += v`` does for positions that are all distinct,
    which a validated update's are, without the gathered copy and the scatter back: the same float64
    additions, the same sums to the bit, in about half the time below capacity 1. An update holding
    every position is added as slices. The scaled deltas and the positions go through two buffers of
    :data:`ADD_BLOCK` entries reused block by block, so nothing of the update's length is allocated.

    Parameters
    ----------
    sums : tuple of NDArray[float64]
        Per-position sums, length ``d``, updated in place.
    update : MaskedUpdate
        A checked update (:func:`common.aggregation.masked.check_updates`).
    terms : tuple of float or None
        Per sum: ``None`` adds the update's weighted delta, a number adds that number.
    """
    w, k = update.weight, update.indices.size
    full = k == sums[0].size  # strictly increasing indices below d: a slice, no index arithmetic
    scaled = np.empty(min(k, ADD_BLOCK), dtype=np.float64)
    where = np.empty(0 if full else min(k, ADD_BLOCK), dtype=np.intp)
    for lo in range(0, k, ADD_BLOCK):
        hi = min(lo + ADD_BLOCK, k)
        s = scaled[: hi - lo]
        np.multiply(update.delta[lo:hi], w, out=s, dtype=np.float64)
        if full:
            for total, term in zip(sums, terms):
                total[lo:hi] += s if term is None else term
            continue
        idx = where[: hi - lo]
        idx[...] = update.indices[lo:hi]
        for total, term in zip(sums, terms):
            np.add.at(total, idx, s if term is None else term)


class HolderSum:
    """``x_j + eta_g * sum_n w_n M_j delta_j / sum_n w_n M_j``, the holder mean of
    :func:`aggregate_masked`.

    Parameters
    ----------
    d : int
        Length of the global vector.
    server_lr : float
        Server step ``eta_g``.
    """

    def __init__(self, d: int, server_lr: float = 1.0) -> None:
        self.d = d
        self.server_lr = server_lr
        self.num = np.zeros(d, dtype=np.float64)
        self.den = np.zeros(d, dtype=np.float64)
        self.count = 0

    def add(self, update: MaskedUpdate) -> None:
        """Add ``w delta`` to the numerator and ``w`` to the denominator at the update's
        positions."""
        check_updates([update], self.d)
        _scatter_add((self.num, self.den), update, (None, update.weight))
        self.count += 1

    def apply(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """``x`` where nobody held a position, else ``x + eta_g * num / den`` rounded once to
        float32."""
        out = x.copy()
        work = np.empty(min(self.d, AGGREGATION_BLOCK), dtype=np.float64)
        for start in _chunks(self.d):
            stop = min(start + AGGREGATION_BLOCK, self.d)
            num, den, block = work[: stop - start], self.den[start:stop], out[start:stop]
            np.multiply(self.num[start:stop], self.server_lr, out=num)
            held = den > 0
            np.divide(num, den, out=num, where=held)
            num += block
            np.copyto(block, num, where=held, casting="same_kind")
        return out


class ParticipantSum:
    """``x + eta_g * sum_n w_n M^(n) delta^(n) / sum_n w_n`` over every client added
    (:func:`participant_mean_step`).

    Parameters
    ----------
    d : int
        Length of the global vector.
    server_lr : float
        Server step ``eta_g``.
    """

    def __init__(self, d: int, server_lr: float = 1.0) -> None:
        self.d = d
        self.server_lr = server_lr
        self.num = np.zeros(d, dtype=np.float64)
        self.total = 0.0
        self.count = 0

    def add(self, update: MaskedUpdate) -> None:
        """Add ``w delta`` at the update's positions and ``w`` to the total weight."""
        check_updates([update], self.d)
        _scatter_add((self.num,), update, (None,))
        self.total += update.weight
        self.count += 1

    def apply(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """``x + eta_g * num / total`` in float64, rounded once to float32 (``x`` itself when
        nothing was added)."""
        if self.total == 0.0:
            return x.copy()
        out = np.empty_like(x)
        for start in _chunks(self.d):
            stop = min(start + AGGREGATION_BLOCK, self.d)
            step = self.server_lr * self.num[start:stop] / self.total
            out[start:stop] = x[start:stop].astype(np.float64) + step
        return out


class NonzeroSum:
    """``x + eta_g * sum_n delta^(n) / #{n : delta^(n) != 0}`` per position, unweighted
    (:func:`nonzero_mean_step`).

    Parameters
    ----------
    d : int
        Length of the global vector.
    server_lr : float
        Server step ``eta_g``.
    """

    def __init__(self, d: int, server_lr: float = 1.0) -> None:
        self.d = d
        self.server_lr = server_lr
        self.num = np.zeros(d, dtype=np.float64)
        self.moved = np.zeros(d, dtype=np.int64)
        self.count = 0

    def add(self, update: MaskedUpdate) -> None:
        """Add ``delta`` at the update's positions, and 1 to the count of each position it moved."""
        check_updates([update], self.d)
        k = update.indices.size
        for lo in _chunks(k):
            hi = min(lo + AGGREGATION_BLOCK, k)
            idx, delta = _positions(update.indices[lo:hi]), update.delta[lo:hi]
            self.num[idx] += delta.astype(np.float64)
            self.moved[idx] += delta != 0
        self.count += 1

    def apply(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """``x`` where no update moved a position, else ``x + eta_g * num / count`` rounded once to
        float32."""
        out = x.copy()
        moved = self.moved > 0
        out[moved] = (
            x[moved].astype(np.float64) + self.server_lr * self.num[moved] / self.moved[moved]
        ).astype(x.dtype)
        return out


class UpdateCountSum:
    """FedRolex's published ``avg`` (:func:`update_count_mean_step`): holder mean, count-weighted at
    ``counted``.

    The weight of a holder of a counted position grows with each holder added before it in the
    round, so the result depends on the order of :meth:`add`, exactly as the batch rule's on its
    list order.

    Parameters
    ----------
    d : int
        Length of the global vector.
    counted : NDArray[int64]
        The count-weighted positions, strictly increasing.
    counts : NDArray[int64]
        One count per ``counted`` position before the round; not modified (:attr:`running` is the
        new one).
    fixed : NDArray[bool]
        ``True`` where a counted position's count does not grow within the round.
    server_lr : float
        Server step ``eta_g``.
    """

    def __init__(
        self,
        d: int,
        counted: NDArray[np.int64],
        counts: NDArray[np.int64],
        fixed: NDArray[np.bool_],
        server_lr: float = 1.0,
    ) -> None:
        if not (counted.shape == counts.shape == fixed.shape):
            raise ValueError("counted, counts and fixed differ in length")
        self.holders = HolderSum(d, server_lr)
        self.counted, self.counts, self.fixed = counted, counts, fixed
        self.server_lr = server_lr
        self.running = counts.astype(np.int64)
        self.num = np.zeros(counted.size, dtype=np.float64)
        self.den = np.zeros(counted.size, dtype=np.float64)

    @property
    def count(self) -> int:
        """Updates added."""
        return self.holders.count

    def add(self, update: MaskedUpdate) -> None:
        """Add the update with weight 1 to the holder mean, and count-weighted at the counted
        positions it held."""
        check_updates([update], self.holders.d)
        self.holders.add(MaskedUpdate(update.indices, update.delta, 1.0))
        if update.indices.size == 0:
            return
        pos = np.searchsorted(update.indices, self.counted)
        at = np.minimum(pos, update.indices.size - 1)
        held = (pos < update.indices.size) & (update.indices[at] == self.counted)
        weight = np.where(self.fixed, self.counts, self.running)[held].astype(np.float64)
        self.num[held] += weight * update.delta[at[held]].astype(np.float64)
        self.den[held] += weight
        self.running[held] += 1

    def apply(self, x: NDArray[np.float32]) -> NDArray[np.float32]:
        """The holder mean, with each counted position that somebody held replaced by its
        count-weighted mean."""
        out = self.holders.apply(x)
        moved = self.den > 0
        where = self.counted[moved]
        out[where] = (
            x[where].astype(np.float64) + self.server_lr * self.num[moved] / self.den[moved]
        ).astype(x.dtype)
        return out
