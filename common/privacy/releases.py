"""What a node releases under ``dp-epsilon``, counted without the accountant (so configuration stays
light).

Each entry of :data:`Releases` is a number of Gaussian mechanisms of one sample rate; the accountant
(:mod:`common.privacy.accountant`) turns them into an epsilon.
"""

from __future__ import annotations

import math

#: ``(sample_rate, count)``: ``count`` Gaussian mechanisms, each applied to a ``sample_rate`` share
#: of the node's examples (1.0: a Fisher over its examples; ``B / n``: a DP-SGD step on a minibatch
#: of ``B``).
Releases = tuple[tuple[float, int], ...]


def node_releases(
    num_examples: int, batch_size: int, epochs: int, rounds: int, fisher_uploads: int
) -> Releases:
    """What a node that trains ``rounds`` rounds releases: its DP-SGD steps and its Fisher uploads.

    Parameters
    ----------
    num_examples : int
        The node's training examples ``n``.
    batch_size : int
        Minibatch size ``B`` (a step samples ``min(1, B / n)`` of the examples).
    epochs : int
        Local epochs a round (``ceil(n / B)`` steps each).
    rounds : int
        Rounds it trains.
    fisher_uploads : int
        Fisher estimates it uploads (each over its examples: rate 1).
    """
    if num_examples < 1 or batch_size < 1:
        raise ValueError(f"num_examples={num_examples}, batch_size={batch_size} must be >= 1")
    rate = min(1.0, batch_size / num_examples)
    steps = rounds * epochs * math.ceil(num_examples / batch_size)
    return ((rate, steps), (1.0, fisher_uploads))


def fisher_uploads(num_rounds: int, every: int, warmup: bool) -> int:
    """Fisher uploads of a node that trains every round: the warm-up, then one every ``every``
    rounds."""
    return (1 if warmup else 0) + math.ceil(num_rounds / every)
