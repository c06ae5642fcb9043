"""How much a client's submodel moves between rounds, and per-capacity means of per-client figures.

A client's mask at round ``t`` is compared with its own previous mask by the Jaccard overlap
``|A & B| / |A | B|`` (1: the same positions; 0: none shared). A Fisher-ranked mask that flips
between layers round after round keeps a client from training any one submodel; the overlap
shows it at a glance, next to the positions each tensor holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from statistics import fmean

import numpy as np
from numpy.typing import NDArray


def jaccard(a: NDArray[np.bool_], b: NDArray[np.bool_]) -> float:
    """``|a & b| / |a | b|`` of two masks of equal length (1.0 for two empty masks)."""
    if a.shape != b.shape:
        raise ValueError(f"masks differ in shape: {a.shape} and {b.shape}")
    union = int(np.count_nonzero(a | b))
    return 1.0 if union == 0 else int(np.count_nonzero(a & b)) / union


class MaskHistory:
    """Each client's last mask (packed bits, ``d / 8`` bytes a client), to measure the next one
    against.

    Parameters
    ----------
    d : int
        Mask length (the model's parameter count).
    """

    def __init__(self, d: int) -> None:
        self.d = d
        self._last: dict[str, NDArray[np.uint8]] = {}

    def observe(self, key: str, mask: NDArray[np.bool_]) -> float | None:
        """Record ``key``'s new mask; its overlap with the previous one (``None`` the first
        time)."""
        if mask.shape != (self.d,):
            raise ValueError(f"mask has shape {mask.shape}, expected ({self.d},)")
        prev = self._last.get(key)
        self._last[key] = np.packbits(mask)
        if prev is None:
            return None
        return jaccard(np.unpackbits(prev, count=self.d).astype(bool), mask)


def per_capacity_means(rows: Iterable[tuple[float, float, float]]) -> dict[str, dict[str, float]]:
    """``(capacity, accuracy, loss)`` per client -> per capacity level: mean accuracy, mean loss,
    clients.

    Levels are keyed as ``f"{gamma:g}"`` and ordered from the largest capacity down.
    """
    by_level: dict[float, list[tuple[float, float]]] = {}
    for gamma, acc, loss in rows:
        by_level.setdefault(float(gamma), []).append((float(acc), float(loss)))
    return {
        f"{gamma:g}": {
            "accuracy": fmean(a for a, _ in vals),
            "loss": fmean(loss for _, loss in vals),
            "clients": len(vals),
        }
        for gamma, vals in sorted(by_level.items(), reverse=True)
    }
