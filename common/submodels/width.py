"""Width-based (channel) submodels: HeteroFL's static slice and FedRolex's rolling window.

Both keep, in every hidden layer, ``ceil(r * c)`` of its ``c`` output channels
(``r`` = the client's capacity), and the matching input columns of the next
layer; the image input channels and the classifier's outputs are always kept.
HeteroFL always keeps the first channels; FedRolex rolls the window by one
channel per round (as published, ``start = -(round - 1) mod c``: the first
round keeps the first channels, then the window moves down), so over rounds
every channel is trained by small clients too.

A width ratio ``r`` keeps about ``r^2`` of a hidden layer's weights. To compare
methods at the same parameter budget (as FIARSE's evaluation does), a client of
capacity ``gamma`` gets width ratio ``sqrt(gamma)`` (:func:`width_ratio`), so its
submodel holds roughly ``gamma * d`` parameters, like the element-wise rules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.models.layout import ParamLayout


@dataclass(frozen=True)
class TensorChannels:
    """Which channel group indexes a tensor's rows and columns.

    Parameters
    ----------
    out_group : str or None
        Group of the output dimension (dim 0); ``None`` = always fully kept.
    in_group : str or None
        Group of the input dimension (dim 1); ``None`` = always fully kept.
    in_repeat : int
        Consecutive input columns per input channel (e.g. 16 for a flattened 4x4 map).
    """

    out_group: str | None
    in_group: str | None = None
    in_repeat: int = 1


# The small CNN (common.models.architectures.SmallCNN): conv1 -> conv2 -> 4x4 pool, flatten -> fc1
# -> fc2.
SMALL_CNN_GRAPH: dict[str, TensorChannels] = {
    "conv1.weight": TensorChannels("conv1"),
    "conv1.bias": TensorChannels("conv1"),
    "conv2.weight": TensorChannels("conv2", "conv1"),
    "conv2.bias": TensorChannels("conv2"),
    "fc1.weight": TensorChannels("fc1", "conv2", 16),
    "fc1.bias": TensorChannels("fc1"),
    "fc2.weight": TensorChannels(None, "fc1"),
    "fc2.bias": TensorChannels(None),
}

# The small CNN with BatchNorm or GroupNorm (common.models.architectures.SmallBNCNN, SmallGNCNN):
# a norm's scale and shift belong to the channels of the convolution it normalises, so a width
# submodel keeps exactly its channels' norms.
SMALL_BN_CNN_GRAPH: dict[str, TensorChannels] = {
    **SMALL_CNN_GRAPH,
    "bn1.weight": TensorChannels("conv1"),
    "bn1.bias": TensorChannels("conv1"),
    "bn2.weight": TensorChannels("conv2"),
    "bn2.bias": TensorChannels("conv2"),
}


def resnet_graph(layout: ParamLayout) -> dict[str, TensorChannels]:
    """Channel graph of torchvision's ResNet (``common.models.architectures.resnet18_32x32``).

    Every tensor with ``c`` channels joins group ``c<c>``: a residual sum adds the
    block's output to its shortcut, so both must keep the same channels, and
    because kept windows depend only on ``(c, ratio, roll)``, equal-sized groups
    always agree (as in HeteroFL's and FedRolex's ResNets). The stem's input
    (image channels) and the classifier's outputs stay whole.
    """
    graph = {}
    for t in layout.tensors:
        if t.name == "conv1.weight":
            graph[t.name] = TensorChannels(f"c{t.shape[0]}")
        elif t.name.startswith("fc."):
            graph[t.name] = TensorChannels(None, f"c{t.shape[1]}" if len(t.shape) == 2 else None)
        elif len(t.shape) == 4:
            graph[t.name] = TensorChannels(f"c{t.shape[0]}", f"c{t.shape[1]}")
        else:
            graph[t.name] = TensorChannels(f"c{t.shape[0]}")
    return graph


WIDTH_MODELS: tuple[str, ...] = ("cnn-bn", "cnn-gn", "cnn", "resnet18")


def require_channel_graph(method: str, model: str) -> None:
    """``ValueError`` naming both keys when ``model`` has no channel graph (width and structured
    methods)."""
    if model not in WIDTH_MODELS:
        raise ValueError(
            f"method={method!r} needs a channel graph for model={model!r}; available for: "
            f"{', '.join(WIDTH_MODELS)}"
        )


def channel_graph(model: str, layout: ParamLayout) -> dict[str, TensorChannels]:
    """The channel graph of a model architecture (see ``common.models.architectures``)."""
    if model == "cnn":
        return SMALL_CNN_GRAPH
    if model in ("cnn-bn", "cnn-gn"):
        return SMALL_BN_CNN_GRAPH
    if model == "resnet18":
        return resnet_graph(layout)
    raise ValueError(
        f"no channel graph for model {model!r}; available for {', '.join(WIDTH_MODELS)}"
    )


def group_sizes(layout: ParamLayout, graph: Mapping[str, TensorChannels]) -> dict[str, int]:
    """Channels per group, read off the tensors' output dimensions."""
    sizes: dict[str, int] = {}
    for t in layout.tensors:
        spec = graph.get(t.name)
        if spec is None:
            raise ValueError(f"tensor {t.name!r} has no entry in the channel graph")
        if spec.out_group is not None:
            sizes[spec.out_group] = t.shape[0]
    return sizes


