"""The Gaussian mechanism on a node's Fisher upload.

Each example's gradient is clipped to L2 norm ``C_f`` before it is squared
(:func:`common.fisher.estimation.per_example_fisher` with ``clip_norm``). One example then adds a
non-negative vector of L1 norm at most ``C_f^2`` to the sum of squares, hence of L2 norm at most
``C_f^2``: the sum's sensitivity is ``C_f^2``, and the noise on the mean of ``n`` examples has
standard deviation ``z C_f^2 / n`` (:func:`fisher_noise_std`), ``z`` the node's noise multiplier.
Its update is private through its local steps instead (:mod:`common.privacy.private_sgd`), with the
same ``z``, so the node's accountant composes one kind of mechanism
(:mod:`common.privacy.accountant`).

Noise is drawn from a generator seeded by the round's training seed, so a rerun repeats it.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

#: Mixed into the round's training seed so that the Fisher's noise differs from every other draw of
#: the round.
FISHER_STREAM = 0xF15


def fisher_noise_std(noise_multiplier: float, clip_norm: float, num_examples: int) -> float:
    """Standard deviation of the noise on a mean of ``num_examples`` clipped squared gradients.

    Parameters
    ----------
    noise_multiplier : float
        ``z``, the noise's standard deviation in units of the sensitivity (>= 0).
    clip_norm : float
        ``C_f``, the bound on one example's gradient norm (> 0).
    num_examples : int
        Examples the estimate averages (>= 1); the count is taken as public.
    """
    if noise_multiplier < 0 or not clip_norm > 0 or num_examples < 1:
        raise ValueError(
            f"noise_multiplier={noise_multiplier}, clip_norm={clip_norm}, "
            f"num_examples={num_examples}"
        )
    return noise_multiplier * clip_norm**2 / num_examples


def privatise_fisher(
    fisher: NDArray[np.float32],
    noise_multiplier: float,
    clip_norm: float,
    num_examples: int,
    seed: int,
) -> NDArray[np.float32]:
    """A mean of clipped squared gradients with the Gaussian mechanism's noise, negative values set
    to 0.

    Parameters
    ----------
    fisher : NDArray[float32]
        The mean of ``num_examples`` squared gradients, each clipped to ``clip_norm`` before
        squaring.
    noise_multiplier, clip_norm, num_examples : float, float, int
        As in :func:`fisher_noise_std`.
    seed : int
        The round's training seed (non-negative): the noise repeats in a rerun.

    Setting negatives to 0 is post-processing (a Fisher is non-negative), which costs no privacy.
    """
    std = fisher_noise_std(noise_multiplier, clip_norm, num_examples)
    rng = np.random.default_rng([seed, FISHER_STREAM])
    noisy = fisher + (rng.standard_normal(fisher.size) * std).astype(np.float32).reshape(
        fisher.shape
    )
    return np.maximum(noisy, 0).astype(np.float32)
