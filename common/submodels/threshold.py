"""FIARSE's threshold masks: one magnitude threshold per submodel, the mask re-evaluated at every
step.

A client of capacity ``gamma`` holds every position ``j`` of a *gated* tensor (the weights and
biases of convolutions, linear layers and embeddings) with ``|x_j| >= theta``, where ``theta`` is
the ``k``-th largest magnitude over all gated positions and ``k = max(1, floor(gamma * n_gated))``;
normalisation layers are never gated and are held in full (:func:`threshold_for`,
:func:`threshold_mask`).

During local training the mask is not frozen: every forward pass uses
``w * 1[|w| >= theta]`` with the round's ``theta``, so a held weight that shrinks below the
threshold leaves the submodel inside the round (:class:`ThresholdGate`). Two readings of the
indicator's gradient:

* **the published code's** (the default): the indicator is a constant, so a held weight gets the
  plain masked gradient ``1[|w| >= theta] * g``. The published ``Bern`` function returns the bool
  tensor ``scores >= threshold``; autograd marks a bool output as not differentiable, so its custom
  backward is never called and only the product ``w * mask`` carries a gradient;
* **the paper's text** (``surrogate=True``): the indicator's gradient is replaced by the surrogate
  ``d 1[s >= theta] / ds = 2 theta / (s + theta)^2`` on the positions above the threshold (zero
  elsewhere), with ``s = |w|`` (:class:`ThresholdIndicator`), so the gradient that reaches a held
  weight is ``1 + 2 theta |w| / (|w| + theta)^2`` times the gradient of the effective weight
  (:func:`surrogate_factor`): weights near the threshold are pushed harder.

Either way, positions below the threshold get no gradient at all, so the submodel can only shrink
within a round; the server's next threshold decides what re-enters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn
from torch.nn.utils import parametrize

from common.models.layout import ParamLayout

#: Module types whose parameters the threshold gates (normalisation layers are held in full).
GATED_MODULES: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.Linear,
    nn.Embedding,
    nn.EmbeddingBag,
)


def gated_names(model: nn.Module) -> set[str]:
    """Names of the trainable parameters the threshold gates: those of convolutions, linear layers,
    embeddings.

    Parameters
    ----------
    model : nn.Module
        The architecture (may live on the ``meta`` device: only module types and names are read).
    """
    out = set()
    for module_name, module in model.named_modules():
        if isinstance(module, GATED_MODULES):
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad:
                    out.add(f"{module_name}.{name}" if module_name else name)
    return out


def gated_positions(layout: ParamLayout, names: Iterable[str]) -> NDArray[np.bool_]:
    """Flat positions (length ``d``) that belong to the tensors in ``names``.

    Raises ``ValueError`` naming a tensor that is not in the layout.
    """
    names = set(names)
    unknown = names - set(layout.names)
    if unknown:
        raise ValueError(f"gated tensors {sorted(unknown)} are not in the model's layout")
    out = np.zeros(layout.size, dtype=bool)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if t.name in names:
            out[start : start + t.size] = True
    return out


def gated_count(gamma: float, n_gated: int) -> int:
    """Gated positions a capacity-``gamma`` submodel keeps before ties: ``max(1, floor(gamma *
    n_gated))``.

    Parameters
    ----------
    gamma : float
        Capacity, the fraction of the gated parameters held, in (0, 1].
    n_gated : int
        Number of gated positions (>= 1).
    """
    if not (0.0 < gamma <= 1.0) or math.isnan(gamma):
        raise ValueError(f"capacity gamma must be in (0, 1], got {gamma}")
    if n_gated < 1:
        raise ValueError("the model has no gated (convolution, linear or embedding) parameters")
    return min(n_gated, max(1, int(gamma * n_gated)))


def threshold_for(x: NDArray, gated: NDArray[np.bool_], gamma: float) -> float:
    """The threshold ``theta`` of a capacity-``gamma`` submodel: the ``k``-th largest ``|x_j|`` over
    gated ``j``.

    Parameters
    ----------
    x : NDArray
        Global parameters, flat, length ``d``.
    gated : NDArray[bool]
        Gated positions (:func:`gated_positions`).
    gamma : float
        Capacity in (0, 1]; ``k = max(1, floor(gamma * n_gated))`` (:func:`gated_count`).
    """
    x = np.asarray(x)
    if x.shape != gated.shape:
        raise ValueError(f"x has shape {x.shape}, gated positions {gated.shape}")
    scores = np.abs(x[gated].astype(np.float32))
    k = gated_count(gamma, scores.size)
    return float(np.partition(scores, scores.size - k)[scores.size - k])


def threshold_mask(x: NDArray, gated: NDArray[np.bool_], theta: float) -> NDArray[np.bool_]:
    """Held positions: every ungated one, and the gated ones with ``|x_j| >= theta``."""
    x = np.asarray(x)
    if x.shape != gated.shape:
        raise ValueError(f"x has shape {x.shape}, gated positions {gated.shape}")
    return ~gated | (np.abs(x.astype(np.float32)) >= np.float32(theta))


def received_threshold(values: NDArray, gated: NDArray[np.bool_], mask: NDArray[np.bool_]) -> float:
    """The ``theta`` a download was cut at: the smallest ``|x_j|`` over the held gated positions.

    Exact for a :func:`threshold_mask` download (``theta`` is itself one of the held magnitudes), so
    the threshold needs no field of its own on the wire.

    Parameters
    ----------
    values : NDArray
        The received dense parameters (zero outside ``mask``), flat.
    gated : NDArray[bool]
        Gated positions of this architecture.
    mask : NDArray[bool]
        Positions received.
    """
    held = np.asarray(values)[gated & mask]
    if held.size == 0:
        raise ValueError("the download holds no gated parameter, so it has no threshold")
    return float(np.abs(held.astype(np.float32)).min())


class ThresholdIndicator(torch.autograd.Function):
    """``1[s >= theta]`` forward; backward ``grad * 2 theta / (s + theta)^2`` where ``s >= theta``,
    else 0.

    The paper's surrogate. Unlike the published ``Bern``, the forward returns the indicator as a
    float tensor, so autograd does call this backward.
    """

    @staticmethod
    def forward(ctx, scores: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """The indicator, in the dtype of ``scores``."""
        ctx.save_for_backward(scores, theta)
        return (scores >= theta).to(scores.dtype)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        """The surrogate gradient with respect to ``scores`` (none for ``theta``)."""
        scores, theta = ctx.saved_tensors
        # theta = 0 and s = 0 give 0/0: no surrogate there (as the published code's nan_to_num).
        grad = torch.nan_to_num(
            2 * theta / (scores + theta).square(), nan=0.0, posinf=0.0, neginf=0.0
        )
        return grad_output * grad * (scores >= theta), None


def surrogate_factor(w: NDArray, theta: float) -> NDArray[np.float64]:
    """Closed form of ``d (w 1[|w| >= theta]) / dw`` under the surrogate.

    It is ``1[|w| >= theta] (1 + 2 theta |w| / (|w| + theta)^2)``: the effective weight's own
    gradient plus ``|w|`` times the indicator's surrogate derivative.
    """
    a = np.abs(np.asarray(w, dtype=np.float64))
    with np.errstate(divide="ignore", invalid="ignore"):
        extra = np.nan_to_num(2 * theta * a / (a + theta) ** 2, nan=0.0, posinf=0.0, neginf=0.0)
    return (a >= theta) * (1.0 + extra)


class ThresholdGate(nn.Module):
    """Parametrisation ``w -> w * 1[|w| >= theta]``, re-evaluated at every forward pass.

    Parameters
    ----------
    theta : float
        The round's threshold (absolute weight value).
    surrogate : bool
        Backpropagate through the indicator with :class:`ThresholdIndicator`'s surrogate (the
        paper's text); ``False`` (the published code) treats the indicator as a constant, so a held
        position gets the effective weight's gradient and the others none.
    """

    def __init__(self, theta: float, surrogate: bool = False) -> None:
        super().__init__()
        self.register_buffer("theta", torch.tensor(float(theta)))
        self.surrogate = surrogate

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        """The effective weight."""
        theta = self.theta.to(w.dtype)
        if self.surrogate:
            return w * ThresholdIndicator.apply(w.abs(), theta)
        return w * (w.detach().abs() >= theta).to(w.dtype)


def attach_threshold_gates(
    model: nn.Module, names: Iterable[str], theta: float, surrogate: bool = False
) -> list[tuple[nn.Module, str]]:
    """Gate every parameter in ``names`` with a :class:`ThresholdGate`; returns the gated ``(module,
    name)`` pairs.

    Parameters
    ----------
    model : nn.Module
        The model whose parameters are gated (in place).
    names : Iterable[str]
        Full names of the parameters to gate (:func:`gated_names`).
    theta : float
        The round's threshold.
    surrogate : bool
        Train through the indicator's surrogate gradient (the paper's text) instead of the plain
        masked gradient (the published code, the default); see :class:`ThresholdGate`.
    """
    modules = dict(model.named_modules())
    gated = []
    for full in sorted(names):
        module_name, _, tensor_name = full.rpartition(".")
        module = modules[module_name]
        parametrize.register_parametrization(module, tensor_name, ThresholdGate(theta, surrogate))
        gated.append((module, tensor_name))
    return gated


def detach_threshold_gates(gated: Iterable[tuple[nn.Module, str]]) -> None:
    """Remove the gates, leaving the raw (ungated) weights as the modules' parameters."""
    for module, tensor_name in gated:
        parametrize.remove_parametrizations(module, tensor_name, leave_parametrized=False)
