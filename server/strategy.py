"""FedFIbOS as a Flower strategy: per-client Fisher-ranked submodels, mask-aware aggregation.

The maths lives in ``common`` (selection, aggregation, codecs) and in
:mod:`server.fisher_state`; this module only turns it into Messages, checks the
replies (:mod:`server.validation`) and keeps the per-round bookkeeping.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterable
from dataclasses import asdict, dataclass, field
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from numpy.typing import NDArray

from common import protocol as P
from common.aggregation import aggregate_masked
from common.config import RunConfig
from common.layout import ParamLayout
from common.prior_influence import contested_positions
from common.protocol import encode_submodel
from common.selection import select_mask
from common.width_masks import channel_graph, width_mask, width_ratio
from server.fisher_state import FisherState, fisher_capacity
from server.restoration_state import RestorationMasks
from server.structured_submodels import StructuredSubmodels
from server.validation import (
    ReplyError,
    SentSubmodel,
    TrainReply,
    validate_evaluate_reply,
    validate_profile,
    validate_train_reply,
)


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
    num_examples: int | None = None
    capacity_source: str = "node-config"


@dataclass
class ReplyParts:
    """The pieces of a reply the validators look at, already taken out of the Message."""

    node_id: int
    arrays: dict[str, NDArray] | None = None
    metrics: dict[str, Any] | None = None
    meta: dict[str, Any] | None = None
    error: str | None = None
    nbytes: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


def reply_parts(msg: Message, arrays_key: str | None, metrics_key: str, meta_key: str | None) -> ReplyParts:
    """Extract records from a reply without trusting it (decode failures become ``error``)."""
    parts = ReplyParts(node_id=int(msg.metadata.src_node_id))
    if msg.has_error():
        parts.error = f"node returned an error: {msg.error.reason}"
        return parts
    try:
        content = msg.content
        if arrays_key is not None and arrays_key in content.array_records:
            record = content.array_records[arrays_key]
            parts.nbytes = record.count_bytes()
            parts.arrays = {name: arr.numpy() for name, arr in record.items()}
        if metrics_key in content.metric_records:
            parts.metrics = dict(content.metric_records[metrics_key])
        if meta_key is not None and meta_key in content.config_records:
            parts.meta = dict(content.config_records[meta_key])
        for name, rec in content.config_records.items():
            if name != meta_key:
                parts.extras.update(rec)
    except Exception as err:  # undecodable payloads are a reason to drop the reply, never to crash
        parts.error = f"undecodable reply: {type(err).__name__}: {err}"
    return parts


def expected_sent(parts: ReplyParts, sent: dict[int, SentSubmodel], answered: Container[int]) -> SentSubmodel:
    """What this reply answers; rejects error replies, replies nobody asked for, and duplicates."""
    if parts.error:
        raise ReplyError(parts.error)
    if parts.node_id not in sent:
        raise ReplyError("nothing was sent to this node in this round")
    if parts.node_id in answered:
        raise ReplyError("duplicate reply for this round")
    return sent[parts.node_id]


class FisherSubmodelStrategy(Strategy):
    """Heterogeneous-capacity federated training with Fisher-ranked submodels.

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration.
    layout : ParamLayout
        Flat layout of the global model.
    evaluate_fn : Callable, optional
        ``evaluate_fn(flat, mask_or_None) -> (loss, accuracy)`` on the server's test
        set, used for the full model and for the submodel at each capacity level.
    on_round : Callable, optional
        Called with each round's record (a JSON-ready dict) after the round ends.
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: ParamLayout,
        evaluate_fn: Callable[[NDArray[np.float32], NDArray[np.bool_] | None], tuple[float, float]] | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.evaluate_fn = evaluate_fn
        self.on_round = on_round
        self.fisher = FisherState(
            layout.size,
            cfg.fisher_staleness_decay,
            cfg.fisher_ema,
            cfg.fisher_trim,
            max_clients=fisher_capacity(cfg.fisher_memory_mb, layout.size, cfg.fisher_precision),
            precision=cfg.fisher_precision,
        )
        self.nodes: dict[int, NodeProfile] = {}
        self.excluded: set[int] = set()  # misconfigured nodes, not asked again
        self.sent: dict[int, SentSubmodel] = {}
        self.sent_eval: dict[int, SentSubmodel] = {}
        self.clients: dict[int, ClientRound] = {}
        self.x: NDArray[np.float32] = np.zeros(layout.size, dtype=np.float32)
        self.first_round = 1  # > 1 when resuming from a checkpoint
        self.graph = channel_graph(cfg.model, layout) if cfg.method in ("heterofl", "fedrolex", "cahfp") else None
        self.structured = StructuredSubmodels(layout, self.graph) if cfg.method == "cahfp" else None
        self.restoration = RestorationMasks.from_config(cfg, layout) if cfg.method == "fedgmr" else None
        # FedGMR's restoration clock (rounds since the start) for a round / dispatch number;
        # server.async_rounds replaces it with applied updates per node.
        self.restoration_clock: Callable[[int], float] = lambda server_round: max(0.0, server_round - 1.0)

    # ------------------------------------------------------------------ helpers
    def summary(self) -> None:
        """Log the strategy's configuration."""
        log(
            INFO,
            "FisherSubmodelStrategy: method=%s d=%d fisher-encoding=%s staleness-decay=%.2f min-per-row=%d",
            self.cfg.method,
            self.layout.size,
            self.cfg.upload_encoding,
            self.cfg.fisher_staleness_decay,
            self.cfg.min_per_row,
        )

    def _flat(self, arrays: ArrayRecord) -> NDArray[np.float32]:
        return self.layout.flatten({name: arr.numpy() for name, arr in arrays.items()})

    def to_arrays(self, flat: NDArray[np.float32]) -> ArrayRecord:
        """The flat vector as an ArrayRecord of named tensors."""
        return ArrayRecord({n: Array(np.ascontiguousarray(v)) for n, v in self.layout.unflatten(flat).items()})

    def mask_for(self, node_id: int | None, server_round: int, gamma: float) -> tuple[NDArray[np.bool_], str]:
        """The mask for a client (or, with ``node_id=None``, for a capacity level).

        Returns the mask and where it came from:

        * ``fedfibos``: ``client`` (the client's own, possibly staleness-blended
          Fisher), ``prior`` (global Fisher, for clients that never reported), or
          ``magnitude`` (the first round, before any Fisher exists);
        * ``fiarse``: ``magnitude`` (top-k of ``|x|``);
        * ``heterofl`` / ``fedrolex``: ``width`` (first channels / window rolled by
          the round, width ratio ``sqrt(gamma)``);
        * ``fedavg`` / ``fedavg-drop``: ``full``;
        * ``fedgmr``: the client's growing restoration mask (``random`` / ``fisher`` /
          ``magnitude`` when positions were added, ``kept`` otherwise);
        * ``cahfp``: ``curvature`` (top channels per group by curvature score), or
          ``norm`` before any score exists (:mod:`server.structured_submodels`).
        """
        method = self.cfg.method
        if self.structured is not None:
            return self.structured.mask_for(self.x, gamma)
        if method == "fedgmr":
            held = self.restoration.held_mask(gamma) if node_id is None else None
            if held is not None:  # central evaluation: a submodel a client of this capacity trains
                return held, "held"
            t = self.restoration_clock(server_round)
            key = None if node_id is None else self.nodes[node_id].key
            fisher = None
            if self.cfg.gmr_selection == "fisher":
                fisher_round = int(t) + 1
                known = key is not None and key in self.fisher.clients
                fisher = self.fisher.estimate(key, fisher_round) if known else self.fisher.global_prior()
            return self.restoration.mask(key, t, gamma, self.x, fisher)
        if method in ("fedavg", "fedavg-drop"):
            return np.ones(self.layout.size, dtype=bool), "full"
        if method in ("heterofl", "fedrolex"):
            roll = server_round if method == "fedrolex" else 0
            return width_mask(self.layout, self.graph, width_ratio(gamma), roll), "width"
        if method == "fedfibos":
            key = None if node_id is None else self.nodes[node_id].key
            if key is not None and key in self.fisher.clients:
                est, source = self.fisher.estimate(key, server_round), "client"
            else:
                est, source = self.fisher.global_prior(), "prior"
            if est is not None:
                return select_mask(self.layout, self.x, gamma, "fisher", est, self.cfg.min_per_row), source
        return select_mask(self.layout, self.x, gamma, "magnitude", None, self.cfg.min_per_row), "magnitude"

    def participants(self) -> list[int]:
        """Nodes that train: all discovered ones, or for ``fedavg-drop`` only those that hold the full model."""
        if self.cfg.method == "fedavg-drop":
            return [nid for nid in sorted(self.nodes) if self.nodes[nid].capacity >= 1.0]
        return sorted(self.nodes)

    def _submodel_message(
        self,
        node_id: int,
        server_round: int,
        message_type: str,
        store: dict[int, SentSubmodel],
    ) -> tuple[Message, ClientRound]:
        prof = self.nodes[node_id]
        mask, source = self.mask_for(node_id, server_round, prof.capacity)
        if self.structured is None:
            payload = encode_submodel(self.x, mask)
            arrays = ArrayRecord({P.VALUES: Array(payload.values), P.MASK: Array(payload.mask_data)})
            records = {P.SUBMODEL: arrays}
            kind, values_bytes, mask_bytes = payload.mask_kind, payload.values.nbytes, payload.mask_data.nbytes
        else:
            payload = self.structured.encode(self.x, mask)
            records = {P.SUBMODEL: _array_record(payload.arrays), P.CHANNELS: _array_record(payload.channels)}
            kind, values_bytes, mask_bytes = P.CHANNELS_KIND, payload.values_bytes, payload.channels_bytes
        cfg = ConfigRecord(
            {
                "mask-kind": kind,
                "mask-digest": payload.digest,
                "d": self.layout.size,
                "round": server_round,
            }
        )
        store[node_id] = SentSubmodel(node_id, server_round, mask, payload.digest, prof.num_train)
        k = int(mask.sum())
        info = ClientRound(
            node_id=node_id,
            capacity=prof.capacity,
            device=prof.device,
            mask_source=source,
            selected=k,
            density=k / self.layout.size,
            bytes_down=sum(r.count_bytes() for r in records.values()),
            values_bytes=int(values_bytes),
            mask_bytes=int(mask_bytes),
            mask_kind=kind,
            capacity_source=prof.capacity_source,
        )
        msg = Message(
            content=RecordDict({**records, P.SUBMODEL_CONFIG: cfg}),
            dst_node_id=node_id,
            message_type=message_type,
        )
        return msg, info

    # ---------------------------------------------------------------- discovery
    def refresh_nodes(self, grid: Grid, timeout: float) -> None:
        """Track the SuperLink's connected nodes: forget departed ones, QUERY new ones.

        Runs before every round, so a SuperNode that joins mid-run (or restarts
        with a new node id) takes part from the next round; its Fisher state is
        found again through its stable client key.
        """
        connected = set(grid.get_node_ids())
        for node_id in sorted(set(self.nodes) - connected):
            log(WARNING, "node %d (%s) left the federation", node_id, self.nodes.pop(node_id).key)
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
                continue
            device = str(parts.extras.get("device", "unknown"))
            key = str(parts.extras.get("client-key") or f"node-{parts.node_id}")
            if any(p.key == key for p in self.nodes.values()):
                log(WARNING, "node %d reports client key %r already in use; keyed by its node id", parts.node_id, key)
                key = f"node-{parts.node_id}"
            source = "auto" if parts.extras.get("capacity-source") == "auto" else "node-config"
            self.nodes[parts.node_id] = NodeProfile(capacity, device, n_train, n_test, key, source)
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

    # ------------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One Message per discovered node, each carrying only that node's submodel."""
        self.x = self._flat(arrays)
        self.sent, self.clients = {}, {}
        msgs = []
        for node_id in self.participants():
            msg, info = self._submodel_message(node_id, server_round, MessageType.TRAIN, self.sent)
            msgs.append(msg)
            self.clients[node_id] = info
        return msgs

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, update the Fisher state and aggregate mask-aware."""
        parts = [reply_parts(m, P.UPDATE, P.METRICS, P.META) for m in replies]
        accepted = self.apply_train_replies(server_round, parts)
        if not accepted:
            return None, None
        total = sum(r.metrics["num-examples"] for r in accepted)
        agg = {
            key: sum(r.metrics[key] * r.metrics["num-examples"] for r in accepted) / total
            for key in ("train-loss", "train-seconds", "fisher-seconds")
        }
        agg["num-examples"] = total
        return self.to_arrays(self.x), MetricRecord(agg)

    def apply_train_replies(self, server_round: int, parts: list[ReplyParts]) -> list[TrainReply]:
        """Validate each reply; fold the accepted ones into ``self.x`` and the Fisher state.

        A rejected reply is logged with its reason and changes nothing.
        """
        accepted: dict[int, TrainReply] = {}
        for p in parts:
            info = self.clients.get(p.node_id)
            try:
                sent = expected_sent(p, self.sent, accepted)
                if self.structured is not None:
                    reply = self.structured.validate_reply(
                        p.arrays, p.metrics, p.meta, sent, self.x, self.cfg.upload_encoding
                    )
                else:
                    reply = validate_train_reply(
                        p.arrays,
                        p.metrics,
                        p.meta,
                        sent,
                        self.layout,
                        self.cfg.upload_encoding,
                    )
            except ReplyError as err:
                log(
                    WARNING,
                    "round %d: reply from node %d rejected: %s",
                    server_round,
                    p.node_id,
                    err,
                )
                if info is not None and info.status in ("no reply",):
                    info.status = f"rejected: {err}"
                continue
            accepted[p.node_id] = reply
            if info is not None:
                info.status = "ok"
                info.bytes_up = p.nbytes
                info.train_loss = reply.metrics["train-loss"]
                info.train_seconds = reply.metrics["train-seconds"]
                info.fisher_seconds = reply.metrics["fisher-seconds"]
                info.num_examples = int(reply.metrics["num-examples"])
        if 0 < len(accepted) < self.cfg.min_replies:
            reason = f"only {len(accepted)} valid replies, min-replies={self.cfg.min_replies}: round skipped"
            log(WARNING, "round %d: %s", server_round, reason)
            for node_id in accepted:
                self.clients[node_id].status = f"skipped: {reason}"
            return []
        if accepted:
            # Node order, not arrival order: the float sums (and so the model) do not depend on timing.
            ordered = sorted(accepted.items())
            self.x = aggregate_masked(self.x, [r.update for _, r in ordered], self.cfg.server_lr)
            if self.structured is not None:
                self.structured.record_scores([r for _, r in ordered])
            for node_id, r in ordered:
                key = self.nodes[node_id].key
                if r.fisher is not None and not self.fisher.update(key, r.fisher, r.update.weight, server_round):
                    log(
                        INFO,
                        "round %d: node %d sent an all-zero Fisher; its estimate is unchanged",
                        server_round,
                        node_id,
                    )
        return list(accepted.values())

    # ---------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Each node evaluates the submodel it would train next on its local test split."""
        self.x = self._flat(arrays)
        self.sent_eval = {}
        return [
            self._submodel_message(nid, server_round, MessageType.EVALUATE, self.sent_eval)[0]
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
                log(
                    WARNING,
                    "round %d: evaluation reply from node %d rejected: %s",
                    server_round,
                    p.node_id,
                    err,
                )
        if not seen:
            return None
        n = sum(m["num-examples"] for m in seen.values())
        return MetricRecord(
            {
                "eval-loss": sum(m["eval-loss"] * m["num-examples"] for m in seen.values()) / n,
                "eval-acc": sum(m["eval-acc"] * m["num-examples"] for m in seen.values()) / n,
                "num-examples": n,
                "replies": len(seen),
            }
        )

    # ----------------------------------------------------------- central eval
    def central_evaluation(self, server_round: int) -> dict[str, Any]:
        """Full model and the submodel at every capacity level present."""
        if self.evaluate_fn is None:
            return {}
        loss, acc = self.evaluate_fn(self.x, None)
        levels = {}
        for gamma in sorted({p.capacity for p in self.nodes.values()}, reverse=True):
            mask, source = self.mask_for(None, server_round + 1, gamma)
            l_loss, l_acc = self.evaluate_fn(self.x, mask)
            levels[f"{gamma:g}"] = {
                "accuracy": l_acc,
                "loss": l_loss,
                "density": float(mask.mean()),
                "source": source,
            }
        return {"accuracy": acc, "loss": loss, "per_capacity": levels}

    def prior_influence(self) -> dict[str, float] | None:
        """Certified share of a prior-ranked mask that one client, whatever it uploads, could flip.

        Per capacity level present (below 1), for a client ranked by the global
        prior (a new or evicted one) against the current model. ``None`` unless
        the method ranks by Fisher and the prior is a trimmed mean with at least
        three clients (a plain mean gives no bound). See :mod:`common.prior_influence`.
        """
        if self.cfg.method != "fedfibos":
            return None
        interval = self.fisher.prior_interval()
        if interval is None:
            return None
        lo, hi = interval
        levels = sorted({p.capacity for p in self.nodes.values() if p.capacity < 1.0}, reverse=True)
        return {
            f"{gamma:g}": float(contested_positions(self.layout, self.x, gamma, lo, hi, self.cfg.min_per_row).mean())
            for gamma in levels
        }

    # -------------------------------------------------------------------- loop
    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int = 3,
        timeout: float = 3600,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None,
    ) -> Result:
        """Discovery, then ``num_rounds`` of train / aggregate / evaluate.

        Unlike the base class this pushes messages and pulls replies every
        ``poll-interval`` seconds (instead of a fixed 3 s), logs one line per
        round and reports every round through ``on_round``.
        """
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result = Result(arrays=initial_arrays)
        wait_for_nodes(grid, self.cfg.min_nodes, timeout, self.cfg.poll_interval)
        self.discover(grid, timeout)
        if not self.nodes:
            raise RuntimeError("no usable node answered discovery; check the SuperNodes' --node-config")
        if not self.participants():
            raise RuntimeError(f"method {self.cfg.method!r} found no node that can take part (needs capacity 1)")
        self.x = self._flat(initial_arrays)
        start_eval = self.central_evaluation(0) if self.first_round == 1 else None
        if start_eval:
            log(INFO, "[round 0/%d] global acc %.4f", num_rounds, start_eval["accuracy"])
            if self.on_round:
                self.on_round({"round": 0, "global": start_eval, "clients": []})
        arrays = initial_arrays
        for rnd in range(self.first_round, num_rounds + 1):
            t_round = time.perf_counter()
            if rnd > self.first_round:
                self.refresh_nodes(grid, min(timeout, 60.0))
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
            central = self.central_evaluation(rnd)
            server_seconds += time.perf_counter() - t0
            if central:
                result.evaluate_metrics_serverapp[rnd] = MetricRecord(
                    {"accuracy": central["accuracy"], "loss": central["loss"]}
                )
            local = None
            if self.cfg.eval_every and (rnd % self.cfg.eval_every == 0 or rnd == num_rounds):
                eval_msgs = list(self.configure_evaluate(rnd, arrays, evaluate_config, grid))
                local_metrics = self.aggregate_evaluate(rnd, exchange(grid, eval_msgs, timeout, self.cfg.poll_interval))
                if local_metrics is not None:
                    result.evaluate_metrics_clientapp[rnd] = local_metrics
                    local = {
                        "accuracy": local_metrics["eval-acc"],
                        "loss": local_metrics["eval-loss"],
                    }
            record = {
                "round": rnd,
                "global": central,
                "local": local,
                "replies": sum(c.status == "ok" for c in self.clients.values()),
                "sent": len(self.clients),
                "clients": [asdict(c) for c in self.clients.values()],
                "server_seconds": server_seconds,
                "round_seconds": time.perf_counter() - t_round,
                "prior_influence": influence,
            }
            log(INFO, "%s", progress_line(record, num_rounds))
            if self.on_round:
                self.on_round(record)
        return result


