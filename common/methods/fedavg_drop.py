"""FedAvg over the full-capacity nodes only: what operators do today when small devices cannot hold
the model."""

from __future__ import annotations

from common.methods.fedavg import FedAvg
from common.methods.specs.fedavg_drop import FedAvgDropSpec


class FedAvgDrop(FedAvgDropSpec, FedAvg):
    """FedAvg that leaves out every node below capacity 1."""

    def participates(self, capacity: float) -> bool:
        """Only nodes that hold the full model."""
        return capacity >= 1.0

    #: A node that cannot hold the full model is left out.
    participation_requirement = "needs capacity 1"
