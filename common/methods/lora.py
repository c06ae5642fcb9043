"""Heterogeneous LoRA: each client fine-tunes adapters whose rank follows its capacity; the base
never travels.

The federated vector is the LoRA factors of every adapted layer at rank ``lora-max-rank`` and the
classification head (:mod:`common.models.hf_lora`); the pretrained weights are frozen, loaded by
every node from ``model-path`` (once: a local folder, or the Hugging Face cache) and never sent. A
client of capacity ``gamma`` holds ``ceil(gamma * lora-max-rank)`` components per adapted layer
(``lora-allocation = "uniform"``), or the same total split across layers in proportion to the Fisher
mass of each layer on its data (``"fisher"``; :func:`common.submodels.lora_ranks.allocate_ranks`);
it builds adapters of exactly those ranks, so its compute, memory and bytes scale with its rank.
Adapters of different ranks are aggregated by the SVD redistribution of FlexLoRA, by HetLoRA's
zero-padding, or per entry over holders (``lora-aggregation``;
:func:`common.submodels.lora_ranks.aggregate_lora`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.aggregation.masked import MaskedUpdate
from common.config.schema import ConfigError
from common.fisher.codec import encode_fisher
from common.methods.contract.method import Method
from common.methods.contract.payloads import LocalUpdate, Received
from common.methods.masked import FisherRankedMethod, decode_received
from common.methods.specs.lora import LoRAOptions, LoRASpec
from common.models.architectures import build_run_model
from common.models.hf_lora import PEFT_PREFIX, add_lora
from common.models.layout import ParamLayout, TensorSpec
from common.submodels.lora_ranks import (
    LoraPair,
    aggregate_lora,
    allocate_ranks,
    held_ranks,
    layer_fisher_mass,
    lora_pairs,
    lora_rank,
    rank_mask,
)
from common.training.accumulators import GradientMoments
from common.training.loop import TrainConfig, train_loop
from common.wire import protocol as P

if TYPE_CHECKING:
    from common.config.run import RunConfig
    from common.data.arrays import ArrayDataset


class LoRA(LoRASpec, FisherRankedMethod):
    """LoRA adapters of capacity-proportional rank on a frozen pretrained model."""

    state_file = "lora_state.npz"

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: LoRAOptions = run.options(self.name)
        self._client_layout: ParamLayout | None = None

    def describe(self) -> str:
        """Method and its settings."""
        o = self.opts
        return (
            f"method=lora max-rank={o.max_rank} alpha={o.alpha:g} aggregation={o.aggregation} "
            f"allocation={o.allocation}"
        )

    def federated_model(self, model: nn.Module) -> nn.Module:
        """``model`` with rank-``lora-max-rank`` adapters, initialised from the run's seed, base
        frozen."""
        return add_lora(model, self.opts.max_rank, self.opts.alpha, self.run.seed)  # type: ignore[arg-type]

    # -------------------------------------------------------------- server side
    def start_server(self, layout: ParamLayout) -> None:
        """Find the adapted layers; ``lora-max-rank`` must not exceed any layer's smaller
        dimension."""
        super().start_server(layout)
        self.pairs = lora_pairs(layout)
        check_rank_fits(self.pairs, self.opts.max_rank)

    def layer_ranks(
        self, key: str | None, server_round: float, gamma: float
    ) -> tuple[dict[str, int], str]:
        """Each adapted layer's rank for a client, and what decided it (``uniform``, ``client``,
        ``prior``)."""
        r = lora_rank(gamma, self.opts.max_rank)
        uniform = {p.layer: r for p in self.pairs}
        if self.opts.allocation == "uniform":
            return uniform, "uniform"
        est, source = self.client_estimate(key, int(server_round))
        if est is None:
            return uniform, "uniform"
        ranks = allocate_ranks(
            layer_fisher_mass(est, self.layout, self.pairs), r * len(self.pairs), self.opts.max_rank
        )
        return {p.layer: int(k) for p, k in zip(self.pairs, ranks)}, source

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """The first components of every adapted layer at the client's ranks, and the whole head."""
        ranks, source = self.layer_ranks(key, server_round, gamma)
        return rank_mask(self.layout, self.pairs, ranks), source

    def mean_step(
        self, x: NDArray[np.float32], updates: Sequence[MaskedUpdate]
    ) -> NDArray[np.float32]:
        """``lora-aggregation`` over the accepted adapters (the base class then updates the Fisher
        state)."""
        return aggregate_lora(
            x, self.layout, self.pairs, updates, self.opts.aggregation, self.run.server_lr
        )

    def running_sum(self) -> None:
        """None: FlexLoRA's SVD and HetLoRA's padding need every adapter of the round at once
        (buffered)."""
        return None

    # -------------------------------------------------------------- client side
    def _federated_layout(self, train: ArrayDataset) -> ParamLayout:
        """The federated vector's layout, from the architecture alone (built on the meta device, no
        weights)."""
        if self._client_layout is None:
            with torch.device("meta"):
                skeleton = self.federated_model(
                    build_run_model(self.run, train.num_classes, 1, skeleton=True)
                )
            self._client_layout = ParamLayout(
                tuple(
                    TensorSpec(n, tuple(p.shape))
                    for n, p in skeleton.named_parameters()
                    if p.requires_grad
                )
            )
        return self._client_layout

    def _adapted(
        self, received: Received, train: ArrayDataset
    ) -> tuple[nn.Module, ParamLayout, NDArray[np.float32], NDArray[np.bool_]]:
        """The client's model with adapters of the received ranks holding the received values."""
        layout = self._federated_layout(train)
        params, mask = decode_received(received, layout)
        pairs = lora_pairs(layout)
        check_rank_fits(pairs, self.opts.max_rank)
        ranks = held_ranks(layout, pairs, mask)
        model = add_lora(
            build_run_model(self.run, train.num_classes, 1),
            self.opts.max_rank,
            self.opts.alpha,
            self.run.seed,
            ranks,
        )  # type: ignore[arg-type]
        load_held(model, layout, params, ranks)
        return model, layout, params, mask

    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train the adapters of the received ranks (and the head); reply with their change and, if
        read, Fisher."""
        start = time.perf_counter()
        model, layout, params, mask = self._adapted(received, train)
        encoding = self.upload_encoding(self.run)
        model.to(device)  # the Fisher sums live where the gradients are
        moments = GradientMoments(model) if encoding != "none" else None
        result = train_loop(model, train, cfg, device, [moments] if moments else [])
        trained = padded_flat(model, layout)
        arrays = {P.DELTA: (trained[mask] - params[mask]).astype(np.float32)}
        if moments is not None:
            arrays.update(
                encode_fisher(padded_flat_arrays(moments.fisher(), layout), mask, layout, encoding)
            )
        seconds = time.perf_counter() - start
        return LocalUpdate(arrays, result.num_examples, result.loss, seconds, result.stats_seconds)

    def client_model(self, received: Received, train: ArrayDataset) -> nn.Module:
        """The pretrained model with the received adapters and head."""
        return self._adapted(received, train)[0]

    # The adapters and the head adapt, as they train; the base stays frozen (not a masked dense
    # model).
    client_adapt = Method.client_adapt


def check_rank_fits(pairs: Sequence[LoraPair], max_rank: int) -> None:
    """``ConfigError`` naming ``lora-max-rank`` when it exceeds an adapted layer's smaller dimension
    (or none is)."""
    if not pairs:
        raise ConfigError("method='lora': the model has no adapted layers")
    smallest = min(pairs, key=lambda p: min(p.fan_in, p.fan_out))
    if max_rank > min(smallest.fan_in, smallest.fan_out):
        raise ConfigError(
            f"lora-max-rank={max_rank}: above the dimension of layer "
            f"{smallest.layer.removeprefix(PEFT_PREFIX)!r} ({smallest.fan_out} x "
            f"{smallest.fan_in}); at most {min(smallest.fan_in, smallest.fan_out)}"
        )


def load_held(
    model: nn.Module, layout: ParamLayout, params: NDArray[np.float32], ranks: dict[str, int]
) -> None:
    """Copy the federated values into a model whose adapters have ``ranks`` (leading components of
    each factor)."""
    named = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in layout.unflatten(np.asarray(params, dtype=np.float32)).items():
            target = named[name]
            piece = value[tuple(slice(0, s) for s in target.shape)]
            target.copy_(torch.from_numpy(np.ascontiguousarray(piece)))


def padded_flat_arrays(arrays: dict[str, NDArray], layout: ParamLayout) -> NDArray[np.float32]:
    """Arrays of a lower-rank client model, zero-padded to the federated shapes and flattened in
    layout order."""
    out = []
    for t in layout.tensors:
        full = np.zeros(t.shape, dtype=np.float32)
        a = np.asarray(arrays[t.name], dtype=np.float32)
        full[tuple(slice(0, s) for s in a.shape)] = a
        out.append(full.reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, dtype=np.float32)


def padded_flat(model: nn.Module, layout: ParamLayout) -> NDArray[np.float32]:
    """The model's trained values (adapters and head) as a flat federated vector, zero where it
    holds nothing."""
    named = dict(model.named_parameters())
    return padded_flat_arrays({n: named[n].detach().cpu().numpy() for n in layout.names}, layout)
