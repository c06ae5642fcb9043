"""FIARSE: importance-aware submodels by one magnitude threshold, the mask following the weights in
the round.

As the published code does it (maths in :mod:`common.submodels.threshold`):

1. **Server, per client**: ``theta`` = the ``max(1, floor(gamma n))``-th largest ``|x_j|`` over the
   ``n`` gated positions (convolution, linear and embedding weights and biases); the client holds
   every gated position with ``|x_j| >= theta`` and every normalisation parameter. No per-row guard
   (``min-per-row`` does not apply).
2. **Client**: the threshold is recovered from the download (its smallest held gated magnitude);
   each gated tensor is trained as ``w * 1[|w| >= theta]``, recomputed at every step, so held
   weights that shrink below ``theta`` drop out inside the round. The weights get the plain masked
   gradient ``1[|w| >= theta] * g``, as the published code computes it (its ``Bern`` returns a bool
   tensor, so autograd never calls the surrogate backward); ``fiarse-surrogate = true`` trains
   through the surrogate gradient ``2 theta / (|w| + theta)^2`` of the indicator instead (the
   paper's text). The reply is the delta of the held positions.
3. **Server aggregation** (``fiarse-aggregation``): ``nonzero`` (published) moves each position by
   ``server-lr * sum delta / count(delta != 0)``, unweighted; ``holders`` is the example-weighted
   mean over the clients that held it (the rule the other element-wise methods use).

Central evaluation of a capacity level uses the same threshold mask, as the published evaluation
does.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate, aggregate_masked
from common.aggregation.running_sums import HolderSum, NonzeroSum, RunningSum
from common.aggregation.update_means import nonzero_mean_step
from common.data.arrays import ArrayDataset
from common.methods.contract.payloads import LocalUpdate, Received
from common.methods.masked import MaskedMethod, decode_received
from common.methods.specs.fiarse import FIARSEOptions, FIARSESpec
from common.models.architectures import build_run_model, load_flat
from common.models.layout import ParamLayout
from common.submodels.threshold import (
    attach_threshold_gates,
    detach_threshold_gates,
    gated_names,
    gated_positions,
    received_threshold,
    threshold_for,
    threshold_mask,
)
from common.training.loop import TrainConfig, train_loop
from common.wire import protocol as P

if TYPE_CHECKING:
    from common.config.run import RunConfig


class FIARSE(FIARSESpec, MaskedMethod):
    """Threshold submodels, in-round re-masking, non-zero-count aggregation."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: FIARSEOptions = run.options(self.name)

    def describe(self) -> str:
        """Method and its settings."""
        return (
            f"method={self.name} surrogate={self.opts.surrogate} "
            f"aggregation={self.opts.aggregation}"
        )

    # -------------------------------------------------------------- server side
    def start_server(self, layout: ParamLayout) -> None:
        """Find the gated positions of the architecture (module types only: built on the meta
        device)."""
        super().start_server(layout)
        with torch.device("meta"):
            probe = build_run_model(self.run, 2, 1, skeleton=True)
        self.gated = gated_positions(layout, gated_names(probe))

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """Every ungated position and the gated ones at or above the capacity's threshold
        (``threshold``)."""
        return threshold_mask(x, self.gated, threshold_for(x, self.gated, gamma)), "threshold"

    def mean_step(
        self, x: NDArray[np.float32], updates: Sequence[MaskedUpdate]
    ) -> NDArray[np.float32]:
        """``fiarse-aggregation``: the non-zero-count mean (published) or the holder mean."""
        if self.opts.aggregation == "nonzero":
            return nonzero_mean_step(x, updates, self.run.server_lr)
        return aggregate_masked(x, updates, self.run.server_lr)

    def running_sum(self) -> RunningSum:
        """:meth:`mean_step` one reply at a time."""
        assert self.layout is not None, "start_server() first"
        if self.opts.aggregation == "nonzero":
            return NonzeroSum(self.layout.size, self.run.server_lr)
        return HolderSum(self.layout.size, self.run.server_lr)

    # -------------------------------------------------------------- client side
    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train the gated model ``w * 1[|w| >= theta]``; reply with the change of the held
        positions."""
        start = time.perf_counter()
        model, layout = self._model(train)
        params, mask = decode_received(received, layout)
        names = gated_names(model)
        theta = received_threshold(params, gated_positions(layout, names), mask)
        load_flat(model, layout, params)
        model.to(device)
        gates = attach_threshold_gates(model, names, theta, self.opts.surrogate)
        result = train_loop(model, train, cfg, device)
        detach_threshold_gates(gates)
        named = dict(model.named_parameters())
        trained = np.concatenate(
            [named[n].detach().cpu().numpy().reshape(-1) for n in layout.names]
        )
        delta = (trained[mask] - params[mask]).astype(np.float32)
        return LocalUpdate(
            {P.DELTA: delta}, result.num_examples, result.loss, time.perf_counter() - start, 0.0
        )
