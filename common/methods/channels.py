"""What every method that selects whole channels shares: the model's channel graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.methods.base import Method
from common.models.layout import ParamLayout
from common.submodels.width import channel_graph, require_channel_graph

if TYPE_CHECKING:
    from common.config.run import RunConfig


class ChannelMethod(Method):
    """A method whose submodels are made of whole channels (HeteroFL, FedRolex, CA-HFP).

    Such a method only runs on a model with a channel graph (:data:`common.submodels.width.WIDTH_MODELS`),
    and the server keeps that graph as ``self.graph``.
    """

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """The model needs a channel graph."""
        require_channel_graph(run.method, run.model)

    def start_server(self, layout: ParamLayout) -> None:
        """Build the channel graph of the global model."""
        super().start_server(layout)
        self.graph = channel_graph(self.run.model, layout)
