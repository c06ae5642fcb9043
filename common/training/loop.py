"""The one local training loop every method uses, with pluggable statistics accumulators.

SGD (with momentum) or AdamW, with weight decay and an optional FedProx term, over the local split,
minibatch order seeded per run, round and partition. A method adds what its server needs as
:class:`Accumulator` objects (:mod:`common.training.accumulators`); a masked submodel is gated with
``torch.nn.utils.prune`` (:func:`train_masked`), a physically smaller one trains whole
(:mod:`common.training.structured`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.nn.utils import prune

from common.data.arrays import ArrayDataset
from common.models.architectures import load_flat
from common.models.layout import ParamLayout
from common.privacy.private_sgd import private_gradient
from common.training.accumulators import EffectiveFisher, effective_tensors
from common.training.meta_learning import first_order_maml_backward
from common.training.optimizers import make_optimizer

if TYPE_CHECKING:
    from common.config.node import NodeConfig
    from common.config.run import RunConfig


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
        Optimiser settings (``momentum``: SGD only).
    proximal_mu : float
        FedProx coefficient of ``mu/2 * ||w - w_received||^2`` (0 = off).
    label_mask : bool
        Set the logits of classes absent from the local data to 0 before the loss.
    fisher_batches : int
        Training steps whose gradients the accumulators see (0 = all).
    seed : int
        Seed of the minibatch order.
    optimizer : {"sgd", "adamw"}
        The optimiser (:func:`common.training.optimizers.make_optimizer`), created afresh for this
        round.
    clip_grad_norm : float
        Largest L2 norm of a step's gradient over all trained parameters; larger gradients are
        scaled down to it (``torch.nn.utils.clip_grad_norm_``, as HeteroFL's and FedRolex's local
        training does with 1). 0 = no clipping.
    dp_grad_clip : float
        Differential privacy (``dp-epsilon``): each example's gradient is clipped to this L2 norm
        and the step takes the noised mean (:func:`common.privacy.private_sgd.private_gradient`). 0
        = off.
    dp_noise_multiplier : float
        The noise's standard deviation in units of ``dp_grad_clip`` (with ``dp_grad_clip > 0``); the
        Fisher measured for the same reply is noised with it too.
    meta_inner_lr : float
        ``meta-learning = "fomaml"``: every step is a first-order MAML step with this inner step
        size (:func:`common.training.meta_learning.first_order_maml_backward`). 0 = plain steps.
    meta_inner_steps : int
        Inner steps of each meta step.
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
    clip_grad_norm: float = 0.0
    optimizer: str = "sgd"
    dp_grad_clip: float = 0.0
    dp_noise_multiplier: float = 0.0
    meta_inner_lr: float = 0.0
    meta_inner_steps: int = 1


def round_train_config(run: RunConfig, node: NodeConfig, server_round: int) -> TrainConfig:
    """A round's local training settings: the run's optimiser keys and a minibatch-order seed.

    The seed depends on the run's seed, the round and the node's partition only, so every method
    sees the same minibatch order and a resumed run repeats it exactly. Round 0 is the Fisher
    warm-up (``fisher-warmup``): no local step, only the Fisher at the received weights.
    """
    return TrainConfig(
        epochs=run.local_epochs if server_round > 0 else 0,
        batch_size=run.batch_size,
        lr=run.lr,
        momentum=run.momentum,
        weight_decay=run.weight_decay,
        proximal_mu=run.proximal_mu,
        label_mask=run.label_mask,
        fisher_batches=run.options("fisher").batches,
        seed=run.seed * 100_003 + server_round * 1009 + node.stream,
        clip_grad_norm=run.clip_grad_norm,
        optimizer=run.optimizer,
        meta_inner_lr=run.meta_inner_lr if run.meta_learning == "fomaml" else 0.0,
        meta_inner_steps=run.meta_inner_steps,
    )


class Accumulator(Protocol):
    """Statistics gathered from the gradients of the counted training steps."""

    def prepare(self, model: nn.Module) -> None:
        """After the forward pass, before ``backward``: e.g. keep the gradients of non-leaf
        tensors."""

    def accumulate(self, model: nn.Module) -> None:
        """After ``backward`` (under ``torch.no_grad``): add this step's statistics."""


@dataclass(frozen=True)
class LoopResult:
    """Outcome of :func:`train_loop`.

    Parameters
    ----------
    loss : float
        Mean training loss over all steps.
    num_examples : int
        Training examples (per epoch).
    stats_seconds : float
        Seconds spent in the accumulators (the overhead of the statistics).
    """

    loss: float
    num_examples: int
    stats_seconds: float


def as_input(batch: torch.Tensor) -> torch.Tensor:
    """Model input from stored examples: uint8 images are scaled to [0, 1]."""
    return batch.float().div_(255.0) if batch.dtype == torch.uint8 else batch


