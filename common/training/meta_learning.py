"""First-order MAML local steps (FedMAML, first-order Per-FedAvg), with ``torch.func``.

A meta step trains the weights ``w`` to be a good starting point rather than a good model: it adapts
a copy on one batch, ``w' = w - a grad L_s(w)`` (``inner_steps`` times), and moves ``w`` along the
gradient of another batch's loss at the adapted weights, ``grad L_q(w')``. First-order: the inner
gradients are constants, so ``d L_q(w') / d w = grad L_q(w')`` and no second derivative is taken.
The step's batch is split in two, the first half adapting and the second scoring, so the node's
examples and minibatch count stay those of a plain step. The adapted copy lives only inside
:func:`torch.func.functional_call`; the module's own parameters receive the meta-gradient in
``.grad``, so the caller's optimiser, FedProx term, clipping and prune masks apply unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call, grad


def first_order_maml_backward(
    model: nn.Module,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    labels: torch.Tensor,
    inner_lr: float,
    inner_steps: int,
    logits: Callable[[torch.Tensor], torch.Tensor] = lambda out: out,
) -> float:
    """Put the first-order MAML gradient of one minibatch into the ``.grad`` of ``model``'s trained
    parameters.

    Parameters
    ----------
    model : nn.Module
        The model (prune masks attached, where the submodel is masked); its parameters that require
        a gradient are adapted and receive the meta-gradient.
    loss_fn : Callable
        ``loss_fn(logits, labels)``, the mean loss of a batch.
    inputs, labels : torch.Tensor
        The minibatch (model inputs, class labels). Its first half adapts, its second half scores; a
        batch of one example does both.
    inner_lr : float
        The inner step size ``a``.
    inner_steps : int
        Inner SGD steps on the first half.
    logits : Callable
        Maps the model's output to the logits the loss sees (e.g. label masking).

    Returns
    -------
    The second half's loss at the adapted weights.
    """
    half = len(inputs) // 2
    support = (inputs[:half], labels[:half]) if half > 0 else (inputs, labels)
    query = (inputs[half:], labels[half:]) if half > 0 else (inputs, labels)
    trained = {name: p for name, p in model.named_parameters() if p.requires_grad}

    def support_loss(params: dict[str, torch.Tensor]) -> torch.Tensor:
        return loss_fn(logits(functional_call(model, params, (support[0],))), support[1])

    adapted = {name: p.detach() for name, p in trained.items()}
    for _ in range(inner_steps):
        step = grad(support_loss)(adapted)
        adapted = {name: w - inner_lr * step[name] for name, w in adapted.items()}
    # w' = w - a * (sum of the inner gradients, constants): the query loss's gradient reaches w
    # unchanged.
    shifted = {name: p + (adapted[name] - p.detach()) for name, p in trained.items()}
    loss = loss_fn(logits(functional_call(model, shifted, (query[0],))), query[1])
    loss.backward()
    return float(loss.detach())
