"""The TRAIN reply every method sends: the update arrays, the training metrics and the meta record.

One builder for the masked (``client.app``) and the structured (``client.structured_handlers``)
clients, so the records the server validates (``server.validation``) have one shape.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from numpy.typing import NDArray

from common import protocol as P


def train_reply(
    msg: Message,
    arrays: Mapping[str, NDArray],
    num_examples: int,
    loss: float,
    train_seconds: float,
    fisher_seconds: float,
    server_round: int,
    mask_digest: str,
    fisher_encoding: str,
) -> Message:
    """Reply to ``msg`` with the update ``arrays`` and its metrics.

    Parameters
    ----------
    arrays : Mapping
        Update arrays by record key (delta and Fisher payload, or small-model tensors and channel scores).
    num_examples : int
        Training examples seen (the aggregation weight).
    loss : float
        Mean training loss.
    train_seconds, fisher_seconds : float
        Wall-clock seconds of local training, and of the Fisher / curvature accumulation inside it.
    server_round : int
        The round the submodel was sent for.
    mask_digest : str
        Digest of the mask (or kept channels) the server sent, echoed back.
    fisher_encoding : str
        Fisher upload encoding used (``none`` for methods that upload none).
    """
    content = RecordDict(
        {
            P.UPDATE: ArrayRecord({k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()}),
            P.METRICS: MetricRecord(
                {
                    "num-examples": num_examples,
                    "train-loss": loss,
                    "train-seconds": train_seconds,
                    "fisher-seconds": fisher_seconds,
                }
            ),
            P.META: ConfigRecord(
                {"round": server_round, "mask-digest": mask_digest, "fisher-encoding": fisher_encoding}
            ),
        }
    )
    return Message(content, reply_to=msg)
