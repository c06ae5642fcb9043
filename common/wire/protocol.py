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

A method packs its own payload (``Method.client_train``) and checks it (``Method.validate``); it may send a
submodel of another shape altogether, as CA-HFP's physically smaller model (``common.methods.cahfp``, with
its channel records in ``common.submodels.channel_slicing``). What every reply shares is checked by
``common.wire.validation``.

Client -> server (EVALUATE)::

    metrics "metrics":  num-examples, eval-loss, eval-acc
    config "meta":      round, mask-digest

Server -> client (QUERY): empty, or, when a fresh run's method opens with a Fisher warm-up it can fold into
discovery (``Method.warmup_in_discovery``)::

    arrays "opening":   values  float32[d]   the initial global model, flat

Client -> server (QUERY), a node that could read its configuration::

    metrics "profile":  capacity, num-train-examples, num-test-examples
                        (+ probe-memory-gib, probe-gflops with capacity=auto)
    config "device":    device, client-key, capacity-source ("node-config" or "auto"),
                        capacity-kind ("bandwidth" or "memory", when the node config sets it)

plus, when the QUERY carried "opening", the records of the node's round-0 TRAIN reply ("update", "metrics",
"meta"): its Fisher at the initial model, for the submodel the server would send it in round 0
(``FisherRankedMethod.opening_received``; the mask digest echoed lets the server check it is that one), or
``config "opening-error": reason`` when it could not measure it. When the QUERY also carries
``config "round-one"`` (``Method.opens_round_one``), the node then trains the submodel the server would send it
in round 1, ranked by the Fisher it just measured (``Method.round_one_received``), and adds that round-1 TRAIN
reply's records as "round-one-update", "round-one-metrics", "round-one-meta" (the digest echoed is the round-1
mask's, which the server checks against its own), or ``config "round-one-error": reason``. And a misconfigured
node::

    config "profile":   error  (why, e.g. "ConfigError: capacity=2: allowed range is (0, 1]")
"""

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
ROUND_ONE = "round-one"  # a QUERY carrying "opening" also asks the node to train round 1 (config record)
ROUND_ONE_UPDATE = "round-one-update"
ROUND_ONE_METRICS = "round-one-metrics"
ROUND_ONE_META = "round-one-meta"
ROUND_ONE_ERROR = "round-one-error"
DELTA = "delta"
VALUES = "values"
MASK = "mask"


@dataclass(frozen=True)
class SubmodelPayload:
    """One client's download.

    Parameters
    ----------
    values : NDArray[float32]
        Global values at the mask's positions, in increasing position order.
    mask_kind : str
        Mask encoding (``full``, ``bits``, ``indices`` or ``elias-fano``; :mod:`common.wire.mask_codec`).
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


def encode_submodel(x: NDArray[np.float32], mask: NDArray[np.bool_]) -> SubmodelPayload:
    """The selected values of ``x`` and the compact mask."""
    kind, data = encode_mask(mask)
    return SubmodelPayload(np.asarray(x, dtype=np.float32)[mask], kind, data, mask_digest(kind, data))


def decode_submodel(
    values: NDArray, mask_kind: str, mask_data: NDArray, d: int
) -> tuple[NDArray[np.float32], NDArray[np.bool_]]:
    """Dense parameters (zero outside the mask) and the mask; raises ``ValueError`` on bad input."""
    mask = decode_mask(mask_kind, mask_data, d)
    values = np.asarray(values)
    if values.dtype != np.float32 or values.shape != (int(mask.sum()),):
        raise ValueError(f"submodel values must be float32[{int(mask.sum())}], got {values.dtype}{list(values.shape)}")
    if not np.all(np.isfinite(values)):
        raise ValueError("submodel values contain NaN or Inf")
    dense = np.zeros(d, dtype=np.float32)
    dense[mask] = values
    return dense, mask
