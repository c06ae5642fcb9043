"""What both sides of a method share: the run it was built for, the model it federates and the
round-0 mask both sides compute alike."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.methods.contract.spec import MethodSpec

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray
    from torch import nn

    from common.config.run import RunConfig
    from common.models.layout import ParamLayout


class MethodCore(MethodSpec):
    """A method bound to one run: the part its server side
    (:class:`~common.methods.contract.server_side.ServerMethod`) and its client side
    (:class:`~common.methods.contract.client_side.ClientMethod`) share.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration.
    """

    #: Whether this class is the implementation itself (a spec names its implementation instead).
    is_implementation = True

    def __init__(self, run: RunConfig) -> None:
        self.run = run

    def federated_model(self, model: nn.Module) -> nn.Module:
        """The model whose trainable parameters are the federated vector, built from the run's
        ``model``.

        The server builds its global model (and its evaluator) through this, and a node the model it
        trains; the default is ``model`` itself. A method that federates something else (LoRA
        adapters on a frozen base) wraps it here.
        """
        return model

    def opening_mask(
        self, layout: ParamLayout, x: NDArray[np.float32], gamma: float
    ) -> NDArray[np.bool_]:
        """The round-0 mask of a node of capacity ``gamma`` in a fresh run, from the initial model
        ``x`` alone.

        Defined by the methods whose warm-up rides on discovery
        (:meth:`~common.methods.contract.server_side.ServerMethod.opening`): the mask the server
        would choose in round 0 with no Fisher yet, computed alike on the server and on the node
        (the server checks the digest).
        """
        raise NotImplementedError(
            f"{self.name} has no opening mask: its warm-up is an exchange of its own"
        )
