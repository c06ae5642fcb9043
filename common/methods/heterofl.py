"""HeteroFL: the first ``ceil(r c)`` channels of every hidden layer, ``r = sqrt(gamma)``, trained as
published.

The channel graph of the architecture (:mod:`common.submodels.width`) keeps residual sums and their
shortcuts on the same channels; input and output channels of the model stay whole. Besides the
slice, the published code (diaoenmao/HeteroFL, ``src/config.yml`` with ``norm: bn``, ``scale: 1``,
``mask: 1``) has the elements below, each a key here with the published default (``width-*``, shared
with FedRolex, or a common key whose ``auto`` is the published value):

* ``scaler``: in local training every convolution's output is divided by the submodel's width rate
  (:class:`common.models.architectures.Scaler`); the client reads the rate off the mask it was sent
  (:func:`common.submodels.width.held_width`). Evaluation is unscaled. The published convolutional
  model scales its conv blocks only (conv -> scaler -> norm); the CNNs' hidden linear layer, which
  has no norm after it and no published counterpart, is scaled only with ``scaler-linear``.
* ``label-mask`` (common, ``auto`` = on): masked cross-entropy, the logits of classes absent from
  the client's data set to 0.
* ``clip-grad-norm`` (common, ``auto`` = 1): local training clips each step's gradient to L2 norm 1
  (``clip_grad_norm_``).
* ``label-split``: the client reports which classes it holds (``classes`` in the reply) and the
  server averages each classifier row only over the clients that hold its class
  (:mod:`common.submodels.label_split`).
* ``weighting``: the published ``combine`` counts every client once (``uniform``); ``examples``
  weights by local training examples like the other methods.

Static BatchNorm comes with the model (``model = "cnn-bn"`` or ``"resnet18"``,
:mod:`common.models.architectures`). The published code also recomputes BatchNorm statistics on the
server from training data before it tests (``sBN``); here the server holds no training data, and
static BatchNorm evaluates with the statistics of each test batch. The table of published elements:
``docs/design/fidelity-width.md``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray

from common.data.arrays import ArrayDataset
from common.fisher.codec import encode_fisher
from common.methods.channels import ChannelMethod
from common.methods.contract.payloads import LocalUpdate, Received
from common.methods.masked import MaskedMethod, decode_received
from common.methods.specs.heterofl import WIDTH_KEYS, HeteroFLSpec, WidthOptions
from common.models.architectures import set_scaler_rate
from common.models.layout import ParamLayout
from common.submodels.label_split import (
    CLASSES,
    check_class_flags,
    class_of_position,
    num_outputs,
    restrict_to_classes,
)
from common.submodels.width import channel_graph, held_width, width_mask, width_ratio
from common.training.loop import TrainConfig, train_masked
from common.wire import protocol as P
from common.wire.validation import ReplyError, ReplyRecords, SentSubmodel, TrainReply

if TYPE_CHECKING:
    from common.config.run import RunConfig


class HeteroFL(HeteroFLSpec, ChannelMethod, MaskedMethod):
    """First-channels width submodels."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: WidthOptions = run.options(WIDTH_KEYS.name)
        self.weighting = (
            self.opts.weighting if self.opts.weighting != "auto" else self.default_weighting
        )

    def describe(self) -> str:
        """Method and the published elements switched on."""
        o = self.opts
        return (
            f"method={self.name} scaler={o.scaler} scaler-linear={o.scaler_linear} "
            f"label-mask={self.run.label_mask} "
            f"label-split={o.label_split} clip-grad={self.run.clip_grad_norm:g} "
            f"weighting={self.weighting}"
        )

    def roll(self, server_round: float) -> int:
        """Channels the window is shifted by in ``server_round`` (HeteroFL: never)."""
        return 0

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The channel window of width ratio ``sqrt(gamma)`` (``width``)."""
        return width_mask(
            self.layout, self.graph, width_ratio(gamma), self.roll(server_round)
        ), "width"

    def start_server(self, layout: ParamLayout) -> None:
        """The channel graph, and which flat positions belong to which classifier row."""
        super().start_server(layout)
        self.position_class = class_of_position(layout)
        self.num_classes = num_outputs(layout)

    def validate(
        self, reply: ReplyRecords, sent: SentSubmodel, x: NDArray[np.float32]
    ) -> TrainReply:
        """The masked reply; with label split, its ``classes`` too, and the classifier rows cut to
        them."""
        flags = None
        arrays = reply.arrays
        if arrays is not None and self.opts.label_split:
            arrays = dict(arrays)
            if CLASSES not in arrays:
                raise ReplyError(f"array {CLASSES!r} missing (width-label-split is on)")
            try:
                flags = check_class_flags(arrays.pop(CLASSES), self.num_classes)
            except ValueError as err:
                raise ReplyError(str(err)) from err
        checked = super().validate(ReplyRecords(arrays, reply.metrics, reply.meta), sent, x)
        update = checked.update
        if flags is not None:
            update = restrict_to_classes(update, self.position_class, flags)
        if self.weighting != "examples":
            update = replace(update, weight=1.0)
        return replace(checked, update=update)

    # -------------------------------------------------------------- client side
    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train the width submodel with the scaler and masked cross-entropy; report the classes
        held."""
        model, layout = self._model(train)
        params, mask = decode_received(received, layout)
        if self.opts.scaler:
            rate = held_width(layout, channel_graph(self.run.model, layout), mask)
            set_scaler_rate(model, rate, hidden_linear=self.opts.scaler_linear)
        encoding = self.upload_encoding(self.run)
        result = train_masked(
            model, layout, params, mask, train, cfg, device, measure_fisher=encoding != "none"
        )
        arrays = {P.DELTA: (result.params[mask] - params[mask]).astype(np.float32)}
        arrays.update(encode_fisher(result.fisher, mask, layout, encoding))
        if self.opts.label_split:
            counts = np.bincount(train.y, minlength=train.num_classes)[: train.num_classes]
            arrays[CLASSES] = (counts > 0).astype(np.uint8)
        return LocalUpdate(
            arrays, result.num_examples, result.loss, result.train_seconds, result.fisher_seconds
        )
