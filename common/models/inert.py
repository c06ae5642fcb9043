"""Parameters that cannot learn: a bias whose layer output feeds a BatchNorm.

A BatchNorm in training subtracts the per-channel batch mean, so a constant added per channel
before it (a convolution's or linear layer's bias) cancels: its gradient is zero for every
example, and its Fisher too. A submodel that spends budget on such a bias gains nothing
(``cnn-bn``: 96 of the 2,368 positions of a capacity-1/64 submodel). The model graph says
which biases these are (:func:`inert_parameters`, through ``torch.fx``); models that cannot be
traced (Hugging Face wrappers) report none, which only means they are ranked like any other.
"""

from __future__ import annotations

import torch.fx
from torch import nn

#: Modules between a layer and its norm that scale each channel by a constant (keep the bias inert).
_PASS_THROUGH: tuple[str, ...] = ("Scaler",)


def inert_parameters(model: nn.Module) -> frozenset[str]:
    """Names of the trainable biases that feed a BatchNorm directly (or through a constant scaler).

    Parameters
    ----------
    model : nn.Module
        The architecture (its values are not read).

    Returns
    -------
    frozenset[str]
        Parameter names as in ``model.named_parameters()``; empty when the model cannot be traced.
    """
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # noqa: BLE001 - untraceable models (data-dependent control flow) have no known inert set
        return frozenset()
    modules = dict(model.named_modules())
    out: set[str] = set()
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(
            modules.get(node.target), nn.modules.batchnorm._BatchNorm
        ):
            continue
        src = node.args[0] if node.args else None
        while (
            isinstance(src, torch.fx.Node)
            and src.op == "call_module"
            and type(modules.get(src.target)).__name__ in _PASS_THROUGH
            and len(src.users) == 1
        ):
            src = src.args[0]
        if not isinstance(src, torch.fx.Node) or src.op != "call_module" or len(src.users) != 1:
            continue  # a layer whose output also goes elsewhere keeps its bias useful there
        layer = modules.get(src.target)
        bias = getattr(layer, "bias", None)
        if (
            isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear))
            and bias is not None
            and bias.requires_grad
        ):
            out.add(f"{src.target}.bias")
    return frozenset(out)