def local_classes(labels: torch.Tensor, num_classes: int, enabled: bool) -> torch.Tensor | None:
    """The classes in the local training labels, for :func:`local_logits` (``None`` without label
    masking).

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
    """Logits the local loss sees: with label masking, those of classes absent from the local data
    are 0.

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


def train_loop(
    model: nn.Module,
    data: ArrayDataset,
    cfg: TrainConfig,
    device: torch.device,
    accumulators: Sequence[Accumulator] = (),
) -> LoopResult:
    """Train every parameter of ``model`` that requires a gradient, in place, on ``data``.

    Parameters
    ----------
    model : nn.Module
        The model, already holding the received weights (and any prune masks), on ``device``.
    data : ArrayDataset
        Local training split.
    cfg : TrainConfig
        Hyper-parameters.
    device : torch.device
        Where to train.
    accumulators : Sequence[Accumulator]
        Statistics to gather on the first ``cfg.fisher_batches`` steps (all with 0); none: no
        overhead.
    """
    if len(data) == 0:
        raise ValueError("no local training examples")
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    anchor = [p.detach().clone() for p in params] if cfg.proximal_mu > 0 else None
    opt = make_optimizer(params, cfg.optimizer, cfg.lr, cfg.momentum, cfg.weight_decay)
    x = torch.from_numpy(data.x).to(device)  # uint8 images stay compact until batched
    y = torch.from_numpy(data.y).to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    counted, steps, loss_sum, stats_seconds = 0, 0, 0.0, 0.0
    loss_fn = nn.CrossEntropyLoss()
    present = local_classes(y, data.num_classes, cfg.label_mask)
    noise = torch.Generator().manual_seed(cfg.seed + 1) if cfg.dp_grad_clip > 0 else None
    for _ in range(cfg.epochs):
        order = torch.randperm(len(data), generator=gen).to(device)
        for batch in order.split(cfg.batch_size):
            opt.zero_grad(set_to_none=True)
            xb, yb = x[batch], y[batch]
            if noise is not None:
                step_loss = _dp_step(model, loss_fn, xb, yb, present, params, cfg, noise)
            elif cfg.meta_inner_lr > 0:
                step_loss = _meta_step(model, loss_fn, xb, yb, present, cfg)
            else:
                step_loss, measured = _backward(
                    model, loss_fn, xb, yb, present, accumulators, cfg, counted
                )
                counted += int(measured >= 0)
                stats_seconds += max(measured, 0.0)
            _adjust_gradients(params, anchor, cfg, private=noise is not None)
            opt.step()
            loss_sum += step_loss
            steps += 1
    return LoopResult(loss_sum / max(steps, 1), len(data), stats_seconds)


def _meta_step(
    model: nn.Module,
    loss_fn: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    present: torch.Tensor | None,
    cfg: TrainConfig,
) -> float:
    """A first-order MAML step's gradient into ``.grad`` (``meta-learning``); returns the scoring
    half's loss."""
    return first_order_maml_backward(
        model,
        loss_fn,
        as_input(xb),
        yb,
        cfg.meta_inner_lr,
        cfg.meta_inner_steps,
        lambda out: local_logits(out, present),
    )


def _dp_step(
    model: nn.Module,
    loss_fn: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    present: torch.Tensor | None,
    params: list[nn.Parameter],
    cfg: TrainConfig,
    noise: torch.Generator,
) -> float:
    """Set ``params``' ``.grad`` by DP-SGD (per-example clipping, then noise); returns the loss.

    Parameters
    ----------
    model : nn.Module
        The model being trained.
    loss_fn : nn.Module
        The loss of logits and labels.
    xb, yb : torch.Tensor
        The minibatch's inputs and labels.
    present : torch.Tensor, optional
        :func:`local_classes` of the local labels (``None``: no label masking).
    params : list[nn.Parameter]
        The trained parameters.
    cfg : TrainConfig
        Hyper-parameters (``dp_grad_clip``, ``dp_noise_multiplier``).
    noise : torch.Generator
        The generator of the privacy noise.
    """
    # No accumulator sees these gradients: a Fisher along the path has no per-example bound.
    return private_gradient(
        params,
        _example_loss(model, loss_fn, xb, yb, present),
        len(xb),
        cfg.dp_grad_clip,
        cfg.dp_noise_multiplier,
        noise,
    )


