"""CA-HFP's TRAIN and EVALUATE handlers: receive a small model, train or evaluate it, reply.

The client never allocates the full model: the architecture is instantiated on
PyTorch's ``meta`` device (shapes only) and the small model is built from the
received arrays (:mod:`common.structured_models`). Wire format: :mod:`common.protocol`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from numpy.typing import NDArray
from torch import nn

from client.device import pick_device
from client.local_data import LocalData
from client.replies import train_reply
from client.structured_training import StructuredTrainResult, train_small
from client.training import evaluate, round_train_config
from common import protocol as P
from common.channel_scores import channel_scores
from common.channel_slicing import check_small_arrays, sliced_layout
from common.config import NodeConfig, RunConfig
from common.layout import ParamLayout
from common.models import build_model
from common.structured_models import build_structured_model, skeleton_layout
from common.width_masks import TensorChannels, channel_graph, group_sizes


@dataclass(frozen=True)
class ReceivedSmallModel:
    """A decoded and checked CA-HFP download."""

    model: nn.Module
    small_layout: ParamLayout
    graph: Mapping[str, TensorChannels]
    arrays: dict[str, NDArray[np.float32]]
    round: int
    digest: str


def receive_small_model(msg: Message, run: RunConfig, data: LocalData) -> ReceivedSmallModel:
    """Decode the download and build the small model; ``ValueError`` when it does not fit this architecture."""
    with torch.device("meta"):
        skeleton = build_model(run.model, data.train.num_classes, data.train.in_channels, run.seed)
    layout = skeleton_layout(skeleton)
    cfg = msg.content.config_records[P.SUBMODEL_CONFIG]
    if int(cfg["d"]) != layout.size:
        raise ValueError(f"server model has d={cfg['d']} but this node builds d={layout.size}: run configs differ")
    if cfg["mask-kind"] != P.CHANNELS_KIND:
        raise ValueError(f"method cahfp expects a {P.CHANNELS_KIND!r} submodel, got mask-kind {cfg['mask-kind']!r}")
    graph = channel_graph(run.model, layout)
    channels = {g: a.numpy() for g, a in msg.content.array_records[P.CHANNELS].items()}
    selection = P.decode_channels(channels, group_sizes(layout, graph))
    arrays = {n: a.numpy() for n, a in msg.content.array_records[P.SUBMODEL].items()}
    check_small_arrays(layout, graph, selection, arrays)
    small_layout = sliced_layout(layout, graph, selection)
    model = build_structured_model(skeleton, arrays)
    return ReceivedSmallModel(model, small_layout, graph, arrays, int(cfg["round"]), str(cfg["mask-digest"]))


def reply_arrays(
    small_layout: ParamLayout,
    graph: Mapping[str, TensorChannels],
    received: Mapping[str, NDArray[np.float32]],
    result: StructuredTrainResult,
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
    result : StructuredTrainResult
        Outcome of :func:`client.structured_training.train_small`.
    """
    g = small_layout.flatten(result.grad_mean)
    h = small_layout.flatten(result.fisher)
    sums = channel_scores(small_layout, graph, g, h, small_layout.flatten(received))
    return {**result.params, **{P.score_name(group): s.astype(np.float32) for group, s in sums.items()}}


def train_structured(msg: Message, run: RunConfig, node: NodeConfig, data: LocalData) -> Message:
    """Train the received small model; reply with its trained tensors and per-channel curvature scores."""
    got = receive_small_model(msg, run, data)
    tcfg = round_train_config(run, node, got.round, run.fisher_batches)
    result = train_small(got.model, data.train, tcfg, pick_device(node.device))
    arrays = reply_arrays(got.small_layout, got.graph, got.arrays, result)
    return train_reply(
        msg,
        arrays,
        result.num_examples,
        result.loss,
        result.train_seconds,
        result.stats_seconds,
        got.round,
        got.digest,
        run.upload_encoding,
    )


def evaluate_structured(msg: Message, run: RunConfig, node: NodeConfig, data: LocalData) -> Message:
    """Evaluate the received small model on the local test split."""
    got = receive_small_model(msg, run, data)
    loss, acc = evaluate(got.model, data.test, pick_device(node.device))
    content = RecordDict(
        {
            P.METRICS: MetricRecord({"num-examples": len(data.test), "eval-loss": loss, "eval-acc": acc}),
            P.META: ConfigRecord({"round": got.round, "mask-digest": got.digest}),
        }
    )
    return Message(content, reply_to=msg)
