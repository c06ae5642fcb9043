"""FedAvg: every node trains the full model, whatever its capacity (the accuracy ceiling)."""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from common.methods.masked import MaskedMethod
from common.methods.specs.fedavg import FedAvgSpec


class FedAvg(FedAvgSpec, MaskedMethod):
    """The full model for everyone; the mask-aware mean is then plain FedAvg."""

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """Every position (``full``; its encoding costs nothing on the wire)."""
        return np.ones(self.layout.size, dtype=bool), "full"
