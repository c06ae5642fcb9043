"""A capacity is a budget in bytes too: each client's bytes moved against the bytes of its submodel.

A client of capacity ``gamma`` trains ``k = ceil(gamma d)`` values. What it may move per round it
trains is the bytes of those values plus the encoding of its mask (its *share*); a method keeps a
client within capacity in bytes when, over the whole run (warm-up and Fisher refreshes included),
its bytes down and its bytes up each stay within a small multiple of the sum of its shares.

:class:`ByteLedger` keeps those three sums per client on the server, so a method can ask before it
sends anything beyond the submodel (the rest of the model for a Fisher measurement, a Fisher upload)
whether the client can afford it *now*: the ledger never lets a client's running total pass
``budget`` times the shares of the rounds it has trained so far, so the mean over the run stays
within it at every round, whatever the client's participation. :func:`byte_ratios` is the same
yardstick applied afterwards to a run's records.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from common.fisher.selection import budget

#: The largest ratio of bytes moved to bytes of the submodel that still counts as within capacity.
BYTES_SLACK = 1.1


@dataclass
class ClientBytes:
    """One client's running totals, in bytes.

    Parameters
    ----------
    share : int
        Sum over the rounds it trained of its submodel's values and mask bytes.
    down : int
        Bytes sent to it (submodels, and whatever came with them).
    up : int
        Bytes it sent (updates, Fisher payloads).
    """

    share: int = 0
    down: int = 0
    up: int = 0


class ByteLedger:
    """Per-client bytes moved against the bytes of the submodels trained, for a budget set as a
    multiple.

    Parameters
    ----------
    budget : float
        The multiple of a client's shares its bytes down, and separately its bytes up, may reach
        (``> 0``).
    """

    def __init__(self, budget: float) -> None:
        if not budget > 0:
            raise ValueError(f"budget must be positive, got {budget}")
        self.budget = budget
        self.clients: dict[str, ClientBytes] = {}

    def entry(self, key: str) -> ClientBytes:
        """The totals of ``key`` (a new client starts at zero)."""
        return self.clients.setdefault(key, ClientBytes())

    def charge_round(self, key: str, share: int) -> None:
        """A round's submodel sent to ``key``: ``share`` bytes of values and mask, its share and its
        bytes down."""
        if share < 0:
            raise ValueError(f"bytes must be non-negative, got share={share}")
        e = self.entry(key)
        e.share += share
        e.down += share

    def charge(self, key: str, down: int = 0, up: int = 0) -> None:
        """Bytes moved beyond a round's submodel: ``down`` to ``key``, ``up`` from it."""
        if down < 0 or up < 0:
            raise ValueError(f"bytes must be non-negative, got down={down} up={up}")
        e = self.entry(key)
        e.down += down
        e.up += up

    def room(self, key: str) -> tuple[int, int]:
        """Bytes ``key`` can still take down and send up now without passing ``budget`` times its
        shares.

        Either can be negative (a client already over, for example by a larger upload than it was
        granted).
        """
        e = self.entry(key)
        allowed = int(self.budget * e.share)
        return allowed - e.down, allowed - e.up

    def arrays(self) -> dict[str, NDArray]:
        """The totals as named arrays (``ledger_*``), for the method's state archive (the budget is
        the run's)."""
        keys = list(self.clients)
        totals = [[self.clients[k].share, self.clients[k].down, self.clients[k].up] for k in keys]
        return {
            "ledger_keys": np.frombuffer(json.dumps(keys).encode(), dtype=np.uint8),
            "ledger_totals": np.array(totals, dtype=np.int64).reshape(len(keys), 3),
        }

    @classmethod
    def from_arrays(cls, z: Mapping[str, NDArray], budget: float) -> ByteLedger:
        """Restore :meth:`arrays` (e.g. from an opened npz) under the run's ``budget``."""
        out = cls(budget)
        keys = json.loads(np.asarray(z["ledger_keys"]).tobytes())
        for key, (share, down, up) in zip(keys, np.asarray(z["ledger_totals"]), strict=True):
            out.clients[str(key)] = ClientBytes(int(share), int(down), int(up))
        return out


def byte_ratios(
    entries: Iterable[Mapping[str, Any]], d: int
) -> dict[str, tuple[float, float, float]]:
    """Per client, its bytes down and up over the run divided by the bytes of its submodels, and its
    capacity.

    Parameters
    ----------
    entries : Iterable[Mapping]
        Every per-client entry of a run's records (``clients`` of each round, the opening's
        included), each with ``bytes_down``, ``bytes_up``, ``capacity``, ``mask_bytes`` and
        ``client_key`` (or ``node_id``); an entry with ``train`` false (an opening or warm-up
        message) adds bytes but no share.
    d : int
        The model's trainable positions (a share's values are ``4 ceil(capacity d)`` bytes).

    Returns
    -------
    dict
        Client key -> ``(down ratio, up ratio, capacity)``; clients that trained no round are left
        out.
    """
    totals: dict[str, list[float]] = {}
    for e in entries:
        key = str(e.get("client_key") or e["node_id"])
        t = totals.setdefault(key, [0.0, 0.0, 0.0, float(e["capacity"])])
        t[1] += e["bytes_down"]
        t[2] += e.get("bytes_up", 0)
        if e.get("train", True):
            t[0] += 4 * budget(e["capacity"], d) + e["mask_bytes"]
    return {
        k: (down / share, up / share, cap)
        for k, (share, down, up, cap) in totals.items()
        if share > 0
    }
