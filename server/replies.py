"""Taking a reply Message apart without trusting it, and matching it to what was sent."""

from __future__ import annotations

import io
import math
from collections.abc import Container, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message
from flwr.common.constant import SType
from numpy.typing import NDArray

from common.wire import protocol as P
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
        """The records a method validates
        (:meth:`common.methods.contract.server_side.ServerMethod.validate`)."""
        return ReplyRecords(self.arrays, self.metrics, self.meta)


def array_view(arr: Array) -> NDArray:
    """A Flower ``Array`` as a read-only numpy view of its received bytes (no copy).

    ``Array.numpy()`` reads the ``.npy`` bytes through a file object, copying them twice; the array
    a reply carries is only read by the server (validated, then folded), so it is viewed where it
    lies. The header is read as ``np.load`` reads it (format versions 1.0 and 2.0, what ``np.save``
    writes for a plain array; any other goes through ``Array.numpy()``); object dtypes are refused
    (``np.load`` without pickles), and so is a length other than the header's.
    """
    if arr.stype != SType.NUMPY:
        raise TypeError(f"unsupported serialisation type {arr.stype!r} for numpy")
    data = arr.data
    header = io.BytesIO(memoryview(data)[:_HEADER_MAX])
    version = np.lib.format.read_magic(header)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(header)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(header)
    else:
        return arr.numpy()
    if dtype.hasobject:
        raise ValueError("object arrays cannot be loaded without pickles")
    count = math.prod(shape)
    offset = header.tell()
    if len(data) != offset + count * dtype.itemsize:
        raise ValueError(
            f"array of {shape} {dtype} needs {count * dtype.itemsize} bytes, got "
            f"{len(data) - offset}"
        )
    flat = np.frombuffer(
        data, dtype=dtype, count=count, offset=offset
    )  # read-only: the buffer is bytes
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


#: Header bytes read at most (``np.load``'s default limit on a header, and the format's preamble).
_HEADER_MAX = 10_000 + 16


def record_arrays(record: ArrayRecord) -> dict[str, NDArray]:
    """Every array of ``record`` by name, viewed where it lies (:func:`array_view`)."""
    return {name: array_view(arr) for name, arr in record.items()}


def reply_parts(
    msg: Message, arrays_key: str | None, metrics_key: str, meta_key: str | None
) -> ReplyParts:
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
            parts.arrays = record_arrays(record)
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


def train_parts(replies: Iterable[Message]) -> Iterator[ReplyParts]:
    """Each TRAIN reply taken apart (:func:`reply_parts`); the Message is let go before the next is
    pulled."""
    for msg in replies:
        parts = reply_parts(msg, P.UPDATE, P.METRICS, P.META)
        del msg  # its serialised arrays go before the next reply is pulled
        yield parts


def expected_sent(
    parts: ReplyParts, sent: dict[int, SentSubmodel], answered: Container[int]
) -> SentSubmodel:
    """What this reply answers; rejects error replies, replies nobody asked for, and duplicates."""
    if parts.error:
        raise ReplyError(parts.error)
    if parts.node_id not in sent:
        raise ReplyError("nothing was sent to this node in this round")
    if parts.node_id in answered:
        raise ReplyError("duplicate reply for this round")
    return sent[parts.node_id]
