"""FIARSE's selection rule: each client holds the ``ceil(gamma d)`` largest-magnitude positions of ``x``."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from common.methods import register
from common.methods.masked import MaskedMethod
from common.selection import select_mask


@register
class FIARSE(MaskedMethod):
    """Magnitude top-k submodels (same guards as FedFIbOS)."""

    name = "fiarse"
    summary = "top-`ceil(gamma d)` of `|x_j|` (FIARSE's magnitude rule)"

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """Top-k of ``|x|`` (``magnitude``)."""
        return select_mask(self.layout, x, gamma, "magnitude", None, self.run.min_per_row), "magnitude"
