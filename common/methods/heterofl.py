"""HeteroFL's static width slice: the first ``ceil(r c)`` channels of every hidden layer, ``r = sqrt(gamma)``.

The channel graph of the architecture (:mod:`common.width_masks`) keeps residual sums and their
shortcuts on the same channels; input and output channels of the model stay whole.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from common.layout import ParamLayout
from common.methods import register
from common.methods.masked import MaskedMethod
from common.width_masks import channel_graph, require_channel_graph, width_mask, width_ratio

if TYPE_CHECKING:
    from common.config import RunConfig


@register
class HeteroFL(MaskedMethod):
    """First-channels width submodels."""

    name = "heterofl"
    summary = "the first `ceil(r c)` channels of every hidden layer, `r = sqrt(gamma)` (HeteroFL's static slice)"

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """The model needs a channel graph."""
        require_channel_graph(run.method, run.model)

    def start_server(self, layout: ParamLayout) -> None:
        """Build the channel graph of the global model."""
        super().start_server(layout)
        self.graph = channel_graph(self.run.model, layout)

    def roll(self, server_round: float) -> int:
        """Channels the window is shifted by in ``server_round`` (HeteroFL: never)."""
        return 0

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The channel window of width ratio ``sqrt(gamma)`` (``width``)."""
        return width_mask(self.layout, self.graph, width_ratio(gamma), self.roll(server_round)), "width"
