"""The server's knowledge of each client's diagonal Fisher.

* Per client: the last uploaded Fisher (optionally an EMA across
  participations), normalised to mean 1, and the round it was measured in.
* Global prior: the example-weighted mean of the clients' current estimates.

Normalising each upload to mean 1 makes the ranking of one client unaffected
(top-k is scale-invariant), makes the blend with the prior meaningful when
clients' loss scales differ, and keeps a client that scales its Fisher by a huge
factor from dominating the prior.

With ``trim > 0`` the prior is instead the coordinate-wise trimmed mean of the
clients' estimates (the ``trim`` share of highest and of lowest values at each
position dropped; at least one each once three clients reported), so a client
that shapes its upload adversarially cannot drag a position of the prior
outside the range the other clients span. It costs a sort over the stored
estimates when the prior is recomputed (once per round that brought uploads).

Estimates age when a client sits out rounds. The estimate used for a client at
round ``t`` is ``a * F_client + (1 - a) * F_global`` with
``a = decay ** (t - measured_round - 1)``: fully trusted the round after it was
measured, drifting toward the prior as it ages.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

ClientKey = int | str  # a stable client identity (the strategy uses the client key it reports)


@dataclass
class ClientFisher:
    """A client's current estimate.

    Parameters
    ----------
    fisher : NDArray[float32]
        Normalised flat Fisher (mean 1).
    weight : float
        The client's weight in the global prior (its example count).
    round : int
        Round in which it was last measured.
    """

    fisher: NDArray[np.float32]
    weight: float
    round: int


class FisherState:
    """Per-client Fisher estimates and the global prior.

    Parameters
    ----------
    d : int
        Flat model size.
    staleness_decay : float
        Per-round trust factor in [0, 1] for a client's own estimate as it ages.
    ema : float
        Weight of the previous estimate when a client uploads again (0 = replace).
    trim : float
        Share of clients trimmed at each end, per position, in the prior (0 = example-weighted mean).
    """

    def __init__(self, d: int, staleness_decay: float = 0.7, ema: float = 0.0, trim: float = 0.0) -> None:
        if not 0 <= trim < 0.5:
            raise ValueError(f"trim must be in [0, 0.5), got {trim}")
        self.d = d
        self.staleness_decay = staleness_decay
        self.ema = ema
        self.trim = trim
        self._trimmed: NDArray[np.float32] | None = None
        self.clients: dict[ClientKey, ClientFisher] = {}
        self._sum = np.zeros(d, dtype=np.float64)
        self._weight = 0.0

    @staticmethod
    def normalise(fisher: NDArray) -> NDArray[np.float32] | None:
        """Scale to mean 1; ``None`` when the estimate carries no information (all zero)."""
        mean = float(np.mean(fisher, dtype=np.float64))
        if not np.isfinite(mean) or mean <= 0:
            return None
        return (np.asarray(fisher, dtype=np.float64) / mean).astype(np.float32)

    def update(self, client: ClientKey, fisher: NDArray, weight: float, round: int) -> bool:
        """Record a validated upload; returns ``False`` if it was uninformative (all zero)."""
        if fisher.shape != (self.d,):
            raise ValueError(f"fisher has shape {fisher.shape}, expected ({self.d},)")
        new = self.normalise(fisher)
        if new is None:
            return False
        old = self.clients.get(client)
        if old is not None:
            if self.ema > 0:
                new = (self.ema * old.fisher + (1 - self.ema) * new).astype(np.float32)
            self._sum -= old.weight * old.fisher
            self._weight -= old.weight
        self.clients[client] = ClientFisher(new, float(weight), round)
        self._trimmed = None
        self._sum += weight * new
        self._weight += weight
        return True

    def global_prior(self) -> NDArray[np.float32] | None:
        """The prior (trimmed or example-weighted mean of the estimates), or ``None`` before any upload."""
        if not self.clients or self._weight <= 0:
            return None
        n = len(self.clients)
        if self.trim > 0 and n >= 3:
            if self._trimmed is None:
                k = max(1, int(self.trim * n))
                ordered = np.sort(np.stack([c.fisher for c in self.clients.values()]), axis=0)
                self._trimmed = ordered[k : n - k].mean(axis=0, dtype=np.float64).astype(np.float32)
            return self._trimmed
        return np.maximum(self._sum / self._weight, 0).astype(np.float32)

    def estimate(self, client: ClientKey, round: int) -> NDArray[np.float32] | None:
        """Fisher to rank positions for ``client`` at ``round`` (``None``: nothing known yet)."""
        own = self.clients.get(client)
        if own is None:
            return self.global_prior()
        trust = self.staleness_decay ** max(round - own.round - 1, 0)
        if trust >= 1.0:
            return own.fisher
        prior = self.global_prior()  # not None: this client's own estimate is part of it
        return (trust * own.fisher + (1 - trust) * prior).astype(np.float32)

    def to_bytes(self) -> bytes:
        """Serialise (npz) for checkpoints."""
        ids = list(self.clients)
        buf = io.BytesIO()
        np.savez(
            buf,
            d=np.array(self.d),
            params=np.array([self.staleness_decay, self.ema, self.trim]),
            ids=np.frombuffer(json.dumps(ids).encode(), dtype=np.uint8),
            weights=np.array([self.clients[i].weight for i in ids], dtype=np.float64),
            rounds=np.array([self.clients[i].round for i in ids], dtype=np.int64),
            fisher=np.stack([self.clients[i].fisher for i in ids]) if ids else np.zeros((0, self.d), np.float32),
        )
        return buf.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes) -> FisherState:
        """Restore from :meth:`to_bytes`."""
        z = np.load(io.BytesIO(data))
        state = cls(int(z["d"]), *(float(p) for p in z["params"]))
        for i, w, r, f in zip(json.loads(z["ids"].tobytes()), z["weights"], z["rounds"], z["fisher"]):
            state.clients[i] = ClientFisher(f.astype(np.float32), float(w), int(r))
            state._sum += w * f
            state._weight += float(w)
        return state
