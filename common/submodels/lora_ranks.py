"""Heterogeneous-rank LoRA on the flat federated vector: rank masks, aggregation of mixed ranks,
rank allocation.

The federated vector of ``method = "lora"`` holds, for every adapted layer, the factors of a rank
``R = lora-max-rank`` adapter, ``A`` of shape ``(R, fan_in)`` and ``B`` of shape ``(fan_out, R)``
(the update of the frozen weight is ``s * B @ A``, ``s = lora-alpha / R`` for every client), plus
the trainable classification head. A client of rank ``r`` in a layer holds that layer's first ``r``
components: rows ``0..r-1`` of ``A`` and columns ``0..r-1`` of ``B`` (:func:`rank_mask`). Holding a
prefix of the components is what makes ranks nest: a rank-``r`` adapter is the rank-``R`` adapter
with its trailing components zero (HetLoRA's truncation).

Aggregation of adapters of different ranks (``lora-aggregation``):

* ``svd`` (FlexLoRA): each client's product ``B_n A_n`` is formed at its own rank, the
  example-weighted mean ``W = sum_n p_n B_n A_n`` is the global low-rank update, and its truncated
  SVD ``U_R S_R V_R^T`` becomes the new factors, ``B = U_R S_R``, ``A = V_R^T``
  (:func:`svd_factors`). Components come out sorted by singular value, so a rank-``r`` client next
  receives the best rank-``r`` approximation of the global update (FlexLoRA's redistribution), and
  nothing is averaged across factorisations that do not share a basis.
* ``zero-pad`` (HetLoRA): each client's factors are padded with zeros to rank ``R`` and averaged,
  weighted by examples over *all* clients: a component only large clients hold is shrunk by the
  weight of the small ones.
* ``holders``: each factor entry is averaged over the clients that held it (the mask-aware mean of
  every other method; rank-balanced column weights).

The head is averaged over its holders (every client) in all three.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.models.layout import ParamLayout

LORA_AGGREGATIONS: tuple[str, ...] = ("svd", "zero-pad", "holders")
LORA_ALLOCATIONS: tuple[str, ...] = ("uniform", "fisher")
A_TAG, B_TAG = ".lora_A.", ".lora_B."


@dataclass(frozen=True)
class LoraPair:
    """The two factors of one adapted layer in the federated vector.

    Parameters
    ----------
    layer : str
        Name of the adapted module (the part of the factor names before ``.lora_A.``).
    a, b : str
        Names of the ``A`` (``(max_rank, fan_in)``) and ``B`` (``(fan_out, max_rank)``) tensors.
    max_rank : int
        Components the federated vector holds (``lora-max-rank``).
    fan_in, fan_out : int
        Input and output width of the adapted layer.
    """

    layer: str
    a: str
    b: str
    max_rank: int
    fan_in: int
    fan_out: int


def lora_pairs(layout: ParamLayout) -> list[LoraPair]:
    """Every adapted layer of ``layout``, in layout order; ``ValueError`` if a factor lacks its
    partner."""
    shapes = {t.name: tuple(t.shape) for t in layout.tensors}
    pairs = []
    for name, shape in shapes.items():
        if A_TAG not in name:
            continue
        b = name.replace(A_TAG, B_TAG)
        if b not in shapes:
            raise ValueError(f"LoRA factor {name!r} has no {B_TAG.strip('.')} partner {b!r}")
        (rank, fan_in), (fan_out, rank_b) = shape, shapes[b]
        if rank != rank_b:
            raise ValueError(f"LoRA factors of {name!r} have ranks {rank} and {rank_b}")
        pairs.append(LoraPair(name.split(A_TAG)[0], name, b, rank, fan_in, fan_out))
    if any(B_TAG in n and n.replace(B_TAG, A_TAG) not in shapes for n in shapes):
        raise ValueError("a LoRA B factor has no A partner")
    return pairs


def lora_rank(gamma: float, max_rank: int) -> int:
    """A capacity-``gamma`` client's rank per layer: ``ceil(gamma * max_rank)``, at least 1.

    Parameters
    ----------
    gamma : float
        Capacity, in (0, 1].
    max_rank : int
        ``lora-max-rank``.
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"capacity must be in (0, 1], got {gamma}")
    return max(1, min(max_rank, math.ceil(gamma * max_rank - 1e-9)))


def _offsets(layout: ParamLayout) -> dict[str, int]:
    return dict(zip(layout.names, layout.offsets[:-1].tolist()))


