"""Full-shape arrays <-> the arrays of a physically smaller (channel-sliced) submodel.

A :data:`~common.submodels.channel_scores.ChannelSelection` keeps, per channel group, some
channels (indices in increasing order). The small model's tensor ``t`` is the full
tensor restricted to the kept output rows (``out_group``) and kept input columns
(``in_group``, ``in_repeat`` consecutive columns per channel); ungrouped dimensions
stay whole.

Because kept indices increase, the small tensors flattened in layout order list
exactly the full vector's held positions in increasing order: ``concat(small) ==
x[mask]`` with ``mask = selection_mask(...)``. That is what lets a small update be
placed back into the full parameter space (:func:`reconstruct`: the server's
reconstruction, missing channels taken from the current global model) and
aggregated mask-aware by :func:`common.aggregation.masked.aggregate_masked`.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from numpy.typing import NDArray

from common.models.layout import ParamLayout, TensorSpec
from common.submodels.channel_scores import ChannelSelection
from common.submodels.width import TensorChannels, channel_mask, group_sizes
from common.wire.mask_codec import index_dtype, mask_digest

CHANNELS = "submodel-channels"
CHANNELS_KIND = "channels"  # the "mask-kind" of a channel-sliced submodel


def check_selection(selection: Mapping[str, NDArray], sizes: Mapping[str, int]) -> ChannelSelection:
    """A validated copy of ``selection``; ``ValueError`` names the offending group.

    Every group of ``sizes`` must be present (and no other), with a non-empty 1-D
    integer array of strictly increasing indices below the group's size.
    """
    if set(selection) != set(sizes):
        raise ValueError(
            f"selection groups {sorted(selection)} differ from the model's {sorted(sizes)}"
        )
    out = {}
    for g, n in sizes.items():
        idx = np.asarray(selection[g])
        if idx.ndim != 1 or idx.size == 0 or not np.issubdtype(idx.dtype, np.integer):
            raise ValueError(f"group {g!r}: kept channels must be a non-empty 1-D integer array")
        idx = idx.astype(np.int64)
        if idx[0] < 0 or idx[-1] >= n or np.any(np.diff(idx) <= 0):
            raise ValueError(
                f"group {g!r}: kept channels must be strictly increasing and in [0, {n})"
            )
        out[g] = idx
    return out


def selection_mask(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], selection: ChannelSelection
) -> NDArray[np.bool_]:
    """Flat mask of the positions the small model holds."""
    sizes = group_sizes(layout, graph)
    selection = check_selection(selection, sizes)
    keep = {}
    for g, n in sizes.items():
        keep[g] = np.zeros(n, dtype=bool)
        keep[g][selection[g]] = True
    return channel_mask(layout, graph, keep)


def selection_of_mask(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], mask: NDArray[np.bool_]
) -> ChannelSelection:
    """The selection whose :func:`selection_mask` is ``mask``; ``ValueError`` if it is not a channel
    mask."""
    mask = np.asarray(mask, dtype=bool)
    selection: ChannelSelection = {}
    for t, m in zip(layout.tensors, layout.unflatten(mask).values()):
        g = graph[t.name].out_group
        if g is not None and g not in selection:
            selection[g] = np.flatnonzero(m.reshape(t.shape[0], -1).any(axis=1)).astype(np.int64)
    try:
        again = selection_mask(layout, graph, selection)
    except ValueError as err:
        raise ValueError(f"mask is not a channel submodel: {err}") from err
    if not np.array_equal(again, mask):
        raise ValueError("mask is not a channel submodel of this graph")
    return selection


def _indices(
    spec: TensorChannels, selection: ChannelSelection, shape: tuple[int, ...]
) -> tuple[NDArray, NDArray]:
    rows = selection[spec.out_group] if spec.out_group else np.arange(shape[0])
    if len(shape) < 2:
        return rows, np.zeros(0, dtype=np.int64)
    if spec.in_group:
        cols = (
            selection[spec.in_group][:, None] * spec.in_repeat + np.arange(spec.in_repeat)
        ).reshape(-1)
    else:
        cols = np.arange(shape[1])
    return rows, cols


def sliced_shapes(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], selection: ChannelSelection
) -> dict[str, tuple[int, ...]]:
    """Shape of every tensor of the small model, in layout order."""
    selection = check_selection(selection, group_sizes(layout, graph))
    out = {}
    for t in layout.tensors:
        rows, cols = _indices(graph[t.name], selection, t.shape)
        out[t.name] = (rows.size,) if len(t.shape) == 1 else (rows.size, cols.size, *t.shape[2:])
    return out


def sliced_layout(
    layout: ParamLayout, graph: Mapping[str, TensorChannels], selection: ChannelSelection
) -> ParamLayout:
    """Flat layout of the small model (full-model tensor names, small shapes, same order)."""
    return ParamLayout(
        tuple(TensorSpec(n, s) for n, s in sliced_shapes(layout, graph, selection).items())
    )


def slice_arrays(
    layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    selection: ChannelSelection,
    arrays: Mapping[str, NDArray],
) -> dict[str, NDArray]:
    """Restrict full-shape arrays (server -> client) to the small model's shapes.

    Parameters
    ----------
    layout : ParamLayout
        Full model layout.
    graph : Mapping[str, TensorChannels]
        Channel graph.
    selection : ChannelSelection
        Kept channels per group.
    arrays : Mapping[str, NDArray]
        Full-shape arrays by tensor name (e.g. ``layout.unflatten(x)``).
    """
    selection = check_selection(selection, group_sizes(layout, graph))
    out = {}
    for t in layout.tensors:
        a = np.asarray(arrays[t.name])
        if a.shape != t.shape:
            raise ValueError(f"tensor {t.name!r} has shape {a.shape}, expected {t.shape}")
        rows, cols = _indices(graph[t.name], selection, t.shape)
        a = a[rows]
        out[t.name] = np.ascontiguousarray(a if len(t.shape) == 1 else a[:, cols])
    return out


def check_small_arrays(
    layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    selection: ChannelSelection,
    arrays: Mapping[str, NDArray],
) -> NDArray[np.float32]:
    """Check small arrays (names, float32, shapes, finite) and concatenate them in layout order.

    The result lines up with ``flatnonzero(selection_mask(...))``. Raises
    ``ValueError`` naming the first offending tensor.
    """
    shapes = sliced_shapes(layout, graph, selection)
    if set(arrays) != set(shapes):
        missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
        raise ValueError(f"small model tensors differ: missing {missing}, unexpected {extra}")
    parts = []
    for name, shape in shapes.items():
        a = np.asarray(arrays[name])
        if a.dtype != np.float32 or a.shape != shape:
            raise ValueError(
                f"tensor {name!r} must be float32{list(shape)}, got {a.dtype}{list(a.shape)}"
            )
        if not np.all(np.isfinite(a)):
            raise ValueError(f"tensor {name!r} contains NaN or Inf")
        parts.append(a.reshape(-1))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.float32)


def reconstruct(
    layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    selection: ChannelSelection,
    small: Mapping[str, NDArray],
    x: NDArray[np.float32],
) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """A small model's arrays back in the full parameter space (client -> server).

    Returns the full flat vector (held positions from ``small``, every other position
    from the current global model ``x``) and the mask of held positions.
    """
    if x.shape != (layout.size,):
        raise ValueError(f"global vector has shape {x.shape}, expected ({layout.size},)")
    values = check_small_arrays(layout, graph, selection, small)
    mask = selection_mask(layout, graph, selection)
    full = np.array(x, dtype=np.float32, copy=True)
    full[mask] = values
    return full, mask


def encode_channels(selection: ChannelSelection, sizes: Mapping[str, int]) -> dict[str, NDArray]:
    """Kept channels per group in the narrowest unsigned dtype for the group's size."""
    selection = check_selection(selection, sizes)
    return {g: selection[g].astype(index_dtype(n)) for g, n in sizes.items()}


def decode_channels(arrays: Mapping[str, NDArray], sizes: Mapping[str, int]) -> ChannelSelection:
    """Inverse of :func:`encode_channels`; raises ``ValueError`` naming the bad group."""
    for g, a in arrays.items():
        if g in sizes and np.asarray(a).dtype != index_dtype(sizes[g]):
            raise ValueError(
                f"group {g!r}: channel indices must be {index_dtype(sizes[g])}, got "
                f"{np.asarray(a).dtype}"
            )
    return check_selection(arrays, sizes)


def channels_digest(channels: Mapping[str, NDArray]) -> str:
    """Digest of encoded kept channels (group names and indices); a reply echoes it."""
    data = b"".join(
        f"{g}:{np.asarray(a).dtype.str}:".encode() + np.ascontiguousarray(a).tobytes()
        for g, a in channels.items()
    )
    return mask_digest(CHANNELS_KIND, np.frombuffer(data, dtype=np.uint8))
