"""FedRolex's spec: HeteroFL's published elements with a window that rolls each round.

The method: :mod:`common.methods.fedrolex`.
"""

from __future__ import annotations

from common.methods.specs.heterofl import HeteroFLSpec


class FedRolexSpec(HeteroFLSpec):
    """Rolling-window width submodels."""

    name = "fedrolex"
    summary = (
        "a window of `ceil(r c)` channels rolled by one channel each round (FedRolex), with "
        "HeteroFL's scaler, masked cross-entropy and label-split classifier aggregation"
    )
    default_weighting = "avg"
    implementation = "common.methods.fedrolex:FedRolex"
