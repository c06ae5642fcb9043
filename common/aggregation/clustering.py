"""Clustered aggregation's placement rule (ACFL): a node joins the cluster it is most like.

Each cluster keeps the sum of its members' unit signatures (a signature is a node's first accepted
update, or its first uploaded Fisher), so its direction is its members' mean direction. A node is
placed once, by its signature: in the most similar cluster when that similarity reaches the
threshold; else in a new cluster while there are fewer than the bound; else in the most similar
one. A cluster without members yet (the first, before anyone is placed) takes the first node.

The similarity is the cosine on the positions the node's signature holds (where it is not zero): a
node that trained a submodel is compared with a cluster on the positions it trained, not penalised
for the positions it never held (a plain cosine against a full node's update falls with the
submodel's size, whatever the data).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray


def unit(v: NDArray[np.floating]) -> NDArray[np.float64]:
    """``v`` scaled to length 1 (float64); a zero vector stays zero."""
    v = np.asarray(v, dtype=np.float64)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v.copy()


def cosine(a: NDArray[np.floating], b: NDArray[np.floating]) -> float:
    """The cosine similarity of ``a`` and ``b``, in [-1, 1]; 0 when either is zero."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    if na == 0 or nb == 0:
        return 0.0
    return float(np.clip(np.dot(a, b) / (na * nb), -1.0, 1.0))


def held_cosine(signature: NDArray[np.floating], direction: NDArray[np.floating]) -> float:
    """The cosine of ``signature`` and ``direction`` on the positions where ``signature`` is not
    zero."""
    held = np.flatnonzero(signature)
    return cosine(np.asarray(signature)[held], np.asarray(direction)[held])


def place(
    signature: NDArray[np.floating],
    directions: Sequence[NDArray[np.floating] | None],
    threshold: float,
    max_clusters: int,
) -> int:
    """The cluster a node with ``signature`` joins: an index of ``directions``, or
    ``len(directions)`` to open a new one.

    Parameters
    ----------
    signature : NDArray
        The node's signature (its first update or Fisher, flat).
    directions : Sequence[NDArray or None]
        Each existing cluster's members' summed unit signatures; ``None`` for a cluster without
        members yet.
    threshold : float
        The cosine similarity, in [-1, 1], a node needs with a cluster to join it.
    max_clusters : int
        The most clusters there may be (``>= 1``).
    """
    if max_clusters < 1:
        raise ValueError(f"max_clusters must be at least 1, not {max_clusters}")
    if not -1.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be in [-1, 1], not {threshold}")
    for i, direction in enumerate(directions):
        if direction is None:
            return i
    if not directions:
        return 0
    similarity = [held_cosine(signature, d) for d in directions]
    best = int(np.argmax(similarity))  # the first of equals: the order the clusters opened
    if similarity[best] >= threshold or len(directions) >= max_clusters:
        return best
    return len(directions)
