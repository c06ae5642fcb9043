"""Diagonal Fisher at the received weights, from per-example gradients.

FedFIbOS ranks position ``j`` by ``F_j^2 x_j^2`` where ``F`` is the client's
empirical diagonal Fisher *at the model it received*:

    F_j = (1/n) * sum_i (d loss(x_i, y_i; w) / d w_j)^2,   w = received weights * mask

The training loop's :class:`~common.training.loop.EffectiveFisher` squares *minibatch-mean*
gradients along the local SGD path instead (free, but a different quantity: the
square of a mean is not the mean of squares, and the weights move). This module
computes the defined quantity on a bounded number of examples, before the first
local step. Gradients are taken with respect to the *effective* tensors, so
positions outside the client's mask (value 0) get their Fisher too.

The model runs in ``eval`` mode: dropout is off (the estimate is of the weights received,
not of a random thinning of them), and norms that keep running statistics normalise with
them and are not updated. The static norms of this project's models keep none: in training
they normalise by the statistics of the minibatch. Here they normalise every example by the
statistics of the whole sample of examples, computed first and then held fixed
(:func:`sample_statistics`): an example's gradient then depends on that example only, as a
per-example gradient must, and on the same kind of statistics training uses. (Normalising each
example by its own statistics, a batch of one, would measure another function, and fails
where a feature map is 1x1, e.g. ResNet-18's last stage on 8x8 inputs.) Each example is its
own batch of one:

* on a CPU, one backward pass of plain autograd per example. It needs no tracing and no
  extra imports (``torch.func``'s first call imports ``torch._dynamo``, about 1.2 s in
  each fresh ClientApp process, which a deployment starts for every round), and one
  example's backward pass through ResNet-18 already keeps the cores busy (32 examples:
  1.4 s looped against 3.2 s through ``vmap``, 2 cores);
* on an accelerator, ``torch.func.vmap(grad(...))``: one vectorised pass per chunk of
  examples, the chunk bounded by bytes (one gradient of the whole model per example). A
  model whose forward pass branches on tensor values (``vmap_safe = False``: the Hugging
  Face wrapper) keeps the loop there too.

Both give the same estimate (tested against each other and against a float64 reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from numpy.typing import NDArray
from torch import nn
from torch.func import functional_call, grad, vmap

from common.data.arrays import ArrayDataset
from common.models.layout import ParamLayout
from common.training.loop import as_input, local_logits


def _static_norms(model: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    """BatchNorm modules that keep no running statistics (they normalise by the batch's)."""
    return [
        m
        for m in model.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is None
    ]


@contextmanager
def sample_statistics(
    model: nn.Module, params: dict[str, torch.Tensor], inputs: torch.Tensor
) -> Iterator[None]:
    """Hold every static norm at the statistics of ``inputs`` while the block runs (model in
    ``eval`` mode).

    One forward pass over the whole sample sets each norm's (biased) per-channel mean and
    variance of its input, layer by layer as a training step would normalise that batch; the
    norms then use them for any single example. Restored to static norms afterwards.

    Parameters
    ----------
    model : nn.Module
        The architecture, in ``eval`` mode.
    params : dict[str, torch.Tensor]
        The weights the statistics are computed at (as passed to ``functional_call``).
    inputs : torch.Tensor
        The sample, a batch in the model's input form.
    """
    norms = _static_norms(model)
    if not norms:
        yield
        return

    def capture(module: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        x = args[0]
        dims = [0, *range(2, x.dim())]
        module.running_mean = x.mean(dims).detach()
        module.running_var = x.var(dims, unbiased=False).detach()

    hooks = [m.register_forward_pre_hook(capture) for m in norms]
    try:
        with torch.no_grad():
            functional_call(model, {k: v.detach() for k, v in params.items()}, (inputs,))
    finally:
        for h in hooks:
            h.remove()
    try:
        yield
    finally:
        for m in norms:
            m.running_mean = None
            m.running_var = None


def example_indices(n: int, max_examples: int, seed: int) -> NDArray[np.int64]:
    """Which of ``n`` local examples the estimate uses: all when ``max_examples`` is 0 or ``>= n``.

    Parameters
    ----------
    n : int
        Local training examples.
    max_examples : int
        Bound on the examples used (0 = all).
    seed : int
        Seed of the draw (the round's minibatch seed, so reruns repeat it).
    """
    if max_examples <= 0 or max_examples >= n:
        return np.arange(n, dtype=np.int64)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_examples, replace=False)).astype(
        np.int64
    )


