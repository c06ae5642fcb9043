"""The client optimiser of a round's local training, by the ``optimizer`` run-config key.

A client builds its optimiser afresh every round, so no optimiser state (momentum buffers, Adam
moments) outlives a round or travels: every method's update is the difference of weights alone, as
in FedAvg. ``sgd`` is what the image benchmarks and the papers' CNN experiments use; ``adamw`` is
what fine-tuning a pretrained transformer (or its LoRA adapters) usually takes, where plain SGD
moves the adapters slowly (docs/design/transformers.md measures both).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from common.training.catalog import OPTIMIZERS


def make_optimizer(
    params: Iterable[torch.nn.Parameter],
    name: str,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """A fresh optimiser over ``params``.

    Parameters
    ----------
    params : Iterable[torch.nn.Parameter]
        The trained parameters.
    name : {"sgd", "adamw"}
        ``optimizer``.
    lr : float
        Learning rate (``lr``), per step.
    momentum : float
        SGD momentum (``momentum``); AdamW keeps its default betas (0.9, 0.999) and ignores it.
    weight_decay : float
        SGD's L2 term added to the gradient, or AdamW's decoupled decay (``weight_decay``).
    """
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise ValueError(f"optimizer={name!r}: allowed values are {', '.join(OPTIMIZERS)}")
