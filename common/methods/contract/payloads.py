"""What a method sends and receives besides the round's config record: the values on the wire.

The server side (:class:`~common.methods.contract.server_side.ServerMethod`) builds a
:class:`Download` and may attach a :class:`FisherRequest`; the node sees it as a :class:`Received`
and answers with a :class:`LocalUpdate`
(:class:`~common.methods.contract.client_side.ClientMethod`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from numpy.typing import NDArray


@dataclass(frozen=True)
class Download:
    """What one node is sent for one round (besides the round's config record).

    Parameters
    ----------
    records : dict[str, dict[str, NDArray]]
        Array records by record name, each a dict of named arrays.
    kind : str
        How the submodel is encoded (``mask-kind`` on the wire: ``full``, ``bits``, ``indices``,
        ``elias-fano``, ``channels``).
    digest : str
        Digest of the encoded mask, echoed by the reply.
    values_bytes : int
        Bytes of the parameter values sent.
    mask_bytes : int
        Bytes of the mask (or channel index) encoding sent.
    """

    records: dict[str, dict[str, NDArray]]
    kind: str
    digest: str
    values_bytes: int
    mask_bytes: int


@dataclass(frozen=True)
class FisherRequest:
    """Asks a node for its Fisher with this round's TRAIN message.

    Parameters
    ----------
    arrays : dict[str, NDArray]
        What the node needs besides its submodel to measure it (the ``fisher-at`` record: the global
        values outside its mask); empty: it measures on what it received.
    """

    arrays: dict[str, NDArray]


@dataclass(frozen=True)
class Received:
    """A node's view of a :class:`Download`.

    Parameters
    ----------
    records : Mapping[str, Mapping[str, NDArray]]
        The array records received.
    kind, digest : str
        ``mask-kind`` and ``mask-digest`` of the round's config record.
    d : int
        Size of the server's global model (a mismatch means the run configs differ).
    round : int
        The round (or asynchronous dispatch number) the download belongs to.
    """

    records: Mapping[str, Mapping[str, NDArray]]
    kind: str
    digest: str
    d: int
    round: int


@dataclass(frozen=True)
class LocalUpdate:
    """What local training produced, to be sent back.

    Parameters
    ----------
    arrays : dict[str, NDArray]
        The reply's update arrays (e.g. ``delta`` and the Fisher payload).
    num_examples : int
        Training examples used (the aggregation weight).
    loss : float
        Mean training loss over all steps.
    train_seconds : float
        Wall-clock seconds of local training, statistics included.
    fisher_seconds : float
        Seconds of the statistics (Fisher, curvature) accumulated inside training.
    """

    arrays: dict[str, NDArray]
    num_examples: int
    loss: float
    train_seconds: float
    fisher_seconds: float
