"""The TRAIN reply every method sends: the update arrays, the training metrics and the meta record.

One builder for every method, so the records the server validates (:mod:`common.wire.validation`)
have one shape.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from common.methods.contract.payloads import LocalUpdate
from common.wire import protocol as P


def train_reply(
    msg: Message,
    update: LocalUpdate,
    server_round: int,
    mask_digest: str,
    peak_rss_mib: float | None = None,
    cpu_seconds: float | None = None,
    extra: dict[str, float] | None = None,
) -> Message:
    """Reply to ``msg`` (the TRAIN message answered) with :func:`train_records`."""
    records = train_records(update, server_round, mask_digest, peak_rss_mib, cpu_seconds, extra)
    return Message(records, reply_to=msg)


def train_records(
    update: LocalUpdate,
    server_round: int,
    mask_digest: str,
    peak_rss_mib: float | None = None,
    cpu_seconds: float | None = None,
    extra: dict[str, float] | None = None,
) -> RecordDict:
    """The records of a TRAIN reply carrying the method's local ``update``.

    Parameters
    ----------
    update : LocalUpdate
        Update arrays (delta and Fisher payload, or small-model tensors and channel scores) and
        metrics.
    server_round : int
        The round the submodel was sent for.
    mask_digest : str
        Digest of the mask (or kept channels) the server sent, echoed back.
    peak_rss_mib : float or None
        The client process's peak resident memory while it trained, in MiB; ``None`` sends no value.
    cpu_seconds : float or None
        The client process's CPU seconds of training and Fisher estimation (all its threads; what
        the node would take alone on one core per thread, whatever else shares the machine);
        ``None`` sends no value.
    extra : dict[str, float], optional
        More metrics (the privacy ledger's ``dp-epsilon`` and ``dp-noise-multiplier``).
    """
    metrics = {
        "num-examples": update.num_examples,
        "train-loss": update.loss,
        "train-seconds": update.train_seconds,
        "fisher-seconds": update.fisher_seconds,
    }
    if peak_rss_mib is not None:
        metrics["peak-rss-mib"] = float(peak_rss_mib)
    if cpu_seconds is not None:
        metrics["cpu-seconds"] = float(cpu_seconds)
    metrics.update(extra or {})
    return RecordDict(
        {
            P.UPDATE: ArrayRecord(
                {k: Array(np.ascontiguousarray(v)) for k, v in update.arrays.items()}
            ),
            P.METRICS: MetricRecord(metrics),
            P.META: ConfigRecord({"round": server_round, "mask-digest": mask_digest}),
        }
    )
