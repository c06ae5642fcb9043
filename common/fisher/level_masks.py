"""Masks that depend only on the capacity level, computed once while the model and the ranking stay
the same.

A mask ranked by the global prior (a client never seen, one evicted beyond the
Fisher memory budget, and every submodel central evaluation measures) or by
magnitude (before any Fisher exists) depends on the global values ``x``, the
estimate it is ranked by and the capacity, not on the client: every such client
of one level gets the same mask, and central evaluation after round ``t``
measures the very masks the prior-ranked clients of round ``t + 1`` are sent.
:class:`LevelMasks` keeps those masks, one per level, and drops them all when the
model's values or the estimate change.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np
from numpy.typing import NDArray


class LevelMasks:
    """One cached mask per capacity level, valid for one model vector and one ranking estimate.

    Notes
    -----
    The model is compared by value (the strategy rebuilds its flat vector from the
    round's arrays, so an equal model is often a new array): the cache keeps a copy
    of it, 4 bytes per parameter, besides the masks (1 byte per parameter and level).
    The masks handed out are read-only, so no caller can alter the cached copy.
    """

    def __init__(self) -> None:
        self._x: NDArray[np.float32] | None = None
        self._token: tuple[Hashable, ...] | None = None
        self._masks: dict[float, NDArray[np.bool_]] = {}
        self.hits = 0
        self.misses = 0

    def get(
        self,
        x: NDArray[np.float32],
        token: tuple[Hashable, ...],
        gamma: float,
        compute: Callable[[], NDArray[np.bool_]],
    ) -> NDArray[np.bool_]:
        """The mask of level ``gamma`` for model ``x`` and ranking ``token``, from ``compute()`` on
        a miss.

        Parameters
        ----------
        x : NDArray[float32]
            The global values the mask is ranked at (flat).
        token : tuple
            What identifies the ranking estimate: equal tokens mean an unchanged estimate
            (compared with ``==``; objects without their own equality compare by identity).
        gamma : float
            The capacity level.
        compute : Callable[[], NDArray[bool]]
            Computes the mask when it is not cached.
        """
        if token != self._token or self._x is None or not np.array_equal(self._x, x):
            self._masks.clear()
            self._token = token
            self._x = np.array(x, copy=True)
        mask = self._masks.get(gamma)
        if mask is None:
            self.misses += 1
            mask = compute()
            mask.flags.writeable = False
            self._masks[gamma] = mask
        else:
            self.hits += 1
        return mask

    def clear(self) -> None:
        """Forget every mask (e.g. when the method's state is replaced by a checkpoint's)."""
        self._x, self._token = None, None
        self._masks.clear()
