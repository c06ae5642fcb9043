"""Taking a reply Message apart without trusting it, and matching it to what was sent."""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from flwr.app import Message
from numpy.typing import NDArray

from common.wire.validation import ReplyError, ReplyRecords, SentSubmodel


@dataclass
class ReplyParts:
    """The pieces of a reply the validators look at, already taken out of the Message.

    Parameters
    ----------
    node_id : int
        The sender's node id.
    arrays, metrics, meta : dict or None
        The reply's update arrays, metrics record and meta record (``None`` when absent).
    error : str or None
        Why the reply cannot be used (an error reply, an undecodable payload).
    nbytes : int
        Bytes of the update arrays (the upload).
    extras : dict
        Every other config record's entries, merged.
    """

    node_id: int
    arrays: dict[str, NDArray] | None = None
    metrics: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    error: str | None = None
    nbytes: int = 0
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def records(self) -> ReplyRecords:
        """The records a method validates (:meth:`common.methods.base.Method.validate`)."""
        return ReplyRecords(self.arrays, self.metrics, self.meta)


def reply_parts(msg: Message, arrays_key: str | None, metrics_key: str, meta_key: str | None) -> ReplyParts:
    """Extract records from a reply without trusting it (decode failures become ``error``)."""
    parts = ReplyParts(node_id=int(msg.metadata.src_node_id))
    if msg.has_error():
        parts.error = f"node returned an error: {msg.error.reason}"
        return parts
    try:
        content = msg.content
        if arrays_key is not None and arrays_key in content.array_records:
            record = content.array_records[arrays_key]
            parts.nbytes = record.count_bytes()
            parts.arrays = {name: arr.numpy() for name, arr in record.items()}
        if metrics_key in content.metric_records:
            parts.metrics = dict(content.metric_records[metrics_key])
        if meta_key is not None and meta_key in content.config_records:
            parts.meta = dict(content.config_records[meta_key])
        for name, rec in content.config_records.items():
            if name != meta_key:
                parts.extras.update(rec)
    except Exception as err:  # undecodable payloads are a reason to drop the reply, never to crash
        parts.error = f"undecodable reply: {type(err).__name__}: {err}"
    return parts


def expected_sent(parts: ReplyParts, sent: dict[int, SentSubmodel], answered: Container[int]) -> SentSubmodel:
    """What this reply answers; rejects error replies, replies nobody asked for, and duplicates."""
    if parts.error:
        raise ReplyError(parts.error)
    if parts.node_id not in sent:
        raise ReplyError("nothing was sent to this node in this round")
    if parts.node_id in answered:
        raise ReplyError("duplicate reply for this round")
    return sent[parts.node_id]