def width_ratio(gamma: float) -> float:
    """Width ratio whose submodel holds about a ``gamma`` share of the parameters."""
    if not 0 < gamma <= 1:
        raise ValueError(f"capacity gamma must be in (0, 1], got {gamma}")
    return math.sqrt(gamma)


def kept_channels(size: int, ratio: float, start: int = 0) -> NDArray[np.int64]:
    """``ceil(ratio * size)`` consecutive channels from ``start``, wrapping around."""
    if not 0 < ratio <= 1:
        raise ValueError(f"width ratio must be in (0, 1], got {ratio}")
    k = max(1, math.ceil(ratio * size))
    return (start + np.arange(k)) % size


def width_mask(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], ratio: float, roll: int = 0
) -> NDArray[np.bool_]:
    """Flat mask of a width-``ratio`` submodel whose channel windows start at ``roll mod c``.

    ``roll = 0`` is HeteroFL's static slice; FedRolex's published window of round ``t`` (from 0) is
    ``roll = -t`` (:meth:`common.methods.fedrolex.FedRolex.roll`).

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the full model.
    graph : Mapping[str, TensorChannels]
        Channel graph of the model.
    ratio : float
        Width ratio in (0, 1]: every group keeps ``ceil(ratio * c)`` channels.
    roll : int
        Start of every group's window, taken modulo the group's ``c`` (may be negative).
    """
    sizes = group_sizes(layout, graph)
    keep = {g: np.zeros(n, dtype=bool) for g, n in sizes.items()}
    for g, n in sizes.items():
        keep[g][kept_channels(n, ratio, roll % n)] = True
    return channel_mask(layout, graph, keep)


def channel_mask(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], keep: Mapping[str, NDArray[np.bool_]]
) -> NDArray[np.bool_]:
    """Flat mask of the submodel that keeps, in every group, the channels flagged in ``keep``.

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the full model.
    graph : Mapping[str, TensorChannels]
        Channel graph of the model.
    keep : Mapping[str, NDArray[bool]]
        Per group, one flag per channel (``True`` = kept).
    """
    parts = []
    for t in layout.tensors:
        spec = graph[t.name]
        rows = keep[spec.out_group] if spec.out_group else np.ones(t.shape[0], dtype=bool)
        if len(t.shape) == 1:
            parts.append(rows)
            continue
        cols = np.ones(t.shape[1], dtype=bool)
        if spec.in_group:
            cols = np.repeat(keep[spec.in_group], spec.in_repeat)
            if cols.size != t.shape[1]:
                raise ValueError(
                    f"tensor {t.name!r}: {t.shape[1]} inputs, graph implies {cols.size}"
                )
        inner = int(np.prod(t.shape[2:], dtype=np.int64))
        parts.append(np.repeat(np.outer(rows, cols), inner, axis=1).reshape(-1))
    return np.concatenate(parts)


def held_width(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], mask: NDArray[np.bool_]
) -> float:
    """The width rate of a channel submodel: the smallest share of kept channels over the groups.

    A client derives its scaler rate (:func:`common.models.architectures.set_scaler_rate`) from the
    mask it was sent, so the rate can never disagree with the submodel. For :func:`width_mask` of
    ratio ``r`` this is ``min_g ceil(r c_g) / c_g``: exactly ``r`` whenever every ``r c_g`` is whole
    (the benchmark's capacities 1, 1/4, 1/16, 1/64 on the CNNs and ResNet-18), otherwise above ``r``
    by less than ``1 / c_g``.

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the full model.
    graph : Mapping[str, TensorChannels]
        Channel graph of the model.
    mask : NDArray[bool]
        Flat mask of the submodel (held positions).
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.shape != (layout.size,):
        raise ValueError(f"mask has shape {mask.shape}, expected ({layout.size},)")
    shares = {}
    for t, m in zip(layout.tensors, layout.unflatten(mask).values()):
        g = graph[t.name].out_group
        if g is not None and g not in shares:
            shares[g] = np.count_nonzero(m.reshape(t.shape[0], -1).any(axis=1)) / t.shape[0]
    if not shares:
        raise ValueError("the channel graph has no channel groups")
    rate = min(shares.values())
    if rate == 0:
        raise ValueError("the mask keeps no channel of some group")
    return float(rate)
