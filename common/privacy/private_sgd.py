"""One step's gradient under differential privacy (DP-SGD): each example's gradient clipped,
Gaussian noise on the sum.

The node's update is then a function of noised gradients only, so it needs no noise of its own: the
privacy of the update is that of its local steps, each a subsampled Gaussian mechanism (a minibatch
of ``B`` of ``n`` examples, :mod:`common.privacy.accountant`). The noise's standard deviation is
``noise_multiplier * clip_norm`` on the sum of clipped gradients, which is then divided by the
minibatch size, as in Abadi et al.'s DP-SGD and Opacus.

Examples are taken one backward pass each: this needs no per-sample hooks (which
``torch.nn.utils.prune``'s forward pre-hooks and the methods' gates would have to support) and works
for every model whose output for one example depends on that example alone; models that normalise by
batch statistics are refused by the configuration (``dp-epsilon`` with ``model = "cnn-bn"`` or
``"resnet18"``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def private_gradient(
    params: Sequence[torch.Tensor],
    loss_of_example: Callable[[int], torch.Tensor],
    batch_size: int,
    clip_norm: float,
    noise_multiplier: float,
    generator: torch.Generator,
) -> float:
    """Set each parameter's ``.grad`` to the noised mean of the minibatch's clipped per-example
    gradients.

    Parameters
    ----------
    params : Sequence[torch.Tensor]
        The trained tensors (leaves that require a gradient).
    loss_of_example : Callable[[int], torch.Tensor]
        The loss of the minibatch's ``i``-th example, ``0 <= i < batch_size`` (a scalar with a graph
        to ``params``).
    batch_size : int
        Examples in the minibatch (>= 1).
    clip_norm : float
        ``C``: each example's gradient, over every tensor together, is scaled down to this L2 norm.
    noise_multiplier : float
        ``z``: the noise on the sum has standard deviation ``z * C`` per coordinate.
    generator : torch.Generator
        Source of the noise (seeded per round, so a rerun repeats it); CPU.

    Returns
    -------
    float
        The mean loss over the minibatch.
    """
    if batch_size < 1 or not clip_norm > 0 or noise_multiplier < 0:
        raise ValueError(
            f"batch_size={batch_size}, clip_norm={clip_norm}, noise_multiplier={noise_multiplier}"
        )
    sums = [torch.zeros_like(p) for p in params]
    total = 0.0
    for i in range(batch_size):
        loss = loss_of_example(i)
        grads = torch.autograd.grad(loss, list(params), allow_unused=True)
        grads = [
            torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
        ]
        norm = torch.sqrt(sum(g.double().square().sum() for g in grads))
        scale = min(1.0, clip_norm / max(float(norm), 1e-300))
        for s, g in zip(sums, grads, strict=True):
            s.add_(g, alpha=scale)
        total += float(loss.detach())
    std = noise_multiplier * clip_norm
    for p, s in zip(params, sums, strict=True):
        noise = torch.randn(p.shape, generator=generator, dtype=p.dtype).to(p.device) * std
        p.grad = (s + noise) / batch_size
    return total / batch_size
