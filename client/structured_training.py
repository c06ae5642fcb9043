"""Local training of a physically smaller (CA-HFP) model and its curvature statistics.

The small model holds only the kept channels, so plain SGD trains it with no
masks and every FLOP and byte of activation is spent on held channels. The same
training steps yield the statistics of the curvature-aware score
(:mod:`common.channel_scores`): the mean minibatch gradient ``g`` and the
diagonal empirical Fisher ``h`` (mean squared minibatch gradient) of every held
weight, taken before any FedProx term is added (they describe the data loss).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from client.training import TrainConfig, as_input, local_classes, local_logits
from common.datasets import ArrayDataset


@dataclass(frozen=True)
class StructuredTrainResult:
    """Outcome of training a small model.

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


def train_small(model: nn.Module, data: ArrayDataset, cfg: TrainConfig, device: torch.device) -> StructuredTrainResult:
    """Train ``model`` (already holding the received small weights) with SGD on ``data``.

    Parameters
    ----------
    model : nn.Module
        The small model (:func:`common.structured_models.build_structured_model`); trained in place.
    data : ArrayDataset
        Local training split.
    cfg : TrainConfig
        Hyper-parameters; ``fisher_batches`` limits the steps whose gradients enter
        the statistics (``<= 0``: every step; the score always needs them, so unlike
        masked training there is no "none").
    device : torch.device
        Where to train.
    """
    if len(data) == 0:
        raise ValueError("no local training examples")
    start = time.perf_counter()
    model.to(device).train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    anchor = [p.detach().clone() for p in params] if cfg.proximal_mu > 0 else None
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    x = torch.from_numpy(data.x).to(device)
    y = torch.from_numpy(data.y).to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    g_sum = [torch.zeros_like(p) for p in params]
    h_sum = [torch.zeros_like(p) for p in params]
    counted, steps, loss_sum, stats_seconds = 0, 0, 0.0, 0.0
    loss_fn = nn.CrossEntropyLoss()
    present = local_classes(y, data.num_classes, cfg.label_mask)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(data), generator=gen).to(device)
        for batch in order.split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(local_logits(model(as_input(x[batch])), present), y[batch])
            loss.backward()
            if cfg.fisher_batches <= 0 or counted < cfg.fisher_batches:
                t0 = time.perf_counter()
                with torch.no_grad():
                    for gs, hs, p in zip(g_sum, h_sum, params):
                        if p.grad is not None:
                            gs.add_(p.grad)
                            hs.add_(p.grad.square())
                counted += 1
                stats_seconds += time.perf_counter() - t0
            if anchor is not None:
                with torch.no_grad():
                    for p, p0 in zip(params, anchor):
                        if p.grad is not None:
                            p.grad.add_(p - p0, alpha=cfg.proximal_mu)
            opt.step()
            loss_sum += float(loss.detach())
            steps += 1

    def numpy(tensors: list[torch.Tensor], scale: float = 1.0) -> dict[str, NDArray[np.float32]]:
        return {n: (t.detach() * scale).cpu().numpy().astype(np.float32) for (n, _), t in zip(named, tensors)}

    return StructuredTrainResult(
        params=numpy(params),
        grad_mean=numpy(g_sum, 1.0 / max(counted, 1)),
        fisher=numpy(h_sum, 1.0 / max(counted, 1)),
        loss=loss_sum / max(steps, 1),
        num_examples=len(data),
        train_seconds=time.perf_counter() - start,
        stats_seconds=stats_seconds,
    )
