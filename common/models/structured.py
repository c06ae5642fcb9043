"""Physically smaller models: the same module tree with narrower Conv2d / BatchNorm2d / Linear
layers.

:func:`build_structured_model` takes a *skeleton* of the full architecture (it can
live on PyTorch's ``meta`` device, so a client never allocates the full model) and
the small model's parameter arrays (:func:`common.submodels.channel_slicing.slice_arrays`).
Every layer owning one of those parameters is replaced by a layer of the same
kind and hyper-parameters (kernel, stride, padding, bias, eps, ...) whose sizes
are read off the arrays, and the arrays are copied in. The forward code of the
architecture is untouched, so one builder serves every model with a channel
graph (SmallCNN, torchvision's ResNet-18).

Running statistics of a BatchNorm that tracks them are not part of the exchanged
parameters (the project's ResNet uses static BatchNorm); a rebuilt BatchNorm
starts with fresh statistics.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.models.layout import ParamLayout, TensorSpec


def skeleton_layout(model: nn.Module) -> ParamLayout:
    """Flat layout of a model's trainable parameters, read from shapes only (works on ``meta``)."""
    return ParamLayout(
        tuple(TensorSpec(n, tuple(p.shape)) for n, p in model.named_parameters() if p.requires_grad)
    )


def _narrow(module: nn.Module, weight: tuple[int, ...]) -> nn.Module:
    """A fresh layer like ``module`` whose weight has shape ``weight``."""
    bias = getattr(module, "bias", None) is not None
    if isinstance(module, nn.Conv2d):
        if module.groups != 1:
            raise ValueError(
                f"grouped convolution (groups={module.groups}) cannot be channel-sliced"
            )
        return nn.Conv2d(
            weight[1],
            weight[0],
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            bias=bias,
            padding_mode=module.padding_mode,
        )
    if isinstance(module, nn.Linear):
        return nn.Linear(weight[1], weight[0], bias=bias)
    if isinstance(module, nn.BatchNorm2d):
        return nn.BatchNorm2d(
            weight[0], module.eps, module.momentum, module.affine, module.track_running_stats
        )
    raise TypeError(
        f"cannot narrow a {type(module).__name__}; supported: Conv2d, Linear, BatchNorm2d"
    )


def build_structured_model(skeleton: nn.Module, arrays: Mapping[str, NDArray]) -> nn.Module:
    """The small model holding ``arrays`` (a new module; ``skeleton`` is not modified).

    Parameters
    ----------
    skeleton : nn.Module
        An instance of the full architecture; only its structure and layer
        hyper-parameters are read (a ``meta``-device instance is fine).
    arrays : Mapping[str, NDArray]
        Every trainable parameter of the small model by its full-model name, in
        the small shapes (float32).
    """
    names = [n for n, p in skeleton.named_parameters() if p.requires_grad]
    if set(names) != set(arrays):
        missing, extra = sorted(set(names) - set(arrays)), sorted(set(arrays) - set(names))
        raise ValueError(
            f"small model arrays differ from the architecture: missing {missing}, unexpected "
            f"{extra}"
        )
    owners = sorted({n.rpartition(".")[0] for n in names})
    small = copy.deepcopy(skeleton)
    modules = dict(small.named_modules())
    for owner in owners:
        if not owner or f"{owner}.weight" not in arrays:
            raise ValueError(
                f"parameters of {owner or 'the root module'!r} do not belong to a layer with a "
                "weight"
            )
        new = _narrow(modules[owner], tuple(np.asarray(arrays[f"{owner}.weight"]).shape))
        with torch.no_grad():
            for pname, param in new.named_parameters(recurse=False):
                full_name = f"{owner}.{pname}"
                value = torch.from_numpy(np.ascontiguousarray(arrays[full_name], dtype=np.float32))
                if value.shape != param.shape:
                    raise ValueError(
                        f"{full_name!r}: shape {tuple(value.shape)} does not fit "
                        f"{tuple(param.shape)}"
                    )
                param.copy_(value)
        parent_name, _, child = owner.rpartition(".")
        setattr(modules[parent_name], child, new)
    return small
