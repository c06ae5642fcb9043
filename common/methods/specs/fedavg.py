"""FedAvg, and FedAvg over the full-capacity nodes only: no keys of their own.

The methods: :mod:`common.methods.fedavg` and :mod:`common.methods.fedavg_drop`.
"""

from __future__ import annotations

from common.methods.specs.base import MethodSpec
from common.methods.specs.privacy import PRIVACY_KEYS
from common.methods.specs.robust import ROBUST_KEYS


class FedAvgSpec(MethodSpec):
    """The full model for everyone; the mask-aware mean is then plain FedAvg."""

    name = "fedavg"
    summary = "everyone trains the full model, whatever its capacity (the accuracy ceiling)"
    shared_key_groups = (PRIVACY_KEYS, ROBUST_KEYS)
    implementation = "common.methods.fedavg:FedAvg"


class FedAvgDropSpec(FedAvgSpec):
    """FedAvg that leaves out every node below capacity 1."""

    name = "fedavg-drop"
    summary = "only nodes with capacity 1 take part, full model (what operators do today)"
    implementation = "common.methods.fedavg_drop:FedAvgDrop"