def _array_record(arrays: dict[str, NDArray]) -> ArrayRecord:
    return ArrayRecord({n: Array(np.ascontiguousarray(a)) for n, a in arrays.items()})


def progress_line(record: dict[str, Any], num_rounds: int) -> str:
    """One human-readable line per round."""
    g = record.get("global") or {}
    levels = " ".join(f"{k}:{v['accuracy']:.3f}" for k, v in (g.get("per_capacity") or {}).items())
    local = record.get("local")
    down = sum(c["bytes_down"] for c in record["clients"]) / 1024
    up = sum(c["bytes_up"] for c in record["clients"]) / 1024
    return (
        f"[round {record['round']}/{num_rounds}] global acc {g.get('accuracy', float('nan')):.4f} "
        f"loss {g.get('loss', float('nan')):.4f} | per capacity {levels or '-'}"
        + (f" | local acc {local['accuracy']:.4f}" if local else "")
        + f" | replies {record['replies']}/{record['sent']} | down {down:.1f} KiB up {up:.1f} KiB"
        f" | {record['round_seconds']:.1f} s"
    )


def wait_for_nodes(grid: Grid, min_nodes: int, timeout: float, poll_interval: float) -> int:
    """Wait until ``min_nodes`` SuperNodes are connected, or ``timeout`` seconds; returns how many are.

    SuperNodes started together with the SuperLink (``docker compose up``)
    connect over several seconds; discovering too early would leave the late
    ones out of the first rounds.
    """
    deadline = time.monotonic() + timeout
    reported = -1
    while True:
        connected = len(grid.get_node_ids())
        if connected >= min_nodes:
            return connected
        if time.monotonic() >= deadline:
            log(
                WARNING,
                "only %d of min-nodes=%d nodes connected after %.0f s: starting with them",
                connected,
                min_nodes,
                timeout,
            )
            return connected
        if connected != reported:
            log(INFO, "waiting for nodes: %d of %d connected", connected, min_nodes)
            reported = connected
        time.sleep(max(poll_interval, 0.5))


def exchange(grid: Grid, messages: list[Message], timeout: float, poll_interval: float) -> list[Message]:
    """Push ``messages`` and pull replies every ``poll_interval`` s until all arrive or ``timeout`` s pass."""
    if not messages:
        return []
    pending = set(grid.push_messages(messages))
    replies: list[Message] = []
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        got = list(grid.pull_messages(pending))
        replies.extend(got)
        pending.difference_update(m.metadata.reply_to_message_id for m in got)
        if pending:
            time.sleep(poll_interval)
    if pending:
        log(
            WARNING,
            "%d of %d replies did not arrive within %.0f s",
            len(pending),
            len(messages),
            timeout,
        )
    return replies
