"""HeteroFL's static width slice: the first ``ceil(r c)`` channels of every hidden layer, ``r = sqrt(gamma)``.

The channel graph of the architecture (:mod:`common.width_masks`) keeps residual sums and their
shortcuts on the same channels; input and output channels of the model stay whole.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from common.methods import register
from common.methods.channels import ChannelMethod
from common.methods.masked import MaskedMethod
from common.width_masks import width_mask, width_ratio


@register
class HeteroFL(ChannelMethod, MaskedMethod):
    """First-channels width submodels."""

    name = "heterofl"
    summary = "the first `ceil(r c)` channels of every hidden layer, `r = sqrt(gamma)` (HeteroFL's static slice)"

    def roll(self, server_round: float) -> int:
        """Channels the window is shifted by in ``server_round`` (HeteroFL: never)."""
        return 0

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The channel window of width ratio ``sqrt(gamma)`` (``width``)."""
        return width_mask(self.layout, self.graph, width_ratio(gamma), self.roll(server_round)), "width"
