"""The round's figures measured on the nodes: each node's evaluation on its local test split, pooled
by examples.

With the nodes' own data the server usually holds no test set, so these are the run's global
figures: the full global model on the nodes that were sent all of it (capacity 1), and each capacity
level's submodels on the nodes of that level. With a server test set they are reported beside the
central figures.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: ``global_figures``' source of figures measured on the nodes' own test splits.
NODES_SOURCE = "nodes' test splits"


@dataclass(frozen=True)
class NodeEvaluation:
    """One node's evaluation reply.

    Parameters
    ----------
    capacity : float
        The node's capacity level.
    full_model : bool
        The node evaluated the whole global model (its submodel was all of it).
    num_examples : int
        Examples in the node's local test split.
    loss : float
        Mean loss over those examples.
    accuracy : float
        Share of those examples classified correctly.
    adapted_loss, adapted_accuracy : float, optional
        The same after the node adapted the submodel on its training split (``adapt-steps``;
        ``None``: off).
    """

    capacity: float
    full_model: bool
    num_examples: int
    loss: float
    accuracy: float
    adapted_loss: float | None = None
    adapted_accuracy: float | None = None


def pooled(evals: Sequence[NodeEvaluation]) -> dict[str, Any] | None:
    """Example-weighted accuracy and loss over ``evals``, with their examples and nodes; ``None`` if
    empty.

    With every node's adapted figures (``adapt-steps``), also ``adapted_accuracy`` and
    ``adapted_loss``.
    """
    n = sum(e.num_examples for e in evals)
    if not evals or n == 0:
        return None
    out = {
        "accuracy": sum(e.accuracy * e.num_examples for e in evals) / n,
        "loss": sum(e.loss * e.num_examples for e in evals) / n,
        "num_examples": n,
        "nodes": len(evals),
    }
    if all(e.adapted_accuracy is not None and e.adapted_loss is not None for e in evals):
        out["adapted_accuracy"] = sum(e.adapted_accuracy * e.num_examples for e in evals) / n  # type: ignore[operator]
        out["adapted_loss"] = sum(e.adapted_loss * e.num_examples for e in evals) / n  # type: ignore[operator]
    return out


def federated_figures(evals: Sequence[NodeEvaluation]) -> dict[str, Any]:
    """The round's node-measured figures.

    Returns ``{"full_model": pooled over the nodes that evaluated the whole model (or None),
    "per_capacity": {level: pooled over that level's nodes}, "all": pooled over every node}``;
    levels are written ``f"{γ:g}"``, largest first, as the central figures' ``per_capacity``.
    """
    levels = sorted({e.capacity for e in evals}, reverse=True)
    return {
        "full_model": pooled([e for e in evals if e.full_model]),
        "per_capacity": {f"{g:g}": pooled([e for e in evals if e.capacity == g]) for g in levels},
        "all": pooled(evals),
    }


def global_figures(record: dict[str, Any]) -> dict[str, Any] | None:
    """A round's global figures: on the server's test set, or else pooled over the nodes' own test
    splits.

    Returns ``{"accuracy", "loss", "per_capacity": {level: {"accuracy", ...}}, "source"}``
    (``accuracy`` and ``loss`` ``None`` when no node evaluated the whole model), or ``None`` for a
    round without any.
    """
    if record.get("global"):
        return {**record["global"], "source": "server test set"}
    federated = record.get("federated")
    if not federated:
        return None
    full = federated.get("full_model") or {}
    return {
        "accuracy": full.get("accuracy"),
        "loss": full.get("loss"),
        "per_capacity": {k: v for k, v in federated["per_capacity"].items() if v},
        "source": NODES_SOURCE,
    }
