"""FedRolex: HeteroFL's width window, rolled by one channel each round so every channel gets trained.

The published code (AIoT-MLSys-Lab/FedRolex, ``resnet_server.py``, ``ResnetServerRoll.split_model``)
takes in every hidden layer the window ``roll(arange(c), round mod c)[:ceil(r c)]``; this window starts
``round mod c`` channels in and advances the other way round, which trains the same channels equally
often. Everything else is HeteroFL's, with the same published defaults (its ``config.yml``: ``norm: bn``,
``scale: 1``, ``mask: 1``; ``combine`` with ``label_split``), under the keys ``fedrolex-*``.
"""

from __future__ import annotations

from common.methods import register
from common.methods.heterofl import HeteroFL


@register
class FedRolex(HeteroFL):
    """Rolling-window width submodels."""

    name = "fedrolex"
    summary = (
        "a window of `ceil(r c)` channels rolled by one channel each round (FedRolex), with HeteroFL's "
        "scaler, masked cross-entropy and label-split classifier aggregation"
    )
    options_prefix = "fedrolex-"

    def roll(self, server_round: float) -> int:
        """The window starts ``server_round`` channels in (wrapping around)."""
        return int(server_round)