def rank_mask(
    layout: ParamLayout, pairs: Sequence[LoraPair], ranks: Mapping[str, int]
) -> NDArray[np.bool_]:
    """The positions a client holds: the first ``ranks[layer]`` components of each pair, and every
    other tensor.

    Parameters
    ----------
    layout : ParamLayout
        The federated vector's layout.
    pairs : Sequence[LoraPair]
        Its adapted layers (:func:`lora_pairs`).
    ranks : Mapping[str, int]
        Rank per layer name, each in ``[1, max_rank]``.
    """
    mask = np.ones(layout.size, dtype=bool)
    at = _offsets(layout)
    for p in pairs:
        r = int(ranks[p.layer])
        if not 1 <= r <= p.max_rank:
            raise ValueError(f"rank {r} of layer {p.layer!r} outside [1, {p.max_rank}]")
        a = mask[at[p.a] : at[p.a] + p.max_rank * p.fan_in].reshape(p.max_rank, p.fan_in)
        a[r:] = False
        b = mask[at[p.b] : at[p.b] + p.fan_out * p.max_rank].reshape(p.fan_out, p.max_rank)
        b[:, r:] = False
    return mask


def held_ranks(
    layout: ParamLayout, pairs: Sequence[LoraPair], mask: NDArray[np.bool_]
) -> dict[str, int]:
    """The rank per layer of a :func:`rank_mask`; ``ValueError`` if ``mask`` is not one."""
    parts = layout.unflatten(mask)
    ranks = {p.layer: int(parts[p.a].any(axis=1).sum()) for p in pairs}
    if not pairs:
        return ranks
    if not np.array_equal(rank_mask(layout, pairs, ranks), mask):
        raise ValueError("the mask is not a prefix of every layer's LoRA components")
    return ranks


def _factor(x: NDArray[np.float32], at: int, shape: tuple[int, int]) -> NDArray[np.float32]:
    return x[at : at + shape[0] * shape[1]].reshape(shape)