def per_example_fisher(
    model: nn.Module,
    layout: ParamLayout,
    params: NDArray[np.float32],
    mask: NDArray[np.bool_],
    data: ArrayDataset,
    indices: NDArray[np.int64],
    present: torch.Tensor | None,
    device: torch.device,
    chunk: int = 64,
    max_chunk_mib: float = 512.0,
    vectorise: bool | None = None,
    clip_norm: float | None = None,
) -> NDArray[np.float32]:
    """Mean squared per-example gradient of the loss at the effective weights ``params * mask``.

    Parameters
    ----------
    model : nn.Module
        An instance of the architecture (its parameters are not modified; buffers are read).
    layout : ParamLayout
        Flat layout of the model's trainable tensors.
    params : NDArray[float32]
        Received flat parameters.
    mask : NDArray[bool]
        Positions the client holds; the others enter the forward pass as 0.
    data : ArrayDataset
        Local training split.
    indices : NDArray[int64]
        Examples to use (e.g. :func:`example_indices`); must not be empty.
    present : torch.Tensor, optional
        Classes present locally (label masking: absent classes' logits are 0), or ``None``.
    device : torch.device
        Where to compute.
    chunk : int
        Most examples per vectorised pass.
    max_chunk_mib : float
        Bound on the per-example gradients of one vectorised pass, in MiB (``4 d`` bytes an
        example): ResNet-18 (11.2 M weights) takes 11 examples a pass at the default, the CNN the
        whole ``chunk``.
    vectorise : bool, optional
        ``True``: ``vmap`` over chunks; ``False``: one autograd backward pass per example; ``None``
        (default): ``vmap`` on an accelerator for models that allow it, the loop otherwise.
    clip_norm : float, optional
        Each example's gradient (over every tensor together) is scaled down to this L2 norm before
        it is squared, so one example adds at most ``clip_norm ** 2`` to the sum (differential
        privacy, :mod:`common.privacy.mechanism`); ``None``: unclipped.

    Returns
    -------
    NDArray[float32]
        Flat diagonal Fisher in layout order, length ``layout.size``.
    """
    _check_arguments(indices, clip_norm)
    run = _to_device(model, layout, params, mask, data, indices, device)
    return _estimate(run, layout, present, chunk, max_chunk_mib, vectorise, clip_norm)


def _check_arguments(indices: NDArray[np.int64], clip_norm: float | None) -> None:
    """Raise ``ValueError`` for arguments :func:`per_example_fisher` cannot estimate with.

    Parameters
    ----------
    indices : NDArray[int64]
        Examples to use; must not be empty.
    clip_norm : float, optional
        Bound on each example's gradient norm; must be ``> 0`` when given.
    """
    if len(indices) == 0:
        raise ValueError("no examples to estimate the Fisher on")
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm={clip_norm!r} must be > 0")


