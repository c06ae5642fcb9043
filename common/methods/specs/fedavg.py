"""FedAvg's spec: no keys of its own.

The method: :mod:`common.methods.fedavg`.
"""

from __future__ import annotations

from common.methods.contract.spec import MethodSpec
from common.methods.specs.privacy import PRIVACY_KEYS
from common.methods.specs.robust import ROBUST_KEYS


class FedAvgSpec(MethodSpec):
    """The full model for everyone; the mask-aware mean is then plain FedAvg."""

    name = "fedavg"
    summary = "everyone trains the full model, whatever its capacity (the accuracy ceiling)"
    shared_key_groups = (PRIVACY_KEYS, ROBUST_KEYS)
    implementation = "common.methods.fedavg:FedAvg"
