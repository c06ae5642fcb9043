"""The spec of FedAvg over the full-capacity nodes only: no keys of its own.

The method: :mod:`common.methods.fedavg_drop`.
"""

from __future__ import annotations

from common.methods.specs.fedavg import FedAvgSpec


class FedAvgDropSpec(FedAvgSpec):
    """FedAvg that leaves out every node below capacity 1."""

    name = "fedavg-drop"
    summary = "only nodes with capacity 1 take part, full model (what operators do today)"
    implementation = "common.methods.fedavg_drop:FedAvgDrop"
