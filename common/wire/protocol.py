"""Names and layout of what server and clients exchange (Message API records).

Server -> client (TRAIN and EVALUATE)::

    arrays "submodel":  values  float32[k]   selected global values, in flat order
                        mask    bits uint8[ceil(d/8)] | indices uint{8,16,32}[k] | elias-fano uint8 | empty
    config "submodel-config":  mask-kind, mask-digest, d, round
    config "config":           the strategy's train_config / evaluate_config, only when not empty
    arrays "fisher-at": values float32[d-k]  TRAIN of a Fisher refresh (``fisher-estimator = "global"``):
                        the global values outside the mask, so the node measures its Fisher at the full
                        global model; then (and with the other estimators) the reply carries the Fisher
                        payload, otherwise none (meta ``fisher-encoding = "none"``)

A TRAIN message of round 0 is the Fisher warm-up (``fisher-warmup``): the node takes no local
step and replies with a zero delta and its Fisher at the received weights.

Client -> server (TRAIN)::

    arrays "update":    delta   float32[k]   trained minus received, same order
                        fisher.*             the Fisher payload (common.fisher.codec)
                        classes uint8[C]     HeteroFL / FedRolex with label split: 1 per class in the
                                             client's training data (common.submodels.label_split)
    metrics "metrics":  num-examples, train-loss, train-seconds, fisher-seconds,
                        peak-rss-mib (optional: the client process's peak resident MiB while training)
    config "meta":      round, mask-digest, fisher-encoding

CA-HFP (``method = "cahfp"``) sends a physically smaller model instead (TRAIN and EVALUATE)::

    arrays "submodel":           <tensor name>  float32[small shape]   one per trainable tensor
    arrays "submodel-channels":  <group>        uint{8,16,32}[k_g]     kept channels, increasing
    config "submodel-config":    mask-kind = "channels", mask-digest, d, round

and its TRAIN reply carries the trained small model and the channel scores::

    arrays "update":    <tensor name>   float32[small shape]   trained values (not a delta)
                        score.<group>   float32[k_g]           curvature score of each kept channel
    metrics, config "meta" as above (fisher-encoding "none")

Client -> server (EVALUATE)::

    metrics "metrics":  num-examples, eval-loss, eval-acc
    config "meta":      round, mask-digest

Client -> server (QUERY), a node that could read its configuration::

    metrics "profile":  capacity, num-train-examples, num-test-examples
                        (+ probe-memory-gib, probe-gflops with capacity=auto)
    config "device":    device, client-key, capacity-source ("node-config" or "auto"),
                        capacity-kind ("bandwidth" or "memory", when the node config sets it)

and a misconfigured node::

    config "profile":   error  (why, e.g. "ConfigError: capacity=2: allowed range is (0, 1]")
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.submodels.channel_scores import ChannelSelection
from common.submodels.channel_slicing import check_selection
from common.wire.mask_codec import decode_mask, encode_mask, index_dtype, mask_digest

SUBMODEL = "submodel"
SUBMODEL_CONFIG = "submodel-config"
FISHER_AT = "fisher-at"  # the global values outside the mask, sent with a Fisher refresh
CONFIG = "config"  # Flower's name for the strategy's train_config / evaluate_config record
UPDATE = "update"
METRICS = "metrics"
META = "meta"
PROFILE = "profile"
DELTA = "delta"
CLASSES = "classes"
VALUES = "values"
MASK = "mask"
CHANNELS = "submodel-channels"
CHANNELS_KIND = "channels"  # the "mask-kind" of a channel-sliced submodel
SCORE_PREFIX = "score."


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


def encode_channels(selection: ChannelSelection, sizes: Mapping[str, int]) -> dict[str, NDArray]:
    """Kept channels per group in the narrowest unsigned dtype for the group's size."""
    selection = check_selection(selection, sizes)
    return {g: selection[g].astype(index_dtype(n)) for g, n in sizes.items()}


def decode_channels(arrays: Mapping[str, NDArray], sizes: Mapping[str, int]) -> ChannelSelection:
    """Inverse of :func:`encode_channels`; raises ``ValueError`` naming the bad group."""
    for g, a in arrays.items():
        if g in sizes and np.asarray(a).dtype != index_dtype(sizes[g]):
            raise ValueError(f"group {g!r}: channel indices must be {index_dtype(sizes[g])}, got {np.asarray(a).dtype}")
    return check_selection(arrays, sizes)


def channels_digest(channels: Mapping[str, NDArray]) -> str:
    """Digest of encoded kept channels (group names and indices); a reply echoes it."""
    data = b"".join(
        f"{g}:{np.asarray(a).dtype.str}:".encode() + np.ascontiguousarray(a).tobytes() for g, a in channels.items()
    )
    return mask_digest(CHANNELS_KIND, np.frombuffer(data, dtype=np.uint8))


def score_name(group: str) -> str:
    """Array name of a group's channel scores in a CA-HFP reply."""
    return SCORE_PREFIX + group
