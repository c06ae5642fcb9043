"""The client side of a method: how a node trains, evaluates and adapts what it received.

The ClientApp (:mod:`client.app`) holds a method as a :class:`ClientMethod` and calls only what it
declares (``tests/test_architecture.py`` checks it). The method owns its reply's payload: it packs
it here (:meth:`ClientMethod.client_train`) and its server side checks and decodes it
(:meth:`~common.methods.contract.server_side.ServerMethod.validate`). Flower never appears here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.methods.contract.core import MethodCore
from common.methods.contract.payloads import LocalUpdate, Received
from common.training.personalisation import adapt

if TYPE_CHECKING:
    import numpy as np
    import torch
    from numpy.typing import NDArray
    from torch import nn

    from common.data.arrays import ArrayDataset
    from common.training.loop import TrainConfig


class ClientMethod(MethodCore):
    """A node's contract with a method. Implementations override what differs.

    Parameters
    ----------
    run : RunConfig
        The validated run configuration.
    """

    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train what was received on the local split ``train``; the reply's arrays and metrics."""
        raise NotImplementedError

    def client_model(self, received: Received, train: ArrayDataset) -> nn.Module:
        """The model a node evaluates: the received submodel (``train`` gives the label space)."""
        raise NotImplementedError

    def client_adapt(
        self,
        received: Received,
        train: ArrayDataset,
        steps: int,
        cfg: TrainConfig,
        device: torch.device,
    ) -> nn.Module:
        """The received submodel after ``steps`` SGD steps on the local split ``train``
        (``adapt-steps``).

        Default: every trainable parameter of :meth:`client_model` adapts (a small model, adapters
        and head).
        """
        return adapt(self.client_model(received, train), train, steps, cfg, device)

    def opening_received(
        self, train: ArrayDataset, x: NDArray[np.float32], gamma: float
    ) -> Received:
        """The round-0 TRAIN download a node of capacity ``gamma`` would get, built on the node from
        the initial model ``x`` of the discovery message (methods whose
        :meth:`~common.methods.contract.server_side.ServerMethod.opening` is ``discovery``)."""
        raise NotImplementedError(f"{self.name} does not fold its warm-up into discovery")

    def round_one_received(
        self,
        train: ArrayDataset,
        x: NDArray[np.float32],
        gamma: float,
        opening: Received,
        warm_up: LocalUpdate,
    ) -> Received:
        """The round-1 TRAIN download a node of capacity ``gamma`` would get after its warm-up
        ``warm_up`` (measured on ``opening``, :meth:`opening_received`), built on the node
        (:meth:`~common.methods.contract.server_side.ServerMethod.opening`
        ``discovery+round-one``)."""
        raise NotImplementedError(f"{self.name} does not train round 1 with discovery")
