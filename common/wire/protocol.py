"""Names and layout of what server and clients exchange (Message API records), for every method.

Server -> client (TRAIN and EVALUATE)::

    arrays "submodel":  values  float32[k]   selected global values, in flat order
                        mask    bits uint8[ceil(d/8)] | indices uint{8,16,32}[k] | elias-fano uint8 | empty
    config "submodel-config":  mask-kind, mask-digest, d, round
    config "config":           the strategy's train_config / evaluate_config, only when not empty
    arrays "fisher-at": values float32[d-k]  TRAIN of a Fisher refresh (``fisher-estimator = "global"``):
                        the global values outside the mask, so the node measures its Fisher at the full
                        global model; then (and with the other estimators) the reply carries the Fisher
                        payload, otherwise none

A TRAIN message of round 0 is the Fisher warm-up (``fisher-warmup``): the node takes no local
step and replies with a zero delta and its Fisher at the received weights.

Client -> server (TRAIN)::

    arrays "update":    delta   float32[k]   trained minus received, same order
                        ...                  the method's own payload: the Fisher of the Fisher-ranked
                                             methods (common.fisher.codec), the classes a width-method
                                             client holds (common.submodels.label_split)
    metrics "metrics":  num-examples, train-loss, train-seconds, fisher-seconds,
                        peak-rss-mib (optional: the client process's peak resident MiB while training),
                        cpu-seconds (optional: the client process's CPU seconds of training and Fisher)
    config "meta":      round, mask-digest

A method packs its own payload (``Method.client_train``) and checks it (``Method.validate``); it may
send a submodel of another shape altogether, as CA-HFP's physically smaller model
(``common.methods.cahfp``, with its channel records in ``common.submodels.channel_slicing``). What
every reply shares is checked by ``common.wire.validation``.

Client -> server (EVALUATE)::

    metrics "metrics":  num-examples, eval-loss, eval-acc
    config "meta":      round, mask-digest

Server -> client (QUERY): empty, or, when a fresh run's method opens with a Fisher warm-up it can
fold into discovery (``ServerMethod.opening``: ``discovery``)::

    arrays "opening":   values  float32[d]   the initial global model, flat

Client -> server (QUERY), a node that could read its configuration::

    metrics "profile":  capacity, num-train-examples, num-test-examples
                        (+ probe-memory-gib, probe-gflops with capacity=auto)
    config "device":    device, client-key, capacity-source ("node-config" or "auto"),
                        capacity-kind ("bandwidth" or "memory", when the node config sets it)

plus, when the QUERY carried "opening", the records of the node's round-0 TRAIN reply ("update",
"metrics", "meta"): its Fisher at the initial model, for the submodel the server would send it in
round 0 (``FisherRankedMethod.opening_received``; the mask digest echoed lets the server check it is
that one), or ``config "opening-error": reason`` when it could not measure it. When the QUERY also
carries ``config "round-one"`` (``ServerMethod.opening``: ``discovery+round-one``), the node then trains the submodel the
server would send it in round 1, ranked by the Fisher it just measured
(``ClientMethod.round_one_received``), and adds that round-1 TRAIN reply's records as "round-one-update",
"round-one-metrics", "round-one-meta" (the digest echoed is the round-1 mask's, which the server
checks against its own), or ``config "round-one-error": reason``. And a misconfigured node::

    config "profile":   error  (why, e.g. "ConfigError: capacity=2: allowed range is (0, 1]")
"""  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.wire.mask_codec import decode_mask, encode_mask, mask_digest

SUBMODEL = "submodel"
SUBMODEL_CONFIG = "submodel-config"
FISHER_AT = "fisher-at"  # the global values outside the mask, sent with a Fisher refresh
CONFIG = "config"  # Flower's name for the strategy's train_config / evaluate_config record
UPDATE = "update"
METRICS = "metrics"
META = "meta"
PROFILE = "profile"
OPENING = "opening"  # the initial model in a QUERY that also asks for the warm-up Fisher
OPENING_ERROR = "opening-error"
ROUND_ONE = (
    "round-one"  # a QUERY carrying "opening" also asks the node to train round 1 (config record)
)
ROUND_ONE_UPDATE = "round-one-update"
ROUND_ONE_METRICS = "round-one-metrics"
ROUND_ONE_META = "round-one-meta"
ROUND_ONE_ERROR = "round-one-error"
DELTA = "delta"
ADAPTED_LOSS = (
    "eval-loss-adapted"  # EVALUATE reply metric with adapt-steps: the loss after adapting locally
)
ADAPTED_ACC = "eval-acc-adapted"  # ... and the accuracy
VALUES = "values"
# in "fisher-at": the most bytes the Fisher payload of the reply may take (int64[1])
FISHER_BYTES = "fisher-bytes"
MASK = "mask"


@dataclass(frozen=True)
class SubmodelPayload:
    """One client's download.

    Parameters
    ----------
    values : NDArray[float32]
        Global values at the mask's positions, in increasing position order.
    mask_kind : str
        Mask encoding (``full``, ``bits``, ``indices`` or ``elias-fano``;
        :mod:`common.wire.mask_codec`).
    mask_data : NDArray
        Encoded mask.
    digest : str
        :func:`common.wire.mask_codec.mask_digest` of the encoded mask.
    """

    values: NDArray[np.float32]
    mask_kind: str
    mask_data: NDArray
    digest: str

    @property
    def nbytes(self) -> int:
        """Raw payload bytes: values plus mask encoding."""
        return int(self.values.nbytes + self.mask_data.nbytes)


