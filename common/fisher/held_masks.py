"""Each client's Fisher-ranked mask, held until the estimate it was ranked by changes.

With the Fisher measured at the global model every ``fisher-every`` rounds, a client keeps the
mask ranked by its latest estimate until the next estimate arrives: the submodel it trains stays
the same between refreshes instead of moving with every change of the global values. Masks are
stored as packed bits (``d / 8`` bytes a client) and serialised with the method's state, so a
resumed run holds the same masks as an uninterrupted one.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray


class HeldMasks:
    """Masks by client key, each stamped with the round of the estimate it was ranked by and its
    capacity.

    Parameters
    ----------
    d : int
        Length of every mask (the model's parameter count).
    """

    def __init__(self, d: int) -> None:
        self.d = d
        self._held: dict[str, tuple[int, float, NDArray[np.uint8]]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def get(self, key: str, estimate_round: int, gamma: float) -> NDArray[np.bool_] | None:
        """The held mask of ``key`` if it was ranked by the estimate of ``estimate_round`` at
        capacity ``gamma``."""
        held = self._held.get(key)
        if held is None or held[0] != estimate_round or held[1] != gamma:
            return None
        return np.unpackbits(held[2], count=self.d).view(
            np.bool_
        )  # a fresh array: unpacked, not copied again

    def packed(self, key: str) -> NDArray[np.uint8] | None:
        """The packed bits of ``key``'s held mask, whatever it was ranked by (``None``: none held);
        not a copy."""
        held = self._held.get(key)
        return None if held is None else held[2]

    def put(self, key: str, estimate_round: int, gamma: float, mask: NDArray[np.bool_]) -> None:
        """Hold ``mask`` for ``key`` until its estimate (measured in ``estimate_round``) or capacity
        changes."""
        if mask.shape != (self.d,):
            raise ValueError(f"mask has shape {mask.shape}, expected ({self.d},)")
        self._held[key] = (int(estimate_round), float(gamma), np.packbits(mask))

    def arrays(self) -> dict[str, NDArray]:
        """The held masks as named arrays (keys, stamps, packed bits), for a state archive."""
        keys = list(self._held)
        rows = [self._held[k][2] for k in keys]
        return {
            "held_d": np.array(self.d, dtype=np.int64),
            "held_keys": np.frombuffer(json.dumps(keys).encode(), dtype=np.uint8),
            "held_rounds": np.array([self._held[k][0] for k in keys], dtype=np.int64),
            "held_gammas": np.array([self._held[k][1] for k in keys], dtype=np.float64),
            "held_bits": np.stack(rows)
            if rows
            else np.zeros((0, (self.d + 7) // 8), dtype=np.uint8),
        }

    @classmethod
    def from_arrays(cls, z: Mapping[str, NDArray]) -> HeldMasks:
        """Restore :meth:`arrays` (e.g. from an opened npz)."""
        out = cls(int(z["held_d"]))
        keys = json.loads(np.asarray(z["held_keys"]).tobytes())
        for key, rnd, gamma, bits in zip(
            keys, z["held_rounds"], z["held_gammas"], z["held_bits"], strict=True
        ):
            out._held[str(key)] = (int(rnd), float(gamma), np.array(bits, dtype=np.uint8))
        return out
