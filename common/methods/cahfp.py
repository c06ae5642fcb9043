"""CA-HFP: physically smaller client models, channels chosen by a curvature-aware score, rebuilt on
the server.

Per round and client (maths in :mod:`common.submodels.channel_scores`, shapes in
:mod:`common.submodels.channel_slicing`):

1. the server selects the kept channels of every channel group, the top ``ceil(r c)`` by the
   client's score state (``r = sqrt(gamma)``; squared weight norm for channels never measured);
2. it sends the small model's tensors and the kept channel indices;
3. the client builds the small model without ever allocating the full one (the architecture on
   PyTorch's ``meta`` device), trains it with the one training loop, and accumulates the mean
   gradient ``g`` and the mean squared gradient ``h`` of every held weight
   (:class:`common.training.loop.GradientMoments`); it replies with the trained small tensors and
   each held channel's score ``|sum g w| + sum h w^2``;
4. the server checks the reply against the small shapes sent, reconstructs it into the full space
   (missing channels from the current global model) and aggregates (``cahfp-aggregation``):
   ``fedavg`` is FedAvg over the reconstructed models, ``x + sum_k p_k M_k delta_k`` with ``p_k``
   the example share of the round's participants
   (:func:`common.aggregation.update_means.participant_mean_step`); ``holders`` is the mask-aware
   mean over the clients that held each position
   (:func:`common.aggregation.masked.aggregate_masked`);
5. it folds the accepted clients' channel scores into the pooled state and, with ``cahfp-scores =
   "client"``, each into that client's own state (at most ``cahfp-score-memory-mb`` of them, least
   recent evicted), so clients of equal capacity hold different channels
   (:class:`common.submodels.channel_scores.ClientChannelScores`); a channel a client never measured
   ranks by the pooled score (:func:`common.submodels.channel_scores.personal_state`).

Design notes and measurements: ``docs/design/cahfp.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.typing import NDArray
from torch import nn

from common.aggregation.masked import aggregate_masked
from common.aggregation.update_means import participant_mean_step
from common.data.arrays import ArrayDataset
from common.methods.channels import ChannelMethod
from common.methods.contract.payloads import Download, LocalUpdate, Received
from common.methods.round_fold import Accepted
from common.methods.specs.cahfp import CAHFPOptions, CAHFPSpec
from common.models.architectures import build_model
from common.models.layout import ParamLayout
from common.models.structured import build_structured_model, skeleton_layout
from common.submodels.channel_scores import (
    ChannelReport,
    ChannelScoreState,
    ClientChannelScores,
    channel_scores,
    channel_sums,
    personal_state,
    score_capacity,
)
from common.submodels.channel_slicing import (
    CHANNELS,
    CHANNELS_KIND,
    channels_digest,
    check_small_arrays,
    decode_channels,
    encode_channels,
    reconstruct,
    selection_mask,
    selection_of_mask,
    slice_arrays,
    sliced_layout,
)
from common.submodels.width import TensorChannels, channel_graph, group_sizes
from common.training.loop import TrainConfig
from common.training.structured import SmallTrainResult, train_small
from common.wire import protocol as P
from common.wire.validation import (
    ReplyError,
    ReplyRecords,
    SentSubmodel,
    TrainReply,
    check_meta,
    validate_train_reply,
)

if TYPE_CHECKING:
    from common.config.run import RunConfig


#: A reply's channel scores travel as one array per channel group, named ``score.<group>``.
SCORE_PREFIX = "score."


def score_name(group: str) -> str:
    """Array name of a group's channel scores in a CA-HFP reply."""
    return SCORE_PREFIX + group


@dataclass(frozen=True)
class StructuredReply(TrainReply):
    """A validated CA-HFP reply: the reconstructed update plus the client's channel scores."""

    report: ChannelReport


@dataclass(frozen=True)
class ReceivedSmallModel:
    """A decoded and checked CA-HFP download, on the client."""

    model: nn.Module
    small_layout: ParamLayout
    graph: Mapping[str, TensorChannels]
    arrays: dict[str, NDArray[np.float32]]


