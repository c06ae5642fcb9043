"""Central evaluation of the global model and of the submodel at each capacity level."""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from client.training import evaluate
from common.datasets import ArrayDataset
from common.layout import ParamLayout
from common.models import load_flat


class CentralEvaluator:
    """Evaluates flat parameter vectors on the server's held-out test set.

    Parameters
    ----------
    model : nn.Module
        An instance of the architecture (its weights are overwritten per call).
    layout : ParamLayout
        The model's layout.
    test : ArrayDataset
        The server's global test set.
    device : torch.device
        Where to evaluate.
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        test: ArrayDataset,
        device: torch.device,
    ) -> None:
        self.model = model
        self.layout = layout
        self.test = test
        self.device = device

    def __call__(self, flat: NDArray[np.float32], mask: NDArray[np.bool_] | None = None) -> tuple[float, float]:
        """``(loss, accuracy)`` of ``flat`` (restricted to ``mask`` when given)."""
        params = flat if mask is None else np.where(mask, flat, 0).astype(np.float32)
        load_flat(self.model, self.layout, params)
        return evaluate(self.model, self.test, self.device)