def _adjust_gradients(
    params: list[nn.Parameter],
    anchor: list[torch.Tensor] | None,
    cfg: TrainConfig,
    private: bool,
) -> None:
    """Add the FedProx term to the step's gradients, then clip their norm, as ``cfg`` asks.

    Parameters
    ----------
    params : list[nn.Parameter]
        The trained parameters, holding the step's gradients.
    anchor : list[torch.Tensor] or None
        The received values of ``params`` (FedProx), or ``None`` without the proximal term.
    cfg : TrainConfig
        Hyper-parameters (``proximal_mu``, ``clip_grad_norm``).
    private : bool
        Whether the step was a DP-SGD step (its examples' gradients are clipped already).
    """
    if anchor is not None:
        with torch.no_grad():
            for p, p0 in zip(params, anchor):
                if p.grad is not None:
                    p.grad.add_(p - p0, alpha=cfg.proximal_mu)
    if cfg.clip_grad_norm > 0 and not private:  # a private step's examples are clipped already
        nn.utils.clip_grad_norm_(params, cfg.clip_grad_norm)


def _example_loss(
    model: nn.Module,
    loss_fn: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    present: torch.Tensor | None,
) -> Callable[[int], torch.Tensor]:
    """The loss of the ``i``-th example of a minibatch alone (a forward pass of one example)."""

    def loss_of(i: int) -> torch.Tensor:
        return loss_fn(local_logits(model(as_input(xb[i : i + 1])), present), yb[i : i + 1])

    return loss_of


def _backward(
    model: nn.Module,
    loss_fn: nn.Module,
    xb: torch.Tensor,
    yb: torch.Tensor,
    present: torch.Tensor | None,
    accumulators: Sequence[Accumulator],
    cfg: TrainConfig,
    counted: int,
) -> tuple[float, float]:
    """The minibatch's mean loss backward, the accumulators fed when the step counts; ``(loss,
    seconds)``.

    ``seconds`` is the accumulators' time, or -1 when the step was not counted.
    """
    out = model(as_input(xb))
    measure = bool(accumulators) and (cfg.fisher_batches == 0 or counted < cfg.fisher_batches)
    if measure:
        for acc in accumulators:
            acc.prepare(model)
    loss = loss_fn(local_logits(out, present), yb)
    loss.backward()
    if not measure:
        return float(loss.detach()), -1.0
    t0 = time.perf_counter()
    with torch.no_grad():
        for acc in accumulators:
            acc.accumulate(model)
    return float(loss.detach()), time.perf_counter() - t0


def attach_masks(
    model: nn.Module, layout: ParamLayout, mask: NDArray[np.bool_]
) -> list[tuple[nn.Module, str]]:
    """Gate every tensor that is not fully kept with ``prune.custom_from_mask``.

    The forward pass then uses ``weight_orig * mask`` and the gradient reaching ``weight_orig`` is
    zero outside the mask, so plain SGD trains exactly the selected parameters. Returns the gated
    ``(module, tensor_name)`` pairs.
    """
    gated = []
    modules = dict(model.named_modules())
    for name, m in layout.unflatten(mask).items():
        if m.all():
            continue
        module_name, _, tensor_name = name.rpartition(".")
        prune.custom_from_mask(
            modules[module_name], tensor_name, torch.from_numpy(np.ascontiguousarray(m))
        )
        gated.append((modules[module_name], tensor_name))
    return gated


@dataclass(frozen=True)
class TrainResult:
    """Outcome of :func:`train_masked`.

    Parameters
    ----------
    params : NDArray[float32]
        Trained flat parameters (zero outside the mask).
    fisher : NDArray[float32]
        Diagonal empirical Fisher of the effective weights, flat: mean over the counted minibatches
        of the squared gradient of the minibatch loss (zeros when not measured).
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


def train_masked(
    model: nn.Module,
    layout: ParamLayout,
    params: NDArray[np.float32],
    mask: NDArray[np.bool_],
    data: ArrayDataset,
    cfg: TrainConfig,
    device: torch.device,
    measure_fisher: bool = True,
) -> TrainResult:
    """Train the submodel ``params * mask`` on ``data`` (masks attached with ``prune``), estimating
    the Fisher.

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
    measure_fisher : bool
        Accumulate :class:`EffectiveFisher` (False: for methods whose server never reads it).
    """
    start = time.perf_counter()
    load_flat(model, layout, np.where(mask, params, 0).astype(np.float32))
    model.to(device)
    gated = attach_masks(model, layout, mask)
    fisher = EffectiveFisher(layout, device) if measure_fisher else None
    result = train_loop(model, data, cfg, device, [fisher] if fisher is not None else [])
    for module, tensor_name in gated:
        prune.remove(module, tensor_name)
    trained = np.concatenate(
        [p.detach().cpu().numpy().reshape(-1) for p in effective_tensors(model, layout)]
    )
    # The optimiser never moves unheld positions, but make "zero outside the mask" exact.
    trained = np.where(mask, trained, 0).astype(np.float32)
    return TrainResult(
        params=trained,
        fisher=fisher.mean() if fisher is not None else np.zeros(layout.size, dtype=np.float32),
        loss=result.loss,
        num_examples=result.num_examples,
        train_seconds=time.perf_counter() - start,
        fisher_seconds=result.stats_seconds,
    )
