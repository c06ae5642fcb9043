"""Partial participation: which of the eligible clients train in a round.

Every paper this product compares samples m of N clients per round; Flower's
strategies do the same with ``fraction_train`` and ``min_train_nodes``
(sample size ``max(int(N * fraction_train), min_train_nodes)``). Here the sample
is drawn over the clients' stable keys (not Flower node ids, which change when a
SuperNode restarts and are random in simulation), from a generator seeded by the
run seed and the round, so a rerun with the same seed and the same connected
clients trains the same clients in the same rounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

import numpy as np


def sample_size(n_eligible: int, fraction: float, min_nodes: int) -> int:
    """Clients to train in a round: ``max(floor(n_eligible * fraction), min_nodes)``, at most
    ``n_eligible``.

    Parameters
    ----------
    n_eligible : int
        Clients that could train this round (connected, not excluded, accepted by the method).
    fraction : float
        Share of the eligible clients to sample, in (0, 1].
    min_nodes : int
        Lower bound on the sample size (Flower's ``min_train_nodes``).

    The product is taken exactly on the decimal value of ``fraction`` (``0.29 * 100``
    is 29, not 28.999...), so the sample size is what the operator wrote.
    """
    if n_eligible < 0:
        raise ValueError(f"n_eligible={n_eligible} is negative")
    if not 0 < fraction <= 1:
        raise ValueError(f"fraction={fraction!r} is outside (0, 1]")
    if min_nodes < 1:
        raise ValueError(f"min_nodes={min_nodes} is below 1")
    share = math.floor(Fraction(repr(float(fraction))) * n_eligible)
    return min(n_eligible, max(share, min_nodes))


def sample_clients(
    keys: Sequence[str], fraction: float, min_nodes: int, seed: int, server_round: int
) -> list[str]:
    """The clients (by stable key) that train in ``server_round``, sorted.

    Parameters
    ----------
    keys : Sequence[str]
        Stable keys of the eligible clients, in any order (duplicates are an error).
    fraction, min_nodes : float, int
        As in :func:`sample_size`.
    seed : int
        The run seed; with ``server_round`` it seeds the draw.
    server_round : int
        The round (1-based); each round draws independently of the others.

    With ``fraction = 1`` every eligible client is returned and nothing is drawn.
    """
    ordered = sorted(keys)
    if len(set(ordered)) != len(ordered):
        raise ValueError("client keys must be distinct")
    size = sample_size(len(ordered), fraction, min_nodes)
    if size == len(ordered):
        return ordered
    rng = np.random.default_rng([seed, server_round])
    picked = rng.choice(len(ordered), size=size, replace=False)
    return [ordered[i] for i in sorted(picked.tolist())]
