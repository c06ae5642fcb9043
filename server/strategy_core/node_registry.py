"""The federation's nodes: discovery (QUERY), what each reported, who joined and who left since the
last record.

Both strategies keep one :class:`NodeRegistry`. It asks the SuperLink which nodes are connected,
QUERYs the new ones for their profile, forgets departed ones, and answers which nodes train (the
method's :meth:`~common.methods.contract.server_side.ServerMethod.participates` and the round's
``fraction-train`` sample).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from logging import INFO, WARNING
from typing import Any

from flwr.app import Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid

from common.config.run import RunConfig
from common.methods.contract.server_side import ServerMethod
from common.wire import protocol as P
from common.wire.validation import ReplyError, validate_profile
from server.grid_io import exchange, wait_for_nodes
from server.participation import sample_clients
from server.replies import ReplyParts, reply_parts


@dataclass
class NodeProfile:
    """What discovery learned about a node."""

    capacity: float
    device: str
    num_train: int
    num_test: int
    key: str = ""  # stable client identity (survives a SuperNode restart, unlike the node id)
    capacity_source: str = "node-config"  # or "auto": measured by the node's device probe


class NodeRegistry:
    """The discovered nodes by node id, and the joins and departures not yet written to a round
    record.

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration (``min-nodes``, ``min-train-nodes``, ``fraction-train``,
        ``seed``, ``poll-interval``).
    method : ServerMethod
        The run's method: told of each node that joins, and asked which capacities take part.
    """

    def __init__(self, cfg: RunConfig, method: ServerMethod) -> None:
        self.cfg = cfg
        self.method = method
        self.nodes: dict[int, NodeProfile] = {}
        self.excluded: set[int] = (
            set()
        )  # left out at discovery (misconfigured, or Flower answered for them)
        # Nodes excluded at discovery or departed since the last round record, with why
        # (``nodes_out``).
        self.nodes_out: list[dict[str, Any]] = []
        # Nodes discovered since the last round record, with what they reported of their own data
        # (``nodes_in``).
        self.nodes_in: list[dict[str, Any]] = []

    # ------------------------------------------------------------ who trains
    def capacities(self) -> list[float]:
        """The capacity of every discovered node, in discovery order."""
        return [p.capacity for p in self.nodes.values()]

    def participants(self) -> list[int]:
        """Discovered nodes that train, by node id (the method may leave some out, e.g. by
        capacity)."""
        return [
            nid for nid in sorted(self.nodes) if self.method.participates(self.nodes[nid].capacity)
        ]

    def round_participants(self, server_round: int) -> list[int]:
        """The participants that train in ``server_round``: a seeded sample of ``fraction-train`` of
        them."""
        eligible = self.participants()
        if self.cfg.fraction_train == 1:
            return eligible
        by_key = {self.nodes[nid].key: nid for nid in eligible}
        keys = sample_clients(
            list(by_key),
            self.cfg.fraction_train,
            self.cfg.min_train_nodes,
            self.cfg.seed,
            server_round,
        )
        return sorted(by_key[k] for k in keys)

    # ------------------------------------------------------------- discovery
    def in_key_order(self, node_ids: Iterable[int]) -> list[int]:
        """``node_ids`` sorted by the clients' stable keys (node ids last, for a node not
        discovered).

        Not arrival order nor node ids (which the Simulation Engine draws anew each run): the float
        sums of the fold and FedRolex's order-dependent count weights then repeat from run to run.
        """
        nodes = self.nodes
        return sorted(
            node_ids,
            key=lambda nid: (nid not in nodes, nodes[nid].key if nid in nodes else "", nid),
        )

    def join(
        self, grid: Grid, timeout: float, discover: Callable[[Grid, float], None] | None = None
    ) -> None:
        """Wait for ``min-nodes`` SuperNodes, discover them, and stop with the reason when none can
        train.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid.
        timeout : float
            Seconds to wait for the nodes, and for their discovery replies.
        discover : Callable, optional
            ``(grid, timeout)``: the discovery exchange, which passes each reply to
            :meth:`profile_reply` (default :meth:`discover`; the strategy's may carry more, e.g. the
            Fisher warm-up).
        """
        wait_for_nodes(grid, self.cfg.min_nodes, timeout, self.cfg.poll_interval)
        (discover or self.discover)(grid, timeout)
        if not self.nodes:
            raise RuntimeError(
                "no usable node answered discovery; check the SuperNodes' --node-config"
            )
        if not self.participants():
            requirement = self.method.participation_requirement
            raise RuntimeError(
                f"method {self.cfg.method!r} found no node that can take part"
                + (f" ({requirement})" if requirement else "")
            )

    def await_train_nodes(self, grid: Grid, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until ``min-train-nodes`` participants are known; else stop
        with why."""
        deadline = time.monotonic() + timeout
        while len(self.participants()) < self.cfg.min_train_nodes:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"min-train-nodes={self.cfg.min_train_nodes}: only {len(self.participants())} "
                    f"node(s) can train after waiting {timeout:.0f} s ({len(grid.get_node_ids())} "
                    f"connected, {len(self.excluded)} excluded for a bad node config); start more "
                    "SuperNodes or lower min-train-nodes"
                )
            time.sleep(max(self.cfg.poll_interval, 0.5))
            self.refresh(grid, min(timeout, 60.0))

    def refresh(self, grid: Grid, timeout: float) -> None:
        """Track the SuperLink's connected nodes: forget departed ones, QUERY new ones.

        Runs before every round, so a SuperNode that joins mid-run (or restarts
        with a new node id) takes part from the next round; its method state is
        found again through its stable client key.
        """
        connected = set(grid.get_node_ids())
        for node_id in sorted(set(self.nodes) - connected):
            key = self.nodes.pop(node_id).key
            log(WARNING, "node %d (%s) left the federation", node_id, key)
            self.node_out(node_id, key, "departed", "no longer connected to the SuperLink")
        new = sorted(connected - set(self.nodes) - self.excluded)
        if new:
            self.discover(grid, timeout, new)

    def discover(self, grid: Grid, timeout: float, node_ids: list[int] | None = None) -> None:
        """QUERY nodes (default: every connected one) for capacity, device, example counts and
        client key."""
        node_ids = sorted(grid.get_node_ids()) if node_ids is None else node_ids
        msgs = [
            Message(content=RecordDict(), dst_node_id=nid, message_type=MessageType.QUERY)
            for nid in node_ids
        ]
        for msg in exchange(grid, msgs, timeout, self.cfg.poll_interval):
            self.profile_reply(reply_parts(msg, None, P.PROFILE, None))

    def profile_reply(self, parts: ReplyParts) -> bool:
        """Register the node of one discovery reply (``True``), or exclude it (logged, noted for
        ``nodes_out``)."""
        try:
            if parts.error:
                raise ReplyError(parts.error)
            err = None
            if parts.metrics is None and "error" in parts.extras:
                err = str(parts.extras["error"])
            capacity, n_train, n_test = validate_profile(parts.metrics, err)
        except ReplyError as e:
            log(WARNING, "node %d excluded at discovery: %s", parts.node_id, e)
            self.excluded.add(parts.node_id)
            self.node_out(parts.node_id, parts.extras.get("client-key"), "excluded", str(e))
            return False
        device = str(parts.extras.get("device", "unknown"))
        key = str(parts.extras.get("client-key") or f"node-{parts.node_id}")
        if any(p.key == key for p in self.nodes.values()):
            log(
                WARNING,
                "node %d reports client key %r already in use; keyed by its node id",
                parts.node_id,
                key,
            )
            key = f"node-{parts.node_id}"
        source = "auto" if parts.extras.get("capacity-source") == "auto" else "node-config"
        self.nodes[parts.node_id] = NodeProfile(capacity, device, n_train, n_test, key, source)
        self.method.node_joined(key, parts.extras)
        data = str(parts.extras["data"]) if "data" in parts.extras else None
        self.nodes_in.append(
            {
                "node_id": parts.node_id,
                "client_key": key,
                "capacity": capacity,
                "num_train": n_train,
            }
            | ({"data": data} if data else {})
        )
        if data:
            log(INFO, "node %d (%s) reads its own data: %s", parts.node_id, key, data)
        probe = ""
        if source == "auto" and parts.metrics is not None:
            gib = float(parts.metrics.get("probe-memory-gib", float("nan")))
            gflops = float(parts.metrics.get("probe-gflops", float("nan")))
            probe = f" (measured: {gib:.1f} GiB, {gflops:.1f} GFLOP/s)"
        log(
            INFO,
            "node %d: capacity=%.4g%s device=%s train=%d test=%d",
            parts.node_id,
            capacity,
            probe,
            device,
            n_train,
            n_test,
        )
        return True

    # ------------------------------------------------------ record bookkeeping
    def node_out(self, node_id: int, key: Any, event: str, reason: str) -> None:
        """Note that a node was left out (``excluded``) or left (``departed``), for the next round
        record."""
        self.nodes_out.append(
            {
                "node_id": node_id,
                "client_key": None if key is None else str(key),
                "event": event,
                "reason": reason,
            }
        )

    def take_nodes_out(self) -> list[dict[str, Any]]:
        """The nodes left out or departed since the last call (a round record's ``nodes_out``)."""
        out, self.nodes_out = self.nodes_out, []
        return out

    def take_nodes_in(self) -> list[dict[str, Any]]:
        """The nodes discovered since the last call (a round record's ``nodes_in``)."""
        out, self.nodes_in = self.nodes_in, []
        return out