class _OnDevice(NamedTuple):
    """What :func:`per_example_fisher` computes with, on its device.

    Parameters
    ----------
    model : nn.Module
        The architecture, moved to ``device``.
    tensors : dict[str, torch.Tensor]
        The effective weights ``params * mask`` by tensor name.
    sums : dict[str, torch.Tensor]
        The sums of squared gradients by tensor name, zero at first.
    x, y : torch.Tensor
        The examples used and their labels.
    device : torch.device
        Where to compute.
    """

    model: nn.Module
    tensors: dict[str, torch.Tensor]
    sums: dict[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    device: torch.device


def _to_device(
    model: nn.Module,
    layout: ParamLayout,
    params: NDArray[np.float32],
    mask: NDArray[np.bool_],
    data: ArrayDataset,
    indices: NDArray[np.int64],
    device: torch.device,
) -> _OnDevice:
    """The model, effective weights, zeroed sums and examples of an estimate, on ``device``.

    Parameters
    ----------
    model, layout, params, mask, data, indices, device
        As for :func:`per_example_fisher`.
    """
    model = model.to(device)
    effective = layout.unflatten(np.where(mask, params, 0).astype(np.float32))
    tensors = {}
    for name in layout.names:
        tensors[name] = torch.from_numpy(np.ascontiguousarray(effective[name])).to(device)
    sums = {name: torch.zeros_like(t) for name, t in tensors.items()}
    x_all = torch.from_numpy(data.x[indices]).to(device)
    y_all = torch.from_numpy(data.y[indices]).to(device)
    return _OnDevice(model, tensors, sums, x_all, y_all, device)


def _vectorised(model: nn.Module, device: torch.device, vectorise: bool | None) -> bool:
    """Whether the estimate runs through ``vmap``: ``vectorise``, or its default when ``None``.

    Parameters
    ----------
    model : nn.Module
        The architecture (``vmap_safe = False``: its forward pass cannot be vectorised).
    device : torch.device
        Where to compute (the default vectorises on an accelerator only).
    vectorise : bool, optional
        As for :func:`per_example_fisher`; ``ValueError`` when ``True`` for a model that forbids it.
    """
    vmap_safe = getattr(model, "vmap_safe", True)
    if vectorise is None:
        vectorise = device.type != "cpu" and vmap_safe
    elif vectorise and not vmap_safe:
        raise ValueError(
            f"{type(model).__name__} cannot be vectorised with vmap (vmap_safe = False)"
        )
    return vectorise


def _estimate(
    run: _OnDevice,
    layout: ParamLayout,
    present: torch.Tensor | None,
    chunk: int,
    max_chunk_mib: float,
    vectorise: bool | None,
    clip_norm: float | None,
) -> NDArray[np.float32]:
    """:func:`per_example_fisher`'s estimate, in ``eval`` mode at the sample's statistics.

    The model's training mode is restored afterwards (not when ``vectorise`` is refused).

    Parameters
    ----------
    run : _OnDevice
        The model, weights, sums and examples, on the device (:func:`_to_device`).
    layout, present, chunk, max_chunk_mib, vectorise, clip_norm
        As for :func:`per_example_fisher`.
    """
    model, tensors, sums, x_all, y_all, device = run

    def loss_one(p: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, p, (xi.unsqueeze(0),))
        return F.cross_entropy(local_logits(out, present), yi.unsqueeze(0))

    was_training = model.training
    model.eval()
    vectorise = _vectorised(model, device, vectorise)
    try:
        with sample_statistics(model, tensors, as_input(x_all)):
            _accumulate(
                model,
                layout,
                tensors,
                sums,
                x_all,
                y_all,
                loss_one,
                vectorise,
                chunk,
                max_chunk_mib,
                clip_norm,
            )
    finally:
        model.train(was_training)
    n = float(len(x_all))  # one row per example of indices
    return layout.flatten({name: (s / n).cpu().numpy() for name, s in sums.items()}).astype(
        np.float32
    )


def _accumulate(
    model: nn.Module,
    layout: ParamLayout,
    tensors: dict[str, torch.Tensor],
    sums: dict[str, torch.Tensor],
    x_all: torch.Tensor,
    y_all: torch.Tensor,
    loss_one: Callable[[dict[str, torch.Tensor], torch.Tensor, torch.Tensor], torch.Tensor],
    vectorise: bool,
    chunk: int,
    max_chunk_mib: float,
    clip_norm: float | None = None,
) -> None:
    """Add every example's squared gradient (clipped to ``clip_norm`` first) to ``sums`` (vectorised
    by chunks, or one backward pass each)."""
    if vectorise:
        per_example = vmap(grad(loss_one), in_dims=(None, 0, 0))
        # A chunk holds one gradient of the whole model per example: bound it by bytes, not only by
        # count.
        per_chunk = max(1, min(chunk, int(max_chunk_mib * 2**20) // (4 * layout.size)))
        for start in range(0, len(x_all), per_chunk):
            g = per_example(
                tensors,
                as_input(x_all[start : start + per_chunk]),
                y_all[start : start + per_chunk],
            )
            scale = _clip_scales({name: g[name].flatten(1) for name in sums}, clip_norm)
            for name in sums:
                sq = g[name].square()
                if scale is not None:
                    sq = sq * scale.square().reshape(-1, *([1] * (sq.dim() - 1)))
                sums[name].add_(sq.sum(0))
    else:
        leaves = {name: t.requires_grad_(True) for name, t in tensors.items()}
        for i in range(len(x_all)):
            grads = torch.autograd.grad(
                loss_one(leaves, as_input(x_all[i]), y_all[i]), list(leaves.values())
            )
            scale = _clip_scales(
                {name: g.reshape(1, -1) for name, g in zip(leaves, grads, strict=True)}, clip_norm
            )
            for name, g in zip(leaves, grads, strict=True):
                sums[name].add_(g.square() if scale is None else g.square() * scale[0].square())


def _clip_scales(rows: dict[str, torch.Tensor], clip_norm: float | None) -> torch.Tensor | None:
    """Per-example factors ``min(1, clip_norm / ||g_i||)`` of gradients given as ``(examples, -1)``
    rows per tensor.

    ``None`` when there is no bound. The norm is over every tensor together, accumulated in float64.
    """
    if clip_norm is None:
        return None
    norms = torch.stack([r.double().square().sum(1) for r in rows.values()]).sum(0).sqrt()
    return (clip_norm / norms.clamp_min(1e-300)).clamp(max=1.0).to(next(iter(rows.values())).dtype)