def svd_factors(
    w: NDArray[np.float64], rank: int
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """``B = U_r S_r`` and ``A = V_r^T`` of the rank-``rank`` truncated SVD of ``w`` (components by
    singular value).

    Singular vectors have a sign ambiguity; each component's sign is fixed so that the
    largest-magnitude entry of its ``A`` row is positive, so the factors are a function of ``w``.
    """
    u, s, vt = np.linalg.svd(w, full_matrices=False)
    k = min(rank, s.size)
    b = np.zeros((w.shape[0], rank))
    a = np.zeros((rank, w.shape[1]))
    sign = np.sign(vt[np.arange(k), np.abs(vt[:k]).argmax(axis=1)])
    sign[sign == 0] = 1.0
    b[:, :k] = u[:, :k] * (s[:k] * sign)
    a[:k] = vt[:k] * sign[:, None]
    return b, a


def aggregate_lora(
    x: NDArray[np.float32],
    layout: ParamLayout,
    pairs: Sequence[LoraPair],
    updates: Sequence[MaskedUpdate],
    mode: str,
    server_lr: float = 1.0,
) -> NDArray[np.float32]:
    """The new federated vector from clients' updates of mixed ranks (returns a new array).

    Parameters
    ----------
    x : NDArray[float32]
        The current federated vector (factors at ``max_rank``, head); not modified.
    layout : ParamLayout
        Its layout.
    pairs : Sequence[LoraPair]
        Its adapted layers.
    updates : Sequence[MaskedUpdate]
        Validated client updates; each client's held positions must be a :func:`rank_mask`.
    mode : {"svd", "zero-pad", "holders"}
        ``lora-aggregation`` (see the module docstring).
    server_lr : float
        Server step: the new value is ``x + server_lr * (aggregate - x)`` (for ``svd``: of the
        product ``B A``).
    """
    if mode not in LORA_AGGREGATIONS:
        raise ValueError(f"unknown LoRA aggregation {mode!r}; expected one of {LORA_AGGREGATIONS}")
    out = aggregate_masked(x, updates, server_lr)  # the head, and every factor entry for "holders"
    if mode == "holders" or not updates:
        return out
    weights = np.array([u.weight for u in updates], dtype=np.float64)
    weights /= weights.sum()
    trained = []
    for u in updates:  # each client's values, zero outside what it held (its zero-padded factors)
        v = np.zeros(layout.size, dtype=np.float64)
        v[u.indices] = x[u.indices].astype(np.float64) + u.delta
        trained.append(v)
    at = _offsets(layout)
    for p in pairs:
        sa, sb = (p.max_rank, p.fan_in), (p.fan_out, p.max_rank)
        if mode == "zero-pad":
            for name, shape in ((p.a, sa), (p.b, sb)):
                mean = sum(w * _factor(v, at[name], shape) for w, v in zip(weights, trained))
                old = _factor(x, at[name], shape).astype(np.float64)
                _factor(out, at[name], shape)[:] = old + server_lr * (mean - old)
            continue
        product = sum(
            w * (_factor(v, at[p.b], sb) @ _factor(v, at[p.a], sa))
            for w, v in zip(weights, trained)
        )
        old = _factor(x, at[p.b], sb).astype(np.float64) @ _factor(x, at[p.a], sa).astype(
            np.float64
        )
        b, a = svd_factors(old + server_lr * (product - old), p.max_rank)
        _factor(out, at[p.a], sa)[:] = a
        _factor(out, at[p.b], sb)[:] = b
    return out


def layer_fisher_mass(
    fisher: NDArray[np.float32], layout: ParamLayout, pairs: Sequence[LoraPair]
) -> NDArray[np.float64]:
    """Each adapted layer's Fisher per measured factor entry: the mean of its positive ``A`` and
    ``B`` entries.

    A client measures the Fisher only on the components it held (the others are zero, and so are
    their gradients), so a sum would grow with the rank the client was given; the mean per measured
    entry does not. ``B``'s gradient is the adapted weight's gradient projected on ``A``'s rows, so
    the mean is that weight's Fisher per component. A layer with no positive entry has mass 0.
    """
    parts = layout.unflatten(np.asarray(fisher))
    out = np.zeros(len(pairs), dtype=np.float64)
    for i, p in enumerate(pairs):
        values = np.concatenate([parts[p.a].reshape(-1), parts[p.b].reshape(-1)]).astype(np.float64)
        positive = values[values > 0]
        out[i] = positive.mean() if positive.size else 0.0
    return out


def allocate_ranks(
    mass: NDArray, budget: int, max_rank: int, min_rank: int = 1
) -> NDArray[np.int64]:
    """Split ``budget`` rank units across layers in proportion to ``mass``, each layer in
    ``[min_rank, max_rank]``.

    The continuous allocation is ``t_l = min(max_rank, min_rank + lam * mass_l)`` with ``lam`` such
    that ``sum t = budget`` (water-filling: a layer that reaches ``max_rank`` passes its surplus to
    the others in proportion to their mass); it is rounded by largest remainder (ties to the lower
    layer index), so the ranks sum to ``budget`` exactly. Rank units that no layer with positive
    mass can take (all capped) are split evenly over the layers without mass; with no positive mass
    at all the split is uniform.

    Parameters
    ----------
    mass : NDArray
        Non-negative Fisher mass per layer (:func:`layer_fisher_mass`).
    budget : int
        Rank units to spend, clipped to ``[L * min_rank, L * max_rank]`` (``L`` layers).
    max_rank, min_rank : int
        Bounds of every layer's rank.
    """
    mass = np.asarray(mass, dtype=np.float64)
    n = mass.size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    if np.any(~np.isfinite(mass)) or np.any(mass < 0):
        raise ValueError("layer Fisher mass must be finite and non-negative")
    if not 1 <= min_rank <= max_rank:
        raise ValueError(f"need 1 <= min_rank <= max_rank, got {min_rank}, {max_rank}")
    budget = int(min(max(budget, n * min_rank), n * max_rank))
    capped = np.zeros(n, dtype=bool)
    target = np.full(n, float(max_rank))
    while not capped.all():
        free = ~capped
        if mass[free].sum() <= 0:  # what is left to split has no Fisher mass: split it evenly
            mass = np.where(free, 1.0, mass)
        room = budget - max_rank * capped.sum() - min_rank * free.sum()
        share = (
            room * np.where(free, mass, 0.0) / mass[free].sum()
        )  # fraction first: tiny masses stay finite
        target = np.where(capped, float(max_rank), min_rank + share)
        over = free & (target > max_rank)
        if not over.any():
            break
        capped |= over
    ranks = np.minimum(np.floor(target + 1e-9), max_rank).astype(np.int64)
    left = budget - int(ranks.sum())
    if left > 0:
        frac = np.where(ranks < max_rank, target - ranks, -np.inf)
        order = np.lexsort((np.arange(n), -frac))  # largest remainder first, then lower index
        ranks[order[:left]] += 1
    return ranks
