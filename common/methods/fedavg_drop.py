"""FedAvg over the full-capacity nodes only: what operators do today when small devices cannot hold the model."""

from __future__ import annotations

from common.methods.fedavg import FedAvg


class FedAvgDrop(FedAvg):
    """FedAvg that leaves out every node below capacity 1."""

    name = "fedavg-drop"
    summary = "only nodes with capacity 1 take part, full model (what operators do today)"

    def participates(self, capacity: float) -> bool:
        """Only nodes that hold the full model."""
        return capacity >= 1.0

    def participation_requirement(self) -> str:
        """Capacity 1: a node that cannot hold the full model is left out."""
        return "needs capacity 1"
