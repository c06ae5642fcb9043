"""The clusters of a clustered run: each one's method and model, who is placed where, and the
signatures that place the next nodes.

The first cluster is the strategy's own method and model; every node trains it until it is placed.
A node is placed once, by its signature (its first accepted update, or its first uploaded Fisher):
:func:`common.aggregation.clustering.place` picks the cluster, and a new cluster starts as a copy of
the first, made from its checkpoint state (what a resumed run would continue from).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from logging import INFO
from typing import Any

import numpy as np
from flwr.common.logger import log
from numpy.typing import NDArray

from common.aggregation.clustering import centred, held_cosine, place, unit
from common.config.run import RunConfig
from common.methods.contract.server_side import ServerMethod
from common.methods.round_fold import Accepted
from common.models.layout import ParamLayout


@dataclass
class Cluster:
    """One cluster.

    Parameters
    ----------
    method : ServerMethod or None
        Its copy of the run's method; ``None`` for the first cluster (the strategy's own).
    x : NDArray[float32] or None
        Its model; ``None`` for the first cluster (the strategy's own ``x``).
    direction : NDArray[float64] or None
        Its members' summed unit signatures; ``None`` until its first member.
    members : int
        Nodes placed in it.
    """

    method: ServerMethod | None
    x: NDArray[np.float32] | None
    direction: NDArray[np.float64] | None = None
    members: int = 0


@dataclass
class ClusterSet:
    """Every cluster of a run, and the placement of its nodes by client key.

    Parameters
    ----------
    cfg : RunConfig
        The run (``cluster-by``, ``cluster-threshold``, ``cluster-max``).
    layout : ParamLayout
        The global model's layout (each copy of the method starts on it).
    make_method : Callable
        A fresh, unstarted instance of the run's method.
    """

    cfg: RunConfig
    layout: ParamLayout
    make_method: Callable[[], ServerMethod]
    clusters: list[Cluster] = field(default_factory=lambda: [Cluster(None, None)])
    of: dict[str, int] = field(default_factory=dict)
    pending: dict[str, NDArray[np.float32]] = field(default_factory=dict)

    def cluster_of(self, key: str) -> int:
        """The cluster a client trains in: its own once placed, else the first."""
        return self.of.get(key, 0)

    def capture(self, accepted: Accepted, warm_up: bool) -> None:
        """Keep an unplaced client's signature from a reply being folded (placed after the fold).

        ``updates``: the reply's update, zero outside the positions it held (a warm-up's update is
        zero, so it places no one); ``fisher``: the Fisher it uploaded, when it uploaded one.
        """
        if accepted.key in self.of:
            return
        reply = accepted.reply
        if self.cfg.cluster_by == "fisher":
            if reply.fisher is not None:
                self.pending[accepted.key] = np.asarray(reply.fisher, dtype=np.float32).copy()
        elif not warm_up:
            signature = np.zeros(self.layout.size, dtype=np.float32)
            signature[reply.update.indices] = reply.update.delta
            self.pending[accepted.key] = signature

    def drop_pending(self) -> None:
        """Forget the signatures of a fold that was discarded (its round did not count)."""
        self.pending.clear()

    def place_pending(
        self, first: ServerMethod, first_x: NDArray[np.float32], levels: Mapping[str, float]
    ) -> None:
        """Place every client whose signature was captured, in key order, by its signature centred
        on its capacity level's (:func:`~common.aggregation.clustering.centred`; ``levels``: each
        client's capacity); a new cluster copies the first cluster's method (``first``) and model
        (``first_x``) as they are now."""
        signatures = centred(self.pending, levels)
        self.pending.clear()
        for key in sorted(signatures):
            signature = signatures[key]
            directions = [c.direction for c in self.clusters]
            c = place(signature, directions, self.cfg.cluster_threshold, self.cfg.cluster_max)
            if c == len(self.clusters):
                self.clusters.append(
                    Cluster(self._method_from(first.state_bytes()), first_x.copy())
                )
            cluster = self.clusters[c]
            similarity = (
                1.0 if cluster.direction is None else held_cosine(signature, cluster.direction)
            )
            step = unit(signature)
            cluster.direction = step if cluster.direction is None else cluster.direction + step
            cluster.members += 1
            self.of[key] = c
            log(INFO, "client %s placed in cluster %d (similarity %.3f)", key, c, similarity)

    def _method_from(self, state: bytes) -> ServerMethod:
        """A fresh instance of the run's method on the layout, holding checkpoint ``state``."""
        method = self.make_method()
        method.start_server(self.layout)
        method.load_state(state)
        return method

    def record(self, keys: Iterable[str]) -> dict[str, Any]:
        """A round record's ``clusters`` entry for the clients ``keys``: who is where, and sizes."""
        keys = sorted(keys)
        return {
            "by": self.cfg.cluster_by,
            "of": {k: self.of[k] for k in keys if k in self.of},
            "unplaced": [k for k in keys if k not in self.of],
            "sizes": [c.members for c in self.clusters],
        }

    # ------------------------------------------------------------ checkpoint
    def state_bytes(self, first: ServerMethod) -> bytes:
        """Everything to resume the clusters, the first cluster's method state included."""
        keys = sorted(self.of)
        arrays: dict[str, NDArray] = {
            "first_state": np.frombuffer(first.state_bytes(), dtype=np.uint8),
            "keys": np.array(keys, dtype=str),
            "placed_in": np.array([self.of[k] for k in keys], dtype=np.int64),
            "members": np.array([c.members for c in self.clusters], dtype=np.int64),
        }
        for i, c in enumerate(self.clusters):
            if c.direction is not None:
                arrays[f"direction_{i}"] = c.direction
            if i > 0:
                assert c.method is not None and c.x is not None
                arrays[f"x_{i}"] = c.x
                arrays[f"state_{i}"] = np.frombuffer(c.method.state_bytes(), dtype=np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        return buf.getvalue()

    def load_state(self, data: bytes, first: ServerMethod) -> None:
        """Restore :meth:`state_bytes` (the first cluster's method state into ``first``)."""
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if "first_state" not in z.files:
                raise ValueError(
                    "the checkpoint holds no clusters: it was written by a run without cluster-by"
                )
            first.load_state(z["first_state"].tobytes())
            self.clusters = []
            for i, members in enumerate(z["members"].tolist()):
                direction = z[f"direction_{i}"] if f"direction_{i}" in z.files else None
                method, x = None, None
                if i > 0:
                    method = self._method_from(z[f"state_{i}"].tobytes())
                    x = z[f"x_{i}"].astype(np.float32)
                self.clusters.append(Cluster(method, x, direction, int(members)))
            self.of = dict(zip(z["keys"].tolist(), z["placed_in"].tolist(), strict=True))
        self.pending.clear()
