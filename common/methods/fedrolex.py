"""FedRolex: HeteroFL's width window, rolled by one channel each round so every channel gets trained."""

from __future__ import annotations

from common.methods import register
from common.methods.heterofl import HeteroFL


@register
class FedRolex(HeteroFL):
    """Rolling-window width submodels."""

    name = "fedrolex"
    summary = "a window of `ceil(r c)` channels rolled by one channel each round (FedRolex)"

    def roll(self, server_round: float) -> int:
        """The window starts ``server_round`` channels in (wrapping around)."""
        return int(server_round)
