"""Names and layout of what server and clients exchange (Message API records).

Server -> client (TRAIN and EVALUATE)::

    arrays "submodel":  values  float32[k]   selected global values, in flat order
                        mask    bits uint8[ceil(d/8)] | indices uint{8,16,32}[k] | empty
    config "submodel-config":  mask-kind, mask-digest, d, round

Client -> server (TRAIN)::

    arrays "update":    delta   float32[k]   trained minus received, same order
                        fisher.*             the Fisher payload (common.fisher_codec)
    metrics "metrics":  num-examples, train-loss, train-seconds, fisher-seconds
    config "meta":      round, mask-digest, fisher-encoding

Client -> server (EVALUATE)::

    metrics "metrics":  num-examples, eval-loss, eval-acc
    config "meta":      round, mask-digest

Client -> server (QUERY)::

    metrics "profile":  capacity, num-train-examples, num-test-examples
    config "profile":   device, and "error" when the node is misconfigured
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from common.mask_codec import decode_mask, encode_mask, mask_digest

SUBMODEL = "submodel"
SUBMODEL_CONFIG = "submodel-config"
UPDATE = "update"
METRICS = "metrics"
META = "meta"
PROFILE = "profile"
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
        Mask encoding (``full``, ``bits`` or ``indices``).
    mask_data : NDArray
        Encoded mask.
    digest : str
        :func:`common.mask_codec.mask_digest` of the encoded mask.
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