#: Positions of the mask read at a time when :func:`_gather` compresses block by block.
_GATHER_BLOCK = 1 << 18


def _gather(
    x: NDArray[np.float32], mask: NDArray[np.bool_], taken: int, outside: bool
) -> NDArray[np.float32]:
    """``x[mask]`` (``outside``: ``x[~mask]``), the same values in the same order, by the cheaper of
    two routes.

    Boolean indexing copies run by run, so its time grows with the runs of the mask, which are most
    when about half the positions are taken and few when most or few are; ``np.compress`` (the
    positions, then a take) costs per position taken but not per run. Between 1/8 and 7/8 of the
    positions taken (a ResNet-18 capacity-0.25 mask and its complement: 2 to 3 times faster) the
    mask is compressed one block of :data:`_GATHER_BLOCK` positions at a time, into the output, so
    no position array of the whole mask is made. Every position taken is a copy of ``x`` (never
    ``x`` itself: the model changes after the download is made).

    Parameters
    ----------
    x : NDArray[float32]
        Flat values.
    mask : NDArray[bool]
        Same shape as ``x``.
    taken : int
        Positions taken: set positions of ``mask`` (``outside``: unset ones).
    outside : bool
        Gather the positions outside the mask instead of inside it.
    """
    d = x.shape[0]
    if (
        taken == d
    ):  # every position (a capacity-1 download): one copy, half the time of indexing by the mask
        return x.copy()
    if not d // 8 <= taken <= d - d // 8:
        return x[~mask] if outside else x[mask]
    out = np.empty(taken, dtype=x.dtype)
    filled = 0
    for start in range(0, d, _GATHER_BLOCK):
        part = mask[start : start + _GATHER_BLOCK]
        if outside:
            part = ~part
        n = int(np.count_nonzero(part))
        np.compress(part, x[start : start + _GATHER_BLOCK], out=out[filled : filled + n])
        filled += n
    return out


def _flat_pair(x: NDArray, mask: NDArray) -> tuple[NDArray[np.float32], NDArray[np.bool_]] | None:
    """``x`` as float32 and ``mask`` as booleans when both are flat and of one length (else
    ``None``)."""
    values, flags = np.asarray(x, dtype=np.float32), np.asarray(mask)
    if flags.dtype != np.bool_ or values.ndim != 1 or flags.shape != values.shape:
        return None
    return values, flags


def selected_values(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> NDArray[np.float32]:
    """The values of ``x`` at the mask's positions, in increasing position order (``x[mask]`` as
    float32).

    Parameters
    ----------
    x : NDArray[float32]
        Global values, flat, length ``d``.
    mask : NDArray[bool]
        The submodel mask, length ``d``.
    """
    return _values(x, mask, outside=False)


def outside_values(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> NDArray[np.float32]:
    """The values of ``x`` outside the mask, in increasing position order (``x[~mask]`` as float32).

    What a Fisher refresh sends besides the submodel (``fisher-at``).

    Parameters
    ----------
    x : NDArray[float32]
        Global values, flat, length ``d``.
    mask : NDArray[bool]
        The submodel mask, length ``d``.
    """
    return _values(x, mask, outside=True)


def _values(x: NDArray[np.float32], mask: NDArray[np.bool_], outside: bool) -> NDArray[np.float32]:
    """``x`` as float32 at the mask's positions, or outside them, in increasing position order."""
    pair = _flat_pair(x, mask)
    if pair is None:  # indexing says what is wrong
        flags = ~np.asarray(mask) if outside else mask
        return np.ascontiguousarray(np.asarray(x, dtype=np.float32)[flags])
    values, flags = pair
    kept = int(np.count_nonzero(flags))
    return _gather(values, flags, values.size - kept if outside else kept, outside=outside)


def encode_submodel(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> SubmodelPayload:
    """The selected values of ``x`` (:func:`selected_values`) and the compact mask.

    A mask of fewer than ``d / 8`` positions is sent as ``indices`` or ``elias-fano``, which are
    built from its
    positions: they are found once, and the values taken at them
    (:func:`common.wire.mask_codec.encode_mask` gets them too), instead of a second scan of the mask
    by boolean indexing.
    """
    pair = _flat_pair(x, mask)
    if pair is not None and int(np.count_nonzero(pair[1])) < pair[1].size // 8:
        values, flags = pair
        positions = np.flatnonzero(flags)
        kind, data = encode_mask(flags, positions)
        return SubmodelPayload(values.take(positions), kind, data, mask_digest(kind, data))
    kind, data = encode_mask(mask)
    return SubmodelPayload(selected_values(x, mask), kind, data, mask_digest(kind, data))


def decode_submodel(
    values: NDArray, mask_kind: str, mask_data: NDArray, d: int
) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """Dense parameters (zero outside the mask) and the mask; raises ``ValueError`` on bad input."""
    mask = decode_mask(mask_kind, mask_data, d)
    values = np.asarray(values)
    if values.dtype != np.float32 or values.shape != (int(mask.sum()),):
        raise ValueError(
            f"submodel values must be float32[{int(mask.sum())}], got "
            f"{values.dtype}{list(values.shape)}"
        )
    if not np.all(np.isfinite(values)):
        raise ValueError("submodel values contain NaN or Inf")
    dense = np.zeros(d, dtype=np.float32)
    dense[mask] = values
    return dense, mask
