"""Evaluation of a model on a labelled split, and the server's central evaluation of flat
vectors."""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.data.arrays import ArrayDataset
from common.models.architectures import load_flat
from common.models.layout import ParamLayout
from common.training.loop import as_input


@torch.no_grad()
def evaluate(
    model: nn.Module, data: ArrayDataset, device: torch.device, batch_size: int = 256
) -> tuple[float, float]:
    """Mean cross-entropy loss and accuracy of ``model`` on ``data``."""
    if len(data) == 0:
        raise ValueError("no evaluation examples")
    model.to(device).eval()
    loss_fn = nn.CrossEntropyLoss(reduction="sum")
    loss, correct = 0.0, 0
    for i in range(0, len(data), batch_size):
        xb = as_input(torch.from_numpy(data.x[i : i + batch_size]).to(device))
        yb = torch.from_numpy(data.y[i : i + batch_size]).to(device)
        out = model(xb)
        loss += float(loss_fn(out, yb))
        correct += int((out.argmax(1) == yb).sum())
    return loss / len(data), correct / len(data)


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
        self, model: nn.Module, layout: ParamLayout, test: ArrayDataset, device: torch.device
    ) -> None:
        self.model = model
        self.layout = layout
        self.test = test
        self.device = device

    def __call__(
        self, flat: NDArray[np.float32], mask: NDArray[np.bool_] | None = None
    ) -> tuple[float, float]:
        """``(loss, accuracy)`` of ``flat`` (restricted to ``mask`` when given)."""
        params = flat if mask is None else np.where(mask, flat, 0).astype(np.float32)
        load_flat(self.model, self.layout, params)
        return evaluate(self.model, self.test, self.device)
