"""Statistics a method gathers along local training: the accumulators the one loop takes.

They plug into :func:`common.training.loop.train_loop` as its
:class:`~common.training.loop.Accumulator` objects.

Each sees every counted step's gradients before the FedProx term is added (they describe the data
loss):

* :class:`EffectiveFisher`: the diagonal empirical Fisher of the *effective* weights of a model
  gated with ``torch.nn.utils.prune`` (``weight = weight_orig * weight_mask``). Their gradient is
  defined at the zeroed positions too, so a client also measures the Fisher of parameters it does
  not hold, at the cost of one squared accumulation per step (FedFIbOS, FedGMR's Fisher rule).
* :class:`GradientMoments`: the mean gradient ``g`` and the mean squared gradient ``h`` of every
  trained parameter (CA-HFP's curvature score, LoRA's Fisher allocation).
"""

from __future__ import annotations

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.models.layout import ParamLayout


def effective_tensors(model: nn.Module, layout: ParamLayout) -> list[torch.Tensor]:
    """The tensors the last forward pass used, in layout order (gated ones are non-leaf)."""
    modules = dict(model.named_modules())
    out = []
    for name in layout.names:
        module_name, _, tensor_name = name.rpartition(".")
        out.append(getattr(modules[module_name], tensor_name))
    return out


class EffectiveFisher:
    """Sum of squared gradients of the effective (masked) weights, flat in layout order.

    Parameters
    ----------
    layout : ParamLayout
        The model's flat layout.
    device : torch.device
        Where the sums live (the training device).
    """

    def __init__(self, layout: ParamLayout, device: torch.device) -> None:
        self.layout = layout
        self.sums = [torch.zeros(t.shape, device=device) for t in layout.tensors]
        self.counted = 0
        self._effective: list[torch.Tensor] = []

    def prepare(self, model: nn.Module) -> None:
        """Keep the gradients of the gated (non-leaf) effective tensors of this step."""
        self._effective = effective_tensors(model, self.layout)
        for t in self._effective:
            if not t.is_leaf:
                t.retain_grad()

    def accumulate(self, model: nn.Module) -> None:
        """Add this step's squared gradients."""
        for acc, t in zip(self.sums, self._effective):
            if t.grad is not None:
                acc.add_(t.grad.square())
        self.counted += 1

    def mean(self) -> NDArray[np.float32]:
        """The diagonal empirical Fisher: mean squared gradient over the counted steps (zeros if
        none)."""
        flat = [(f / max(self.counted, 1)).cpu().numpy().reshape(-1) for f in self.sums]
        return np.concatenate(flat).astype(np.float32)


class GradientMoments:
    """Sums of the gradient and of its square for every trained parameter of a model.

    Parameters
    ----------
    model : nn.Module
        The model being trained; statistics follow ``named_parameters()`` order.
    """

    def __init__(self, model: nn.Module) -> None:
        self.named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.g_sum = [torch.zeros_like(p) for _, p in self.named]
        self.h_sum = [torch.zeros_like(p) for _, p in self.named]
        self.counted = 0

    def prepare(self, model: nn.Module) -> None:
        """Nothing to prepare: leaf gradients are kept by autograd."""

    def accumulate(self, model: nn.Module) -> None:
        """Add this step's gradients and squared gradients."""
        for gs, hs, (_, p) in zip(self.g_sum, self.h_sum, self.named):
            if p.grad is not None:
                gs.add_(p.grad)
                hs.add_(p.grad.square())
        self.counted += 1

    def _numpy(self, tensors: list[torch.Tensor]) -> dict[str, NDArray[np.float32]]:
        scale = 1.0 / max(self.counted, 1)
        return {
            n: (t.detach() * scale).cpu().numpy().astype(np.float32)
            for (n, _), t in zip(self.named, tensors)
        }

    def grad_mean(self) -> dict[str, NDArray[np.float32]]:
        """Mean minibatch gradient over the counted steps, by parameter name."""
        return self._numpy(self.g_sum)

    def fisher(self) -> dict[str, NDArray[np.float32]]:
        """Mean squared minibatch gradient (diagonal empirical Fisher), by parameter name."""
        return self._numpy(self.h_sum)
