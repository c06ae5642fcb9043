"""Masked local training with the diagonal Fisher estimated from the same gradients.

The submodel mask is attached to the model with ``torch.nn.utils.prune``
(``weight_orig`` + ``weight_mask`` next to each gated tensor), so the forward pass
uses ``weight_orig * mask`` and the gradient reaching ``weight_orig`` is zero
outside the mask: plain SGD then trains exactly the selected parameters.

The Fisher estimate reuses the training steps' gradients with respect to the
*effective* (masked) weights, which are defined at the zeroed positions too, so
the client also measures the Fisher of parameters it does not hold
(DESIGN.md section 2). The extra cost is one squared accumulation per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.nn.utils import prune

from common.config import NodeConfig, RunConfig
from common.datasets import ArrayDataset
from common.layout import ParamLayout
from common.models import load_flat


@dataclass(frozen=True)
class TrainConfig:
    """Local training hyper-parameters.

    Parameters
    ----------
    epochs : int
        Passes over the local training split.
    batch_size : int
        Minibatch size (examples).
    lr, momentum, weight_decay : float
        SGD settings.
    proximal_mu : float
        FedProx coefficient of ``mu/2 * ||w - w_received||^2`` (0 = off).
    label_mask : bool
        Set the logits of classes absent from the local data to 0 before the loss.
    fisher_batches : int
        Training steps whose gradients enter the Fisher estimate (0 = all, -1 = none: for methods
        that never read it, so none is measured).
    seed : int
        Seed of the minibatch order.
    """

    epochs: int
    batch_size: int
    lr: float
    momentum: float = 0.0
    weight_decay: float = 0.0
    proximal_mu: float = 0.0
    label_mask: bool = False
    fisher_batches: int = 0
    seed: int = 0


def round_train_config(run: RunConfig, node: NodeConfig, server_round: int, fisher_batches: int) -> TrainConfig:
    """A round's local training settings: the run's optimiser keys and a minibatch-order seed.

    The seed depends on the run's seed, the round and the node's partition only, so every method
    (masked or structured) sees the same minibatch order and a resumed run repeats it exactly.
    """
    return TrainConfig(
        epochs=run.local_epochs,
        batch_size=run.batch_size,
        lr=run.lr,
        momentum=run.momentum,
        weight_decay=run.weight_decay,
        proximal_mu=run.proximal_mu,
        label_mask=run.label_mask,
        fisher_batches=fisher_batches,
        seed=run.seed * 100_003 + server_round * 1009 + node.partition_id,
    )


@dataclass(frozen=True)
class TrainResult:
    """Outcome of local training.

    Parameters
    ----------
    params : NDArray[float32]
        Trained flat parameters (zero outside the mask).
    fisher : NDArray[float32]
        Diagonal empirical Fisher, flat: mean over the counted minibatches of the
        squared gradient of the minibatch loss.
    loss : float
        Mean training loss over all steps.
    num_examples : int
        Training examples used (per epoch).
    train_seconds : float
        Wall-clock seconds of the whole local training, Fisher included.
    fisher_seconds : float
        Seconds spent on Fisher accumulation alone (the overhead).
    """

    params: NDArray[np.float32]
    fisher: NDArray[np.float32]
    loss: float
    num_examples: int
    train_seconds: float
    fisher_seconds: float


def as_input(batch: torch.Tensor) -> torch.Tensor:
    """Model input from stored examples: uint8 images are scaled to [0, 1]."""
    return batch.float().div_(255.0) if batch.dtype == torch.uint8 else batch


def attach_masks(model: nn.Module, layout: ParamLayout, mask: NDArray[np.bool_]) -> list[tuple[nn.Module, str]]:
    """Gate every tensor that is not fully kept with ``prune.custom_from_mask``.

    Returns the ``(module, tensor_name)`` pairs that were gated.
    """
    gated = []
    modules = dict(model.named_modules())
    for name, m in layout.unflatten(mask).items():
        if m.all():
            continue
        module_name, _, tensor_name = name.rpartition(".")
        module = modules[module_name]
        prune.custom_from_mask(module, tensor_name, torch.from_numpy(np.ascontiguousarray(m)))
        gated.append((module, tensor_name))
    return gated


def _effective(model: nn.Module, layout: ParamLayout) -> list[torch.Tensor]:
    """The tensors the forward pass used, in layout order (masked ones are non-leaf)."""
    modules = dict(model.named_modules())
    out = []
    for name in layout.names:
        module_name, _, tensor_name = name.rpartition(".")
        out.append(getattr(modules[module_name], tensor_name))
    return out


def local_classes(labels: torch.Tensor, num_classes: int, enabled: bool) -> torch.Tensor | None:
    """The classes in the local training labels, for :func:`local_logits` (``None`` without label masking).

    Parameters
    ----------
    labels : torch.Tensor
        All local training labels.
    num_classes : int
        Number of classes (the model's outputs).
    enabled : bool
        Whether to mask (``label-mask``).
    """
    if not enabled:
        return None
    return torch.bincount(labels, minlength=num_classes)[:num_classes] > 0


def local_logits(out: torch.Tensor, present: torch.Tensor | None) -> torch.Tensor:
    """Logits the local loss sees: with label masking, those of classes absent from the local data are 0.

    Without it, cross-entropy on a client that holds two classes pushes every other class's
    output down, and a class that only small submodels hold is trained toward "no" by every
    larger client that holds its classifier row. HeteroFL's and FedRolex's published code mask
    the same way (fill with 0, so absent classes get no gradient).

    Parameters
    ----------
    out : torch.Tensor
        Logits, shape ``(batch, classes)``.
    present : torch.Tensor, optional
        :func:`local_classes` of the client's labels; ``None`` leaves the logits as they are.
    """
    return out if present is None else out.masked_fill(~present, 0.0)


def train_masked(
    model: nn.Module,
    layout: ParamLayout,
    params: NDArray[np.float32],
    mask: NDArray[np.bool_],
    data: ArrayDataset,
    cfg: TrainConfig,
    device: torch.device,
) -> TrainResult:
    """Train the submodel ``params * mask`` on ``data`` and estimate the Fisher.

    Parameters
    ----------
    model : nn.Module
        An instance of the architecture (its weights are overwritten).
    layout : ParamLayout
        Flat layout of the model.
    params : NDArray[float32]
        Received flat parameters (zero outside the mask).
    mask : NDArray[bool]
        Positions this client holds and trains.
    data : ArrayDataset
        Local training split.
    cfg : TrainConfig
        Hyper-parameters.
    device : torch.device
        Where to train.
    """
    if len(data) == 0:
        raise ValueError("no local training examples")
    start = time.perf_counter()
    load_flat(model, layout, np.where(mask, params, 0).astype(np.float32))
    model.to(device).train()
    gated = attach_masks(model, layout, mask)
    leaf = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in leaf] if cfg.proximal_mu > 0 else None
    opt = torch.optim.SGD(leaf, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    x = torch.from_numpy(data.x).to(device)  # uint8 images stay compact until batched
    y = torch.from_numpy(data.y).to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    fisher = [torch.zeros(t.shape, device=device) for t in layout.tensors]
    counted, steps, loss_sum, fisher_seconds = 0, 0, 0.0, 0.0
    loss_fn = nn.CrossEntropyLoss()
    present = local_classes(y, data.num_classes, cfg.label_mask)
    for _ in range(cfg.epochs):
        order = torch.randperm(len(data), generator=gen).to(device)
        for batch in order.split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            out = model(as_input(x[batch]))
            effective = _effective(model, layout)
            measure = cfg.fisher_batches == 0 or 0 <= counted < cfg.fisher_batches
            if measure:
                for t in effective:
                    if not t.is_leaf:
                        t.retain_grad()
            loss = loss_fn(local_logits(out, present), y[batch])
            loss.backward()
            if measure:
                t0 = time.perf_counter()
                with torch.no_grad():
                    for acc, t in zip(fisher, effective):
                        if t.grad is not None:
                            acc.add_(t.grad.square())
                counted += 1
                fisher_seconds += time.perf_counter() - t0
            if anchor is not None:
                with torch.no_grad():
                    for p, p0 in zip(leaf, anchor):
                        if p.grad is not None:
                            p.grad.add_(p - p0, alpha=cfg.proximal_mu)
            opt.step()
            loss_sum += float(loss.detach())
            steps += 1
    for module, tensor_name in gated:
        prune.remove(module, tensor_name)
    trained = np.concatenate([p.detach().cpu().numpy().reshape(-1) for p in _effective(model, layout)])
    flat_fisher = np.concatenate([(f / max(counted, 1)).cpu().numpy().reshape(-1) for f in fisher])
    # The optimiser never moves unheld positions, but make "zero outside the mask" exact.
    trained = np.where(mask, trained, 0).astype(np.float32)
    return TrainResult(
        params=trained,
        fisher=flat_fisher.astype(np.float32),
        loss=loss_sum / max(steps, 1),
        num_examples=len(data),
        train_seconds=time.perf_counter() - start,
        fisher_seconds=fisher_seconds,
    )


@torch.no_grad()
def evaluate(model: nn.Module, data: ArrayDataset, device: torch.device, batch_size: int = 256) -> tuple[float, float]:
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
