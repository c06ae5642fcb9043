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

Before placing, the signatures that came in the same round are centred (:func:`centred`): each loses
the mean signature of the nodes of its capacity, per position over the nodes that hold it. What
every node learns alike (the digits themselves, say) and what a submodel's size does to an update
are then not what places a node; what is left is what sets its data apart.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

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


def centred(
    signatures: Mapping[str, NDArray[np.floating]], levels: Mapping[str, float]
) -> dict[str, NDArray[np.float64]]:
    """Each signature minus the mean signature of its capacity level, on the positions it holds.

    The mean at a position is over the signatures of that level that hold it (are not zero there).
    A level with a single signature takes the mean over every signature instead; a lone signature
    is left as it is.

    Parameters
    ----------
    signatures : Mapping[str, NDArray]
        The round's signatures by client key, all of one length.
    levels : Mapping[str, float]
        Each client's capacity level.
    """
    if len(signatures) < 2:
        return {k: np.asarray(v, dtype=np.float64) for k, v in signatures.items()}

    def mean_of(keys: list[str]) -> NDArray[np.float64]:
        total = np.sum([np.asarray(signatures[k], dtype=np.float64) for k in keys], axis=0)
        held = np.sum([np.asarray(signatures[k]) != 0 for k in keys], axis=0)
        return np.divide(total, held, out=np.zeros_like(total), where=held > 0)

    by_level: dict[float, list[str]] = {}
    for k in sorted(signatures):
        by_level.setdefault(levels[k], []).append(k)
    overall = mean_of(sorted(signatures))
    out = {}
    for keys in by_level.values():
        mean = mean_of(keys) if len(keys) > 1 else overall
        for k in keys:
            v = np.asarray(signatures[k], dtype=np.float64)
            out[k] = np.where(v != 0, v - mean, 0.0)
    return out


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