def reply_arrays(
    small_layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    received: Mapping[str, NDArray[np.float32]],
    result: SmallTrainResult,
) -> dict[str, NDArray[np.float32]]:
    """The TRAIN reply's arrays: trained small tensors and each held channel's curvature score.

    Parameters
    ----------
    small_layout : ParamLayout
        Layout of the small model (full-model names, small shapes).
    graph : Mapping[str, TensorChannels]
        The architecture's channel graph.
    received : Mapping[str, NDArray[float32]]
        The small weights received, where the score's Taylor expansion is taken.
    result : SmallTrainResult
        Outcome of :func:`common.training.loop.train_small`.
    """
    g = small_layout.flatten(result.grad_mean)
    h = small_layout.flatten(result.fisher)
    sums = channel_scores(small_layout, graph, g, h, small_layout.flatten(received))
    return {
        **result.params,
        **{score_name(group): s.astype(np.float32) for group, s in sums.items()},
    }


class CAHFP(CAHFPSpec, ChannelMethod):
    """Curvature-aware structured pruning with physically smaller client models."""

    def __init__(self, run: RunConfig) -> None:
        super().__init__(run)
        self.opts: CAHFPOptions = run.options(self.name)

    def describe(self) -> str:
        """Method and its settings."""
        return f"method={self.name} scores={self.opts.scores} aggregation={self.opts.aggregation}"

    # -------------------------------------------------------------- server side
    def start_server(self, layout: ParamLayout) -> None:
        """Channel graph, an empty pooled score state and the (empty, bounded) per-client states."""
        super().start_server(layout)
        self.sizes = group_sizes(layout, self.graph)
        self.state = ChannelScoreState.empty(self.sizes)
        self.client_scores = ClientChannelScores(
            self.sizes, score_capacity(self.opts.score_memory_mb, self.sizes)
        )

    def mask_for(
        self, key: str | None, server_round: float, gamma: float, x: NDArray[np.float32]
    ) -> tuple[NDArray[np.bool_], str]:
        """Held positions of the kept channels, ranked by the client's scores (the pooled ones for
        ``key=None``).

        The source is ``client`` when the client has scores of its own, ``curvature`` when only
        pooled scores exist, ``norm`` before any channel was measured.
        """
        norms = channel_sums(self.layout, self.graph, np.square(x, dtype=np.float64))
        own = (
            self.client_scores.get(key)
            if key is not None and self.opts.scores == "client"
            else None
        )
        state = personal_state(own, self.state)
        selection = state.select(norms, gamma)
        source = "client" if own is not None else "curvature" if state.any_measured else "norm"
        return selection_mask(self.layout, self.graph, selection), source

    def encode(self, x: NDArray[np.float32], mask: NDArray[np.bool_]) -> Download:
        """The small model's tensors and the kept channel indices per group."""
        selection = selection_of_mask(self.layout, self.graph, mask)
        arrays = slice_arrays(self.layout, self.graph, selection, self.layout.unflatten(x))
        channels = encode_channels(selection, self.sizes)
        return Download(
            {P.SUBMODEL: arrays, CHANNELS: channels},
            CHANNELS_KIND,
            channels_digest(channels),
            int(sum(a.nbytes for a in arrays.values())),
            int(sum(a.nbytes for a in channels.values())),
        )

    def validate(
        self, reply: ReplyRecords, sent: SentSubmodel, x: NDArray[np.float32]
    ) -> StructuredReply:
        """Check the small tensors and channel scores against what was sent, reconstruct the full
        update."""
        arrays = reply.arrays
        check_meta(reply.meta, sent)
        if arrays is None:
            raise ReplyError(f"array record {P.UPDATE!r} missing")
        selection = selection_of_mask(self.layout, self.graph, sent.mask)
        tensors = {n: a for n, a in arrays.items() if not n.startswith(SCORE_PREFIX)}
        score_arrays = {n: a for n, a in arrays.items() if n.startswith(SCORE_PREFIX)}
        expected = {score_name(g) for g in self.sizes}
        if set(score_arrays) != expected:
            raise ReplyError(
                f"channel scores {sorted(score_arrays)} differ from the expected {sorted(expected)}"
            )
        scores = {}
        for g, idx in selection.items():
            s = np.asarray(score_arrays[score_name(g)])
            if s.dtype != np.float32 or s.shape != idx.shape or not np.all(np.isfinite(s)):
                raise ReplyError(
                    f"scores of group {g!r} must be {idx.size} finite float32 values, got "
                    f"{s.dtype}{list(s.shape)}"
                )
            scores[g] = s.astype(np.float64)
        try:
            full, mask = reconstruct(self.layout, self.graph, selection, tensors, x)
        except ValueError as err:
            raise ReplyError(f"small model rejected: {err}") from err
        delta = (full[mask] - x[mask]).astype(np.float32)
        base, _ = validate_train_reply(
            ReplyRecords({P.DELTA: delta}, reply.metrics, reply.meta), sent, self.layout
        )
        report = ChannelReport(selection, scores, base.update.weight)
        return StructuredReply(base.update, base.fisher, base.metrics, report)

    def aggregate(
        self, x: NDArray[np.float32], accepted: Sequence[Accepted], server_round: int
    ) -> NDArray[np.float32]:
        """``cahfp-aggregation`` over the reconstructed updates, then the channel scores into the
        states."""
        updates = [a.reply.update for a in accepted]
        if self.opts.aggregation == "fedavg":
            new = participant_mean_step(x, updates, self.run.server_lr)
        else:
            new = aggregate_masked(x, updates, self.run.server_lr)
        reports = [
            (a.key, a.reply.report) for a in accepted if isinstance(a.reply, StructuredReply)
        ]
        self.state.update([r for _, r in reports])
        if self.opts.scores == "client":
            for key, report in reports:
                self.client_scores.update(key, report)
        return new

    # -------------------------------------------------------------- client side
    def receive(self, received: Received, train: ArrayDataset) -> ReceivedSmallModel:
        """Decode the download and build the small model; ``ValueError`` when it does not fit this
        architecture."""
        with torch.device("meta"):
            skeleton = build_model(
                self.run.model, train.num_classes, train.in_channels, self.run.seed
            )
        layout = skeleton_layout(skeleton)
        if received.d != layout.size:
            raise ValueError(
                f"server model has d={received.d} but this node builds d={layout.size}: run "
                "configs differ"
            )
        if received.kind != CHANNELS_KIND:
            raise ValueError(
                f"method cahfp expects a {CHANNELS_KIND!r} submodel, got mask-kind "
                f"{received.kind!r}"
            )
        graph = channel_graph(self.run.model, layout)
        channels = dict(received.records[CHANNELS])
        selection = decode_channels(channels, group_sizes(layout, graph))
        arrays = dict(received.records[P.SUBMODEL])
        check_small_arrays(layout, graph, selection, arrays)
        small_layout = sliced_layout(layout, graph, selection)
        return ReceivedSmallModel(
            build_structured_model(skeleton, arrays), small_layout, graph, arrays
        )

    def client_train(
        self, received: Received, train: ArrayDataset, cfg: TrainConfig, device: torch.device
    ) -> LocalUpdate:
        """Train the small model; reply with its trained tensors and per-channel curvature
        scores."""
        got = self.receive(received, train)
        result = train_small(got.model, train, cfg, device)
        arrays = reply_arrays(got.small_layout, got.graph, got.arrays, result)
        return LocalUpdate(
            arrays, result.num_examples, result.loss, result.train_seconds, result.stats_seconds
        )

    def client_model(self, received: Received, train: ArrayDataset) -> nn.Module:
        """The small model as received."""
        return self.receive(received, train).model
