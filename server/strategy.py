"""The ServerApp's Flower strategy: method-agnostic rounds of per-node submodels.

Everything that differs between methods (which nodes train, what each is sent, how a reply is
checked and aggregated, the state kept between rounds) is asked of the run's
:class:`~common.methods.base.Method`. This module turns it into Messages, validates and counts
replies, evaluates, and keeps the per-round bookkeeping written to metrics.json.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from numpy.typing import NDArray

from common.config.run import RunConfig
from common.methods import create_method
from common.methods.base import Accepted, Method
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.validation import ReplyError, SentSubmodel, TrainReply, validate_evaluate_reply, validate_profile
from server.federated_evaluation import NODES_SOURCE, NodeEvaluation, federated_figures, global_figures
from server.grid_io import exchange, wait_for_nodes
from server.mask_stability import MaskHistory, per_capacity_means
from server.participation import sample_clients
from server.replies import ReplyParts, expected_sent, reply_parts

#: Flower's signature for central evaluation: ``(server_round, arrays) -> metrics`` (``accuracy``, ``loss``).
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


@dataclass
class NodeProfile:
    """What discovery learned about a node."""

    capacity: float
    device: str
    num_train: int
    num_test: int
    key: str = ""  # stable client identity (survives a SuperNode restart, unlike the node id)
    capacity_source: str = "node-config"  # or "auto": measured by the node's device probe


@dataclass
class ClientRound:
    """Per-client bookkeeping of one round (one entry of ``clients`` in metrics.json)."""

    node_id: int
    capacity: float
    device: str
    mask_source: str
    selected: int
    density: float
    bytes_down: int
    values_bytes: int
    mask_bytes: int
    mask_kind: str
    bytes_up: int = 0
    status: str = "no reply"
    train_loss: float | None = None
    train_seconds: float | None = None
    fisher_seconds: float | None = None
    peak_rss_mib: float | None = None  # the client process's peak resident memory while it trained
    num_examples: int | None = None
    capacity_source: str = "node-config"
    client_key: str = ""  # the node's stable client key (survives a SuperNode restart, unlike the node id)
    fisher_asked: bool = False  # the message asked for the node's Fisher
    fisher_at_bytes: int = 0  # bytes of the global values outside the mask sent for a Fisher refresh
    mask_overlap: float | None = None  # Jaccard overlap with this client's previous TRAIN mask (None: first)
    layer_positions: dict[str, int] | None = None  # held positions per tensor (TRAIN messages)
    submodel_accuracy: float | None = None  # the round's global model on this client's mask, server test set
    submodel_loss: float | None = None


def array_record(arrays: Mapping[str, NDArray]) -> ArrayRecord:
    """Named numpy arrays as an ArrayRecord (each made contiguous, as Flower serialises it)."""
    return ArrayRecord({n: Array(np.ascontiguousarray(a)) for n, a in arrays.items()})


class SubmodelStrategy(Strategy):
    """Heterogeneous-capacity federated training: each node trains the submodel its method gives it.

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration.
    layout : ParamLayout
        Flat layout of the global model.
    method : Method, optional
        The method (default: the one ``cfg.method`` names, from the registry).
    on_round : Callable, optional
        Called with each round's record (a JSON-ready dict) after the round ends.
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: ParamLayout,
        method: Method | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.method = method if method is not None else create_method(cfg)
        self.method.start_server(layout)
        self.on_round = on_round
        self.evaluate_fn: EvaluateFn | None = None
        self.nodes: dict[int, NodeProfile] = {}
        self.excluded: set[int] = set()  # left out at discovery (misconfigured, or Flower answered for them)
        # Nodes excluded at discovery or departed since the last round record, with why (``nodes_out``).
        self.nodes_out: list[dict[str, Any]] = []
        # Nodes discovered since the last round record, with what they reported of their own data (``nodes_in``).
        self.nodes_in: list[dict[str, Any]] = []
        self.federated: dict[str, Any] | None = None  # the last evaluation round's node-measured figures
        self.sent: dict[int, SentSubmodel] = {}
        self.sent_eval: dict[int, SentSubmodel] = {}
        self.clients: dict[int, ClientRound] = {}
        self.x: NDArray[np.float32] = np.zeros(layout.size, dtype=np.float32)
        self.first_round = 1  # > 1 when resuming from a checkpoint
        self.mask_history = MaskHistory(layout.size)

    # ------------------------------------------------------------------ helpers
    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(INFO, "%s: %s d=%d", type(self).__name__, self.method.describe(), self.layout.size)

    def _flat(self, arrays: ArrayRecord) -> NDArray[np.float32]:
        return self.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})

    def to_arrays(self, flat: NDArray[np.float32]) -> ArrayRecord:
        """The flat vector as an ArrayRecord of named tensors."""
        return array_record(self.layout.unflatten(flat))

    def node_mask(self, node_id: int, server_round: int) -> tuple[NDArray[np.bool_], str]:
        """The submodel mask of a discovered node for ``server_round``, and the rule that chose it."""
        prof = self.nodes[node_id]
        return self.method.mask_for(prof.key, server_round, prof.capacity, self.x)

    def level_mask(self, server_round: int, gamma: float) -> tuple[NDArray[np.bool_], str]:
        """The submodel of capacity level ``gamma`` that central evaluation measures after ``server_round``."""
        return self.method.mask_for(None, server_round + 1, gamma, self.x)

    def participants(self) -> list[int]:
        """Discovered nodes that train, by node id (the method may leave some out, e.g. by capacity)."""
        return [nid for nid in sorted(self.nodes) if self.method.participates(self.nodes[nid].capacity)]

    def round_participants(self, server_round: int) -> list[int]:
        """The participants that train in ``server_round``: a seeded sample of ``fraction-train`` of them."""
        eligible = self.participants()
        if self.cfg.fraction_train == 1:
            return eligible
        by_key = {self.nodes[nid].key: nid for nid in eligible}
        keys = sample_clients(
            list(by_key), self.cfg.fraction_train, self.cfg.min_train_nodes, self.cfg.seed, server_round
        )
        return sorted(by_key[k] for k in keys)

    def await_train_nodes(self, grid: Grid, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until ``min-train-nodes`` participants are known; else stop with why."""
        deadline = time.monotonic() + timeout
        while len(self.participants()) < self.cfg.min_train_nodes:
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"min-train-nodes={self.cfg.min_train_nodes}: only {len(self.participants())} node(s) "
                    f"can train after waiting {timeout:.0f} s ({len(grid.get_node_ids())} connected, "
                    f"{len(self.excluded)} excluded for a bad node config); start more SuperNodes or lower "
                    "min-train-nodes"
                )
            time.sleep(max(self.cfg.poll_interval, 0.5))
            self.refresh_nodes(grid, min(timeout, 60.0))

    def submodel_message(
        self,
        node_id: int,
        server_round: int,
        message_type: str,
        store: dict[int, SentSubmodel],
        mask_and_source: tuple[NDArray[np.bool_], str] | None = None,
        config: ConfigRecord | None = None,
    ) -> tuple[Message, ClientRound]:
        """The Message carrying a node's submodel, and its bookkeeping entry; records what was sent in ``store``.

        Parameters
        ----------
        node_id : int
            Destination.
        server_round : int
            Written to the message's ``round`` (a dispatch number in asynchronous runs).
        message_type : str
            ``MessageType.TRAIN`` or ``MessageType.EVALUATE``.
        store : dict
            Where the :class:`SentSubmodel` is kept, to check the reply against.
        mask_and_source : tuple, optional
            The mask to send (default: :meth:`node_mask` for ``server_round``).
        config : ConfigRecord, optional
            Extra settings for the node (``train_config`` / ``evaluate_config`` of :meth:`start`), sent as
            the ``config`` record when not empty.
        """
        prof = self.nodes[node_id]
        mask, source = mask_and_source if mask_and_source is not None else self.node_mask(node_id, server_round)
        download = self.method.encode(self.x, mask)
        records = {name: array_record(arrays) for name, arrays in download.records.items()}
        request = None
        if message_type == MessageType.TRAIN:
            request = self.method.fisher_request(prof.key, server_round, self.x, mask)
        if request is not None and request.arrays:
            records[P.FISHER_AT] = array_record(request.arrays)
        round_config = ConfigRecord(
            {"mask-kind": download.kind, "mask-digest": download.digest, "d": self.layout.size, "round": server_round}
        )
        store[node_id] = SentSubmodel(node_id, server_round, mask, download.digest, prof.num_train, request is not None)
        k = int(mask.sum())
        info = ClientRound(
            node_id=node_id,
            client_key=prof.key,
            capacity=prof.capacity,
            device=prof.device,
            mask_source=source,
            selected=k,
            density=k / self.layout.size,
            bytes_down=sum(r.count_bytes() for r in records.values()),
            values_bytes=download.values_bytes,
            mask_bytes=download.mask_bytes,
            mask_kind=download.kind,
            capacity_source=prof.capacity_source,
            fisher_asked=request is not None,
            fisher_at_bytes=records[P.FISHER_AT].count_bytes() if P.FISHER_AT in records else 0,
        )
        if message_type == MessageType.TRAIN:
            info.mask_overlap = self.mask_history.observe(prof.key, mask)
            info.layer_positions = self.layout.count_per_tensor(mask)
        content = RecordDict({**records, P.SUBMODEL_CONFIG: round_config})
        if config:
            content[P.CONFIG] = config
        return Message(content=content, dst_node_id=node_id, message_type=message_type), info

    # ---------------------------------------------------------------- discovery
    def refresh_nodes(self, grid: Grid, timeout: float) -> None:
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
        """QUERY nodes (default: every connected one) for capacity, device, example counts and client key."""
        node_ids = sorted(grid.get_node_ids()) if node_ids is None else node_ids
        msgs = [Message(content=RecordDict(), dst_node_id=nid, message_type=MessageType.QUERY) for nid in node_ids]
        for msg in exchange(grid, msgs, timeout, self.cfg.poll_interval):
            parts = reply_parts(msg, None, P.PROFILE, None)
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
                continue
            device = str(parts.extras.get("device", "unknown"))
            key = str(parts.extras.get("client-key") or f"node-{parts.node_id}")
            if any(p.key == key for p in self.nodes.values()):
                log(WARNING, "node %d reports client key %r already in use; keyed by its node id", parts.node_id, key)
                key = f"node-{parts.node_id}"
            source = "auto" if parts.extras.get("capacity-source") == "auto" else "node-config"
            self.nodes[parts.node_id] = NodeProfile(capacity, device, n_train, n_test, key, source)
            self.method.node_joined(key, parts.extras)
            data = str(parts.extras["data"]) if "data" in parts.extras else None
            self.nodes_in.append(
                {"node_id": parts.node_id, "client_key": key, "capacity": capacity, "num_train": n_train}
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

    def node_out(self, node_id: int, key: Any, event: str, reason: str) -> None:
        """Note that a node was left out (``excluded``) or left (``departed``), for the next round record."""
        self.nodes_out.append(
            {"node_id": node_id, "client_key": None if key is None else str(key), "event": event, "reason": reason}
        )

    def take_nodes_out(self) -> list[dict[str, Any]]:
        """The nodes left out or departed since the last call (a round record's ``nodes_out``)."""
        out, self.nodes_out = self.nodes_out, []
        return out

    def take_nodes_in(self) -> list[dict[str, Any]]:
        """The nodes discovered since the last call (a round record's ``nodes_in``)."""
        out, self.nodes_in = self.nodes_in, []
        return out

    def take_federated(self) -> dict[str, Any] | None:
        """The node-measured figures of the evaluation since the last call (a round record's ``federated``)."""
        out, self.federated = self.federated, None
        return out

    # ------------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One Message per participating node, each carrying only that node's submodel."""
        self.x = self._flat(arrays)
        return self.train_messages(server_round, self.round_participants(server_round), config)

    def train_messages(
        self, server_round: int, node_ids: Iterable[int], config: ConfigRecord | None = None
    ) -> list[Message]:
        """TRAIN messages for ``node_ids``; what each was sent becomes this round's ``sent`` and ``clients``."""
        self.sent, self.clients = {}, {}
        msgs = []
        for node_id in node_ids:
            msg, info = self.submodel_message(node_id, server_round, MessageType.TRAIN, self.sent, config=config)
            msgs.append(msg)
            self.clients[node_id] = info
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies and let the method aggregate the accepted ones."""
        parts = [reply_parts(m, P.UPDATE, P.METRICS, P.META) for m in replies]
        accepted = self.apply_train_replies(server_round, parts)
        if not accepted:
            return None, None
        records = [RecordDict({P.METRICS: MetricRecord(r.metrics)}) for r in accepted]
        metrics = aggregate_metricrecords(records, "num-examples")
        metrics["num-examples"] = sum(r.metrics["num-examples"] for r in accepted)
        return self.to_arrays(self.x), metrics

    def record_reply(self, info: ClientRound | None, p: ReplyParts, reply: TrainReply) -> None:
        """Note an accepted reply in its node's bookkeeping entry."""
        if info is None:
            return
        info.status = "ok"
        info.bytes_up = p.nbytes
        info.train_loss = reply.metrics["train-loss"]
        info.train_seconds = reply.metrics["train-seconds"]
        info.fisher_seconds = reply.metrics["fisher-seconds"]
        info.peak_rss_mib = reply.metrics.get("peak-rss-mib")
        info.num_examples = int(reply.metrics["num-examples"])

    def apply_train_replies(self, server_round: int, parts: list[ReplyParts]) -> list[TrainReply]:
        """Validate each reply; fold the accepted ones into ``self.x`` and the method's state.

        A rejected reply is logged with its reason and changes nothing.
        """
        accepted = self.accepted_replies(server_round, parts)
        if accepted:
            self.x = self.method.aggregate(self.x, accepted, server_round)
        return [a.reply for a in accepted]

    def accepted_replies(self, server_round: int, parts: list[ReplyParts]) -> list[Accepted]:
        """The valid replies in node order (none when fewer than ``min-replies``); rejections are logged."""
        accepted: dict[int, TrainReply] = {}
        for p in parts:
            info = self.clients.get(p.node_id)
            try:
                sent = expected_sent(p, self.sent, accepted)
                reply = self.method.validate(p.records, sent, self.x)
            except ReplyError as err:
                log(WARNING, "round %d: reply from node %d rejected: %s", server_round, p.node_id, err)
                if info is not None and info.status in ("no reply",):
                    info.status = f"rejected: {err}"
                continue
            accepted[p.node_id] = reply
            self.record_reply(info, p, reply)
        if 0 < len(accepted) < self.cfg.min_replies:
            reason = f"only {len(accepted)} valid replies, min-replies={self.cfg.min_replies}: round skipped"
            log(WARNING, "round %d: %s", server_round, reason)
            for node_id in accepted:
                self.clients[node_id].status = f"skipped: {reason}"
            return []
        # Node order, not arrival order: the float sums (and so the model) do not depend on timing.
        return [Accepted(nid, self.nodes[nid].key, r) for nid, r in sorted(accepted.items())]

    def fisher_warmup(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Round 0 of ``fisher-warmup``: every participant returns its Fisher at the initial model, untrained.

        Each node gets the submodel it would get in round 1 without a Fisher estimate (the method's
        fallback), measures its Fisher there (``fisher-estimator = "received"``) and replies with a zero
        update; the method folds the Fisher into its state and round 1 ranks by it.
        """
        msgs = self.train_messages(0, self.participants())
        parts = [
            reply_parts(m, P.UPDATE, P.METRICS, P.META) for m in exchange(grid, msgs, timeout, self.cfg.poll_interval)
        ]
        accepted = self.accepted_replies(0, parts)
        self.method.warm_up(accepted, 0)
        return {
            "replies": len(accepted),
            "sent": len(msgs),
            "bytes_down": sum(c.bytes_down for c in self.clients.values()),
            "bytes_up": sum(c.bytes_up for c in self.clients.values()),
        }

    # ---------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Each node evaluates the submodel it would train next on its local test split."""
        self.x = self._flat(arrays)
        self.sent_eval = {}
        return [
            self.submodel_message(nid, server_round, MessageType.EVALUATE, self.sent_eval, config=config)[0]
            for nid in sorted(self.nodes)
            if self.nodes[nid].num_test > 0
        ]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted local loss and accuracy over valid replies."""
        seen: dict[int, dict[str, float]] = {}
        for msg in replies:
            p = reply_parts(msg, None, P.METRICS, P.META)
            try:
                sent = expected_sent(p, self.sent_eval, seen)
                seen[p.node_id] = validate_evaluate_reply(p.metrics, p.meta, sent, self.nodes[p.node_id].num_test)
            except ReplyError as err:
                log(WARNING, "round %d: evaluation reply from node %d rejected: %s", server_round, p.node_id, err)
        if not seen:
            return None
        self.federated = federated_figures(
            [
                NodeEvaluation(
                    self.nodes[nid].capacity,
                    bool(self.sent_eval[nid].mask.all()),
                    int(m["num-examples"]),
                    m["eval-loss"],
                    m["eval-acc"],
                )
                for nid, m in seen.items()
            ]
        )
        records = [RecordDict({P.METRICS: MetricRecord(m)}) for m in seen.values()]
        metrics = aggregate_metricrecords(records, "num-examples")
        metrics["num-examples"] = sum(m["num-examples"] for m in seen.values())
        metrics["replies"] = len(seen)
        return metrics

    # ----------------------------------------------------------- central eval
    def central_evaluation(self, server_round: int, trained: bool = False) -> dict[str, Any]:
        """Full model and the submodel at every capacity level present, with ``evaluate_fn``.

        ``trained``: also evaluate the submodel each client of the round trained (``trained_per_capacity``;
        one evaluation per distinct mask, so it runs on the rounds of the clients' own evaluation only).
        """
        if self.evaluate_fn is None:
            return {}
        full = self.evaluate_fn(server_round, self.to_arrays(self.x))
        if full is None:
            return {}
        levels = {}
        for gamma in sorted({p.capacity for p in self.nodes.values()}, reverse=True):
            mask, source = self.level_mask(server_round, gamma)
            sub = self.evaluate_fn(server_round, self.to_arrays(np.where(mask, self.x, 0).astype(np.float32)))
            if sub is None:
                continue
            levels[f"{gamma:g}"] = {
                "accuracy": sub["accuracy"],
                "loss": sub["loss"],
                "density": float(mask.mean()),
                "source": source,
            }
        out = {"accuracy": full["accuracy"], "loss": full["loss"], "per_capacity": levels}
        if trained and server_round > 0:
            out["trained_per_capacity"] = self.evaluate_trained(server_round, full)
        return out

    def evaluate_trained(self, server_round: int, full: Mapping[str, float]) -> dict[str, dict[str, float]]:
        """The round's model on each trained client's own mask, into its entry; the mean per capacity level.

        Clients sent the same mask (a width slice, a held level) are evaluated once; a full mask is the full model.
        """
        assert self.evaluate_fn is not None
        seen: dict[str, tuple[float, float]] = {}
        for node_id, info in self.clients.items():
            sent = self.sent.get(node_id)
            if sent is None:
                continue
            if sent.digest not in seen:
                if sent.mask.all():
                    seen[sent.digest] = (float(full["accuracy"]), float(full["loss"]))
                else:
                    sub = self.evaluate_fn(
                        server_round, self.to_arrays(np.where(sent.mask, self.x, 0).astype(np.float32))
                    )
                    if sub is None:
                        continue
                    seen[sent.digest] = (float(sub["accuracy"]), float(sub["loss"]))
            info.submodel_accuracy, info.submodel_loss = seen[sent.digest]
        return per_capacity_means(
            [
                (c.capacity, c.submodel_accuracy, c.submodel_loss)
                for c in self.clients.values()
                if c.submodel_accuracy is not None
            ]
        )

    def prior_influence(self) -> dict[str, float] | None:
        """Certified share of a prior-ranked mask one client could flip, per capacity level (method's own)."""
        return self.method.prior_influence(self.x, [p.capacity for p in self.nodes.values()])

    # -------------------------------------------------------------------- loop
    def join_nodes(self, grid: Grid, timeout: float) -> None:
        """Wait for ``min-nodes`` SuperNodes, discover them, and stop with the reason when none can train."""
        wait_for_nodes(grid, self.cfg.min_nodes, timeout, self.cfg.poll_interval)
        self.discover(grid, timeout)
        if not self.nodes:
            raise RuntimeError("no usable node answered discovery; check the SuperNodes' --node-config")
        if not self.participants():
            raise RuntimeError(f"method {self.cfg.method!r} found no node that can take part (needs capacity 1)")

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """Discovery, then ``num_rounds`` of train / aggregate / evaluate; the Result holds every round's metrics.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid.
        initial_arrays : ArrayRecord
            The global model to start from.
        num_rounds : int
            The last round to run (a resumed run starts at ``first_round``).
        timeout : float
            Seconds to wait for each round's replies (and for nodes and discovery).
        train_config, evaluate_config : ConfigRecord, optional
            Sent to every node with its TRAIN / EVALUATE message (record ``config``).
        evaluate_fn : Callable, optional
            Central evaluation, Flower's ``(server_round, arrays) -> MetricRecord`` with ``accuracy`` and
            ``loss``: called for the full model and for the submodel (zeros outside its mask) of each
            capacity level present, after every round.

        Unlike Flower's base loop this pushes messages and pulls replies every ``poll-interval``
        seconds (instead of a fixed 3 s), logs one line per round and reports every round through
        ``on_round``.
        """
        self.evaluate_fn = evaluate_fn
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result = Result(arrays=initial_arrays)
        self.join_nodes(grid, timeout)
        self.x = self._flat(initial_arrays)
        warmup = None
        if self.first_round == 1 and self.method.warms_up(self.cfg):
            warmup = self.fisher_warmup(grid, timeout)
            log(
                INFO,
                "[round 0/%d] Fisher warm-up: %d of %d nodes replied",
                num_rounds,
                warmup["replies"],
                warmup["sent"],
            )
        start_eval = self.central_evaluation(0) if self.first_round == 1 else None
        if start_eval:
            log(INFO, "[round 0/%d] global acc %.4f", num_rounds, start_eval["accuracy"])
            if self.on_round:
                record = {
                    "round": 0,
                    "global": start_eval,
                    "clients": [],
                    "nodes_in": self.take_nodes_in(),
                    "nodes_out": self.take_nodes_out(),
                }
                self.on_round({**record, "fisher_warmup": warmup} if warmup else record)
        arrays = initial_arrays
        seconds: list[float] = []  # the rounds' round_seconds so far, for progress_line's time left
        for rnd in range(self.first_round, num_rounds + 1):
            t_round = time.perf_counter()
            if rnd > self.first_round:
                self.refresh_nodes(grid, min(timeout, 60.0))
            self.await_train_nodes(grid, timeout)
            t0 = time.perf_counter()
            msgs = list(self.configure_train(rnd, arrays, train_config, grid))
            server_seconds = time.perf_counter() - t0
            replies = exchange(grid, msgs, timeout, self.cfg.poll_interval)
            t0 = time.perf_counter()
            new_arrays, train_metrics = self.aggregate_train(rnd, replies)
            if new_arrays is not None:
                arrays = result.arrays = new_arrays
            if train_metrics is not None:
                result.train_metrics_clientapp[rnd] = train_metrics
            influence = self.prior_influence()  # before the evaluation: its sort also caches the prior
            evaluation_round = rnd == num_rounds or bool(self.cfg.eval_every and rnd % self.cfg.eval_every == 0)
            central = self.central_evaluation(rnd, trained=evaluation_round)
            server_seconds += time.perf_counter() - t0
            if central:
                result.evaluate_metrics_serverapp[rnd] = MetricRecord(
                    {"accuracy": central["accuracy"], "loss": central["loss"]}
                )
            local = None
            if self.cfg.eval_every and evaluation_round:
                eval_msgs = list(self.configure_evaluate(rnd, arrays, evaluate_config, grid))
                local_metrics = self.aggregate_evaluate(rnd, exchange(grid, eval_msgs, timeout, self.cfg.poll_interval))
                if local_metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = local_metrics
                    local = {"accuracy": local_metrics["eval-acc"], "loss": local_metrics["eval-loss"]}
            record = {
                "round": rnd,
                "global": central,
                "local": local,
                "federated": self.take_federated(),
                "replies": sum(c.status == "ok" for c in self.clients.values()),
                "sent": len(self.clients),
                "eligible": len(self.participants()),
                "clients": [asdict(c) for c in self.clients.values()],
                "nodes_in": self.take_nodes_in(),
                "nodes_out": self.take_nodes_out(),
                "server_seconds": server_seconds,
                "round_seconds": time.perf_counter() - t_round,
                "prior_influence": influence,
            }
            log(INFO, "%s", progress_line(record, num_rounds, seconds))
            seconds.append(record["round_seconds"])
            if self.on_round:
                self.on_round(record)
        return result


def progress_line(record: dict[str, Any], num_rounds: int, earlier_seconds: Iterable[float] = ()) -> str:
    """One human-readable line per round, ending with an estimate of the time left.

    Parameters
    ----------
    record : dict
        The round's record (what ``on_round`` receives).
    num_rounds : int
        The last round of the run.
    earlier_seconds : Iterable[float]
        ``round_seconds`` of the rounds this process ran before this one. The time left is the mean over
        them and this round, times the rounds still to run (``~N s left``; left out after the last round,
        and while no round time has been measured).
    """
    g = global_figures(record) or {}
    on_nodes = g.get("source") == NODES_SOURCE  # no server test set: the nodes' own test splits
    acc, loss = (float("nan") if g.get(k) is None else g[k] for k in ("accuracy", "loss"))
    levels = " ".join(f"{k}:{v['accuracy']:.3f}" for k, v in (g.get("per_capacity") or {}).items())
    local = record.get("local")
    down = sum(c["bytes_down"] for c in record["clients"]) / 1024
    up = sum(c["bytes_up"] for c in record["clients"]) / 1024
    seconds = [*earlier_seconds, record["round_seconds"]]
    mean, remaining = sum(seconds) / len(seconds), num_rounds - record["round"]
    return (
        f"[round {record['round']}/{num_rounds}] {'on nodes: ' if on_nodes else ''}"
        f"global acc {acc:.4f} loss {loss:.4f} | per capacity {levels or '-'}"
        + (f" | local acc {local['accuracy']:.4f}" if local else "")
        + f" | replies {record['replies']}/{record['sent']} | down {down:.1f} KiB up {up:.1f} KiB"
        f" | {record['round_seconds']:.1f} s"
        + (f" | ~{mean * remaining:.0f} s left" if remaining > 0 and mean > 0 else "")
    )
