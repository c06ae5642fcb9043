"""The rule every method that selects whole channels shares: the model needs a channel graph."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.methods.contract.spec import MethodSpec
from common.submodels.width import require_channel_graph

if TYPE_CHECKING:
    from common.config.run import RunConfig


class ChannelSpec(MethodSpec):
    """A method whose submodels are made of whole channels (HeteroFL, FedRolex, CA-HFP).

    Such a method only runs on a model with a channel graph
    (:data:`common.submodels.width.WIDTH_MODELS`).
    """

    @classmethod
    def check_run(cls, run: RunConfig) -> None:
        """The model needs a channel graph."""
        require_channel_graph(run.method, run.model)
