"""Label-split aggregation of the classifier: each output row is averaged over the clients that hold
its class.

A client that never sees class ``c`` does not train the classifier's row ``c`` (with masked
cross-entropy its logit is a constant 0, so the row's gradient is zero). Counting that client among
the row's holders in the mask-aware mean would pull the row toward its old value in proportion to
how many clients lack the class. HeteroFL's published ``Federation.combine`` (``src/fed.py``;
FedRolex's ``ResnetServerRoll.combine`` likewise) therefore restricts each client's classifier rows
to its ``label_split``, the classes of its local data, before averaging. Here that restriction is
applied to a client's :class:`~common.aggregation.masked.MaskedUpdate`
(:func:`restrict_to_classes`), and :func:`common.aggregation.masked.aggregate_masked` then averages
each position over the clients that still hold it; a row no participating client holds keeps its
value.

The classifier is the model's output layer (:func:`output_layer`): the last 2-D tensor of the
layout and the 1-D tensor of the same module, as the published code takes the last ``weight`` and
the last ``bias`` of the model.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate
from common.models.layout import ParamLayout

#: Name of the reply array in which a client reports the classes it holds (uint8, 1 per class
#: present).
CLASSES = "classes"


def output_layer(layout: ParamLayout) -> tuple[str, str | None]:
    """Names of the classifier's weight and bias (``None`` when it has no bias).

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the model.
    """
    weights = [t for t in layout.tensors if len(t.shape) == 2]
    if not weights:
        raise ValueError("the layout has no 2-D tensor to serve as the classifier")
    weight = weights[-1].name
    module = weight.rpartition(".")[0]
    bias = next(
        (t.name for t in layout.tensors if len(t.shape) == 1 and t.name == f"{module}.bias"), None
    )
    return weight, bias


def num_outputs(layout: ParamLayout) -> int:
    """Rows of the classifier (the number of classes)."""
    weight, _ = output_layer(layout)
    return next(t.shape[0] for t in layout.tensors if t.name == weight)


def class_of_position(layout: ParamLayout) -> NDArray[np.int64]:
    """For every flat position, the classifier row (class) it belongs to; ``-1`` outside the
    classifier.

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the model.
    """
    weight, bias = output_layer(layout)
    out = np.full(layout.size, -1, dtype=np.int64)
    for t, start in zip(layout.tensors, layout.offsets[:-1]):
        if t.name in (weight, bias):
            out[start : start + t.size] = np.repeat(
                np.arange(t.shape[0], dtype=np.int64), t.size // t.shape[0]
            )
    return out


def check_class_flags(flags: NDArray, num_classes: int) -> NDArray[np.bool_]:
    """A client's reported classes as booleans; ``ValueError`` says what is wrong.

    Parameters
    ----------
    flags : NDArray
        ``uint8[num_classes]``, 1 for each class in the client's training data, else 0.
    num_classes : int
        Rows of the classifier.
    """
    a = np.asarray(flags)
    if a.dtype != np.uint8 or a.shape != (num_classes,):
        raise ValueError(f"classes must be uint8[{num_classes}], got {a.dtype}{list(a.shape)}")
    if np.any(a > 1):
        raise ValueError("classes must hold only 0 and 1")
    if not a.any():
        raise ValueError("classes flags no class (a client trains on at least one)")
    return a.astype(bool)


def restrict_to_classes(
    update: MaskedUpdate, position_class: NDArray[np.int64], held: NDArray[np.bool_]
) -> MaskedUpdate:
    """``update`` without the classifier positions of classes the client does not hold.

    Parameters
    ----------
    update : MaskedUpdate
        A client's validated update.
    position_class : NDArray[int64]
        :func:`class_of_position` of the model's layout.
    held : NDArray[bool]
        One flag per class: whether the client's training data has it.
    """
    cls = position_class[update.indices]
    keep = (cls < 0) | held[np.maximum(cls, 0)]
    return MaskedUpdate(update.indices[keep], update.delta[keep], update.weight)
