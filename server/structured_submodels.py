"""The server side of CA-HFP: channel selection, small-model downloads, reply checks and reconstruction.

Per round and client (maths in :mod:`common.channel_scores`, shapes in
:mod:`common.channel_slicing`):

1. select the kept channels of every group from the per-channel score state
   (weight-norm fallback for channels never measured);
2. send the small model's tensors and the kept channel indices;
3. check the reply against the small shapes that were sent, reconstruct it into
   the full space (missing channels from the current global model) and hand the
   strategy an ordinary :class:`~common.aggregation.MaskedUpdate`, so aggregation is
   the same mask-aware rule as every other method's;
4. after aggregation, fold the accepted clients' channel scores into the state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from common import protocol as P
from common.channel_scores import ChannelReport, ChannelScoreState, channel_sums
from common.channel_slicing import reconstruct, selection_mask, selection_of_mask, slice_arrays
from common.layout import ParamLayout
from common.width_masks import TensorChannels, group_sizes
from server.validation import ReplyError, SentSubmodel, TrainReply, check_meta, validate_train_reply


@dataclass(frozen=True)
class StructuredReply(TrainReply):
    """A validated CA-HFP reply: the reconstructed update plus the client's channel scores."""

    report: ChannelReport


@dataclass(frozen=True)
class StructuredPayload:
    """One client's CA-HFP download.

    Parameters
    ----------
    arrays : dict[str, NDArray[float32]]
        The small model's tensors by full-model name.
    channels : dict[str, NDArray]
        Kept channel indices per group (:func:`common.protocol.encode_channels`).
    digest : str
        :func:`common.protocol.channels_digest` of ``channels``.
    """

    arrays: dict[str, NDArray[np.float32]]
    channels: dict[str, NDArray]
    digest: str

    @property
    def values_bytes(self) -> int:
        """Bytes of the small model's values."""
        return int(sum(a.nbytes for a in self.arrays.values()))

    @property
    def channels_bytes(self) -> int:
        """Bytes of the kept channel indices."""
        return int(sum(a.nbytes for a in self.channels.values()))


class StructuredSubmodels:
    """CA-HFP's per-channel score state and the conversions between full and small models.

    Parameters
    ----------
    layout : ParamLayout
        Flat layout of the global model.
    graph : Mapping[str, TensorChannels]
        Its channel graph (:func:`common.width_masks.channel_graph`).
    """

    def __init__(self, layout: ParamLayout, graph: Mapping[str, TensorChannels]) -> None:
        self.layout = layout
        self.graph = graph
        self.sizes = group_sizes(layout, graph)
        self.state = ChannelScoreState.empty(self.sizes)

    def mask_for(self, x: NDArray[np.float32], gamma: float) -> tuple[NDArray[np.bool_], str]:
        """Held positions of a capacity-``gamma`` submodel and the rule that chose them.

        The source is ``curvature`` once any channel has a score, else ``norm``
        (first round: squared weight norm of each channel).
        """
        norms = channel_sums(self.layout, self.graph, np.square(x, dtype=np.float64))
        selection = self.state.select(norms, gamma)
        return selection_mask(self.layout, self.graph, selection), "curvature" if self.state.any_measured else "norm"

    def encode(self, x: NDArray[np.float32], mask: NDArray[np.bool_]) -> StructuredPayload:
        """The small model for the channel mask ``mask`` (from :meth:`mask_for`) at global values ``x``."""
        selection = selection_of_mask(self.layout, self.graph, mask)
        arrays = slice_arrays(self.layout, self.graph, selection, self.layout.unflatten(x))
        channels = P.encode_channels(selection, self.sizes)
        return StructuredPayload(arrays, channels, P.channels_digest(channels))

    def validate_reply(
        self,
        arrays: Mapping[str, NDArray] | None,
        metrics: Mapping[str, Any] | None,
        meta: Mapping[str, Any] | None,
        sent: SentSubmodel,
        x: NDArray[np.float32],
        upload_encoding: str,
    ) -> StructuredReply:
        """Check a TRAIN reply against the small model sent and reconstruct it; ``ReplyError`` says why not.

        Parameters
        ----------
        arrays : Mapping[str, NDArray] or None
            The reply's ``update`` arrays: trained small tensors and ``score.<group>``.
        metrics, meta : Mapping or None
            The reply's ``metrics`` and ``meta`` records.
        sent : SentSubmodel
            What this node was sent (its ``mask`` is the channel mask).
        x : NDArray[float32]
            The global model the submodel was cut from (fills the channels the client did not hold).
        upload_encoding : str
            The run's Fisher upload encoding (``none`` for CA-HFP).
        """
        check_meta(meta, sent)
        if arrays is None:
            raise ReplyError(f"array record {P.UPDATE!r} missing")
        selection = selection_of_mask(self.layout, self.graph, sent.mask)
        tensors = {n: a for n, a in arrays.items() if not n.startswith(P.SCORE_PREFIX)}
        score_arrays = {n: a for n, a in arrays.items() if n.startswith(P.SCORE_PREFIX)}
        expected = {P.score_name(g) for g in self.sizes}
        if set(score_arrays) != expected:
            raise ReplyError(f"channel scores {sorted(score_arrays)} differ from the expected {sorted(expected)}")
        scores = {}
        for g, idx in selection.items():
            s = np.asarray(score_arrays[P.score_name(g)])
            if s.dtype != np.float32 or s.shape != idx.shape or not np.all(np.isfinite(s)):
                raise ReplyError(
                    f"scores of group {g!r} must be {idx.size} finite float32 values, got {s.dtype}{list(s.shape)}"
                )
            scores[g] = s.astype(np.float64)
        try:
            full, mask = reconstruct(self.layout, self.graph, selection, tensors, x)
        except ValueError as err:
            raise ReplyError(f"small model rejected: {err}") from err
        delta = (full[mask] - x[mask]).astype(np.float32)
        base = validate_train_reply({P.DELTA: delta}, metrics, meta, sent, self.layout, upload_encoding)
        report = ChannelReport(selection, scores, base.update.weight)
        return StructuredReply(base.update, base.fisher, base.metrics, report)

    def record_scores(self, replies: Sequence[TrainReply]) -> None:
        """Fold the channel scores of the replies that were aggregated into the state."""
        self.state.update([r.report for r in replies if isinstance(r, StructuredReply)])
