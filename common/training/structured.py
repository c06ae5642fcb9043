"""Local training of a physically smaller model (CA-HFP's channel-sliced submodel): every weight
trained, no mask.

The same loop as a masked submodel (:func:`common.training.loop.train_loop`), with the gradient
moments of every weight gathered along it (:class:`common.training.accumulators.GradientMoments`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.data.arrays import ArrayDataset
from common.training.accumulators import GradientMoments
from common.training.loop import TrainConfig, train_loop


@dataclass(frozen=True)
class SmallTrainResult:
    """Outcome of :func:`train_small`.

    Parameters
    ----------
    params : dict[str, NDArray[float32]]
        Trained parameters by name, in the small shapes.
    grad_mean : dict[str, NDArray[float32]]
        Mean minibatch gradient of the loss over the counted steps, same shapes.
    fisher : dict[str, NDArray[float32]]
        Mean squared minibatch gradient (diagonal empirical Fisher), same shapes.
    loss : float
        Mean training loss over all steps.
    num_examples : int
        Training examples used (per epoch).
    train_seconds : float
        Wall-clock seconds of the whole local training, statistics included.
    stats_seconds : float
        Seconds spent accumulating ``grad_mean`` and ``fisher`` (the overhead).
    """

    params: dict[str, NDArray[np.float32]]
    grad_mean: dict[str, NDArray[np.float32]]
    fisher: dict[str, NDArray[np.float32]]
    loss: float
    num_examples: int
    train_seconds: float
    stats_seconds: float


def train_small(
    model: nn.Module, data: ArrayDataset, cfg: TrainConfig, device: torch.device
) -> SmallTrainResult:
    """Train a physically small model (already holding the received weights) and its gradient
    moments.

    Parameters
    ----------
    model : nn.Module
        The small model (:func:`common.models.structured.build_structured_model`); trained in place.
    data : ArrayDataset
        Local training split.
    cfg : TrainConfig
        Hyper-parameters; ``fisher_batches`` limits the steps whose gradients enter the statistics.
    device : torch.device
        Where to train.
    """
    start = time.perf_counter()
    model.to(device)
    moments = GradientMoments(model)
    result = train_loop(model, data, cfg, device, [moments])
    return SmallTrainResult(
        params={n: p.detach().cpu().numpy().astype(np.float32) for n, p in moments.named},
        grad_mean=moments.grad_mean(),
        fisher=moments.fisher(),
        loss=result.loss,
        num_examples=result.num_examples,
        train_seconds=time.perf_counter() - start,
        stats_seconds=result.stats_seconds,
    )
