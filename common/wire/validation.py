"""Validation of client replies before anything touches the global state.

Each check raises :class:`ReplyError` with a reason meant for the log; a reply
that fails any check is dropped whole, so the global model and the Fisher state
are exactly as if it had never arrived.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from common.aggregation.masked import MaskedUpdate
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.mask_codec import packed_positions

# A single reply above this many bytes is refused before decoding (4x dense fp32 + slack).
OVERSIZE_FACTOR = 4


class ReplyError(ValueError):
    """A reply that must be dropped; the message is the logged reason."""


@dataclass(frozen=True, init=False)
class SentSubmodel:
    """What the server sent one node in one round, to check the reply against.

    The mask is kept as packed bits (``d / 8`` bytes): a round holds one of these per participant
    until its reply is folded, so at hundreds of clients the unpacked masks (``d`` bytes each) would
    dominate the round's memory. :attr:`mask` unpacks a fresh copy.

    Parameters
    ----------
    node_id : int
        Destination node.
    round : int
        Server round.
    mask : NDArray[bool]
        The submodel mask sent.
    digest : str
        Digest of the encoded mask sent.
    max_examples : int
        Training examples the node reported at discovery (upper bound of a sane count).
    fisher : bool
        Whether the node was asked for its Fisher this round (if not, its reply carries none).
    """

    node_id: int
    round: int
    packed: NDArray[np.uint8]
    d: int
    kept: int
    digest: str
    max_examples: int
    fisher: bool

    def __init__(
        self,
        node_id: int,
        round: int,
        mask: NDArray[np.bool_],
        digest: str,
        max_examples: int,
        fisher: bool = True,
    ) -> None:
        flat = np.asarray(mask, dtype=bool).reshape(-1)
        for name, value in (
            ("node_id", node_id),
            ("round", round),
            ("packed", np.packbits(flat)),
            ("d", int(flat.size)),
            ("kept", int(np.count_nonzero(flat))),
            ("digest", digest),
            ("max_examples", max_examples),
            ("fisher", fisher),
        ):
            object.__setattr__(self, name, value)

    @property
    def mask(self) -> NDArray[np.bool_]:
        """The mask sent (a fresh array of ``d`` booleans)."""
        return np.unpackbits(self.packed, count=self.d).view(np.bool_)

    def positions(self) -> NDArray[np.signedinteger]:
        """The positions sent, increasing: ``int32`` while ``d <= 2^31``.

        :func:`common.wire.mask_codec.packed_positions`: built from the packed bits a block at a
        time, neither the unpacked mask nor int64 positions are made.
        """
        return packed_positions(self.packed, self.d, self.kept)


@dataclass(frozen=True)
class ReplyRecords:
    """What a TRAIN reply carries, taken out of its Message without trusting it.

    Parameters
    ----------
    arrays, metrics, meta : Mapping or None
        The reply's update arrays, metrics record and meta record (``None`` when absent).
    """

    arrays: Mapping[str, NDArray] | None
    metrics: Mapping[str, Any] | None
    meta: Mapping[str, Any] | None


@dataclass(frozen=True)
class TrainReply:
    """A validated training reply."""

    update: MaskedUpdate
    fisher: NDArray[np.float32] | None
    metrics: dict[str, float]
    fisher_bytes: int = field(
        default=0, kw_only=True
    )  # bytes of the Fisher payload as uploaded (before decoding)


def _finite_number(metrics: Mapping[str, Any], key: str, lo: float = 0.0) -> float:
    if key not in metrics:
        raise ReplyError(f"metric {key!r} missing")
    v = metrics[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < lo:
        raise ReplyError(f"metric {key!r}={v!r} is not a finite number >= {lo}")
    return float(v)


def check_meta(meta: Mapping[str, Any] | None, sent: SentSubmodel) -> None:
    """The reply must name the round and the mask it was sent."""
    if meta is None:
        raise ReplyError(f"config record {P.META!r} missing")
    if meta.get("round") != sent.round:
        raise ReplyError(f"reply is for round {meta.get('round')!r}, expected {sent.round}")
    if meta.get("mask-digest") != sent.digest:
        raise ReplyError(
            f"reply mask digest {meta.get('mask-digest')!r} does not match the mask sent "
            f"({sent.digest})"
        )


def check_examples(metrics: Mapping[str, Any], upper: int) -> int:
    """``num-examples`` must be a whole number in [1, ``upper``] (what the node reported)."""
    n = _finite_number(metrics, "num-examples", lo=1)
    if not float(n).is_integer() or n > upper:
        raise ReplyError(f"num-examples={n:g} is not a whole number in [1, {upper}]")
    return int(n)


def validate_train_reply(
    reply: ReplyRecords,
    sent: SentSubmodel,
    layout: ParamLayout,
    payload: Collection[str] = (),
) -> tuple[TrainReply, dict[str, NDArray]]:
    """Check the parts of a TRAIN reply every masked method shares: meta, delta, metrics.

    Parameters
    ----------
    reply : ReplyRecords
        The reply's records, already deserialised.
    sent : SentSubmodel
        What this node was sent this round.
    layout : ParamLayout
        The model layout.
    payload : Collection[str]
        Names of the method's own arrays the reply must carry besides ``delta`` (e.g. the Fisher
        payload); the method decodes them.

    Returns
    -------
    The reply with its update and metrics (``fisher`` ``None``), and the method's own arrays by
    name. The update copies nothing it received: its delta is a read-only view of the reply's
    ``delta`` array, and its indices are the positions sent, built from the packed mask as ``int32``
    (:meth:`SentSubmodel.positions`).
    """
    arrays, metrics = reply.arrays, reply.metrics
    check_meta(reply.meta, sent)
    if arrays is None:
        raise ReplyError(f"array record {P.UPDATE!r} missing")
    if metrics is None:
        raise ReplyError(f"metric record {P.METRICS!r} missing")
    expected = {P.DELTA, *payload}
    if set(arrays) != expected:
        raise ReplyError(
            f"update arrays {sorted(arrays)} differ from the expected {sorted(expected)}"
        )
    total = sum(int(np.asarray(a).nbytes) for a in arrays.values())
    if total > OVERSIZE_FACTOR * 4 * layout.size + 1024:
        raise ReplyError(
            f"update of {total} bytes is oversized for a model of {layout.size} parameters"
        )
    delta = _checked_delta(arrays[P.DELTA], sent.kept)
    n = check_examples(metrics, sent.max_examples)
    values = {"num-examples": float(n)}
    for key in ("train-loss", "train-seconds", "fisher-seconds"):
        values[key] = _finite_number(metrics, key)
    # Optional: a client on a platform without /proc or resource sends no peak; an older client, no
    # CPU seconds; a run without dp-epsilon, no privacy ledger.
    for key in ("peak-rss-mib", "cpu-seconds", "dp-epsilon", "dp-noise-multiplier"):
        if key in metrics:
            values[key] = _finite_number(metrics, key)
    update = MaskedUpdate(sent.positions(), read_only(delta), float(n))
    return TrainReply(update, None, values), {name: arrays[name] for name in payload}


def _checked_delta(received: NDArray, k: int) -> NDArray:
    """The reply's ``delta`` as an array, once it is ``float32[k]`` and finite.

    Parameters
    ----------
    received : NDArray
        The reply's ``delta`` array, as it arrived.
    k : int
        Positions sent (:attr:`SentSubmodel.kept`): one value is expected per position.
    """
    delta = np.asarray(received)
    if delta.dtype != np.float32 or delta.shape != (k,):
        raise ReplyError(
            f"delta must be float32[{k}] (one value per position sent), got "
            f"{delta.dtype}{list(delta.shape)}"
        )
    # Two reductions rather than np.isfinite(delta).all(): no temporary of k booleans.
    if delta.size and not (np.isfinite(delta.min()) and np.isfinite(delta.max())):
        raise ReplyError("delta contains NaN or Inf")
    return delta


def read_only(a: NDArray) -> NDArray:
    """A read-only view of ``a`` (no copy): the update's delta is the received buffer itself.

    The consumers (running sums, batch aggregation) only read it; a write through the view raises
    instead of reaching the reply's buffer.
    """
    view = a.view()
    view.flags.writeable = False
    return view


def validate_evaluate_reply(
    metrics: Mapping[str, Any] | None,
    meta: Mapping[str, Any] | None,
    sent: SentSubmodel,
    max_test: int,
    adapted: bool = False,
) -> dict[str, float]:
    """Check an EVALUATE reply; returns its metrics.

    ``adapted``: the run asks for the personalised figures too (``adapt-steps``), so the reply must
    carry the loss and accuracy after adapting (:data:`~common.wire.protocol.ADAPTED_LOSS`,
    ``ADAPTED_ACC``).
    """
    check_meta(meta, sent)
    if metrics is None:
        raise ReplyError(f"metric record {P.METRICS!r} missing")
    n = check_examples(metrics, max_test)
    out = {"num-examples": float(n)}
    for loss_key, acc_key in [("eval-loss", "eval-acc")] + [
        (P.ADAPTED_LOSS, P.ADAPTED_ACC)
    ] * adapted:
        out[loss_key] = _finite_number(metrics, loss_key)
        out[acc_key] = _finite_number(metrics, acc_key)
        if out[acc_key] > 1:
            raise ReplyError(f"{acc_key}={out[acc_key]} exceeds 1")
    return out


def validate_profile(
    metrics: Mapping[str, Any] | None, error: str | None
) -> tuple[float, int, int]:
    """Check a QUERY reply; returns ``(capacity, num_train, num_test)``."""
    if error:
        raise ReplyError(f"node reported a configuration error: {error}")
    if metrics is None:
        raise ReplyError(f"metric record {P.PROFILE!r} missing")
    capacity = _finite_number(metrics, "capacity")
    if not 0 < capacity <= 1:
        raise ReplyError(f"capacity={capacity} is outside (0, 1]")
    n_train = _finite_number(metrics, "num-train-examples", lo=1)
    n_test = _finite_number(metrics, "num-test-examples", lo=0)
    return capacity, int(n_train), int(n_test)
