"""What every method that selects whole channels shares: the model's channel graph."""

from __future__ import annotations

from common.methods.contract.method import Method
from common.methods.specs.channels import ChannelSpec
from common.models.layout import ParamLayout
from common.submodels.width import channel_graph


class ChannelMethod(ChannelSpec, Method):
    """A method whose submodels are made of whole channels (HeteroFL, FedRolex, CA-HFP).

    Such a method only runs on a model with a channel graph
    (:class:`~common.methods.specs.channels.ChannelSpec`), and the server keeps that graph as
    ``self.graph``.
    """

    def start_server(self, layout: ParamLayout) -> None:
        """Build the channel graph of the global model."""
        super().start_server(layout)
        self.graph = channel_graph(self.run.model, layout)
