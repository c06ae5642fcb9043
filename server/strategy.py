"""The ServerApp's Flower strategy: method-agnostic rounds of per-node submodels.

``start`` is Flower's template with the steps this federation needs around it: the nodes join (and are
refreshed before each round), the method may open with a Fisher warm-up, and every round is
:meth:`~SubmodelStrategy.configure_train`, the exchange, :meth:`~SubmodelStrategy.aggregate_train`, central
evaluation and, on evaluation rounds, :meth:`configure_evaluate` / :meth:`aggregate_evaluate`; each round ends
with its record (:mod:`server.strategy_core.round_records`) and its progress line.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from numpy.typing import NDArray

from common.methods.base import Accepted
from common.wire import protocol as P
from common.wire.validation import ReplyError, TrainReply
from server.grid_io import exchange
from server.replies import ReplyParts, expected_sent, reply_parts
from server.strategy_core.base import EvaluateFn, SubmodelStrategyBase
from server.strategy_core.round_records import RoundProgress, note_accepted, opening_record, round_record


class SubmodelStrategy(SubmodelStrategyBase, Strategy):
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

    first_round = 1  # > 1 when resuming from a checkpoint

    def node_mask(self, node_id: int, server_round: int) -> tuple[NDArray[np.bool_], str]:
        """The submodel mask of a discovered node for ``server_round``, and the rule that chose it."""
        prof = self.registry.nodes[node_id]
        return self.method.mask_for(prof.key, server_round, prof.capacity, self.x)

    def level_mask(self, server_round: int, gamma: float) -> tuple[NDArray[np.bool_], str]:
        """The submodel of capacity level ``gamma`` that central evaluation measures after ``server_round``."""
        return self.method.mask_for(None, server_round + 1, gamma, self.x)

    # ------------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One Message per participating node, each carrying only that node's submodel."""
        self.x = self._flat(arrays)
        return self.train_messages(server_round, self.registry.round_participants(server_round), config)

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
            note_accepted(info, p.nbytes, reply)
        if 0 < len(accepted) < self.cfg.min_replies:
            reason = f"only {len(accepted)} valid replies, min-replies={self.cfg.min_replies}: round skipped"
            log(WARNING, "round %d: %s", server_round, reason)
            for node_id in accepted:
                self.clients[node_id].status = f"skipped: {reason}"
            return []
        # The clients' stable keys, not arrival order nor node ids (which the Simulation Engine draws anew each
        # run): the float sums and FedRolex's order-dependent count weights then repeat from run to run.
        nodes = self.registry.nodes
        order = sorted(accepted, key=lambda nid: (nodes[nid].key, nid))
        return [Accepted(nid, nodes[nid].key, accepted[nid]) for nid in order]

    # ---------------------------------------------------------------- round 0
    def fisher_warmup(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Round 0 of ``fisher-warmup``: every participant returns its Fisher at the initial model, untrained.

        Each node gets the submodel it would get in round 1 without a Fisher estimate (the method's
        fallback), measures its Fisher there (``fisher-estimator = "received"``) and replies with a zero
        update; the method folds the Fisher into its state (:meth:`~common.methods.base.Method.warm_up`)
        and round 1 ranks by it.
        """
        msgs = self.train_messages(0, self.registry.participants())
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

    def opening_round(self, grid: Grid, num_rounds: int, timeout: float) -> None:
        """Round 0 of a fresh run: the method's Fisher warm-up when it asks for one, then the initial model's record."""
        warmup = None
        if self.method.runs_warmup():
            warmup = self.fisher_warmup(grid, timeout)
            log(
                INFO,
                "[round 0/%d] Fisher warm-up: %d of %d nodes replied",
                num_rounds,
                warmup["replies"],
                warmup["sent"],
            )
        central = self.central_evaluation(0)
        if not central:
            return
        log(INFO, "[round 0/%d] global acc %.4f", num_rounds, central["accuracy"])
        if self.on_round:
            registry = self.registry
            self.on_round(opening_record(central, registry.take_nodes_in(), registry.take_nodes_out(), warmup))

    # --------------------------------------------------------------- one round
    def run_round(
        self,
        grid: Grid,
        server_round: int,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord,
        evaluate_config: ConfigRecord,
        result: Result,
    ) -> dict[str, Any]:
        """Train, aggregate and evaluate ``server_round`` into ``result``; returns the round's record.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid.
        server_round, num_rounds : int
            This round, and the run's last.
        timeout : float
            Seconds to wait for the round's replies.
        train_config, evaluate_config : ConfigRecord
            Sent to every node with its TRAIN / EVALUATE message (see :meth:`start`).
        result : Result
            Gets the round's model and metrics.
        """
        t_round = time.perf_counter()
        if server_round > self.first_round:
            self.registry.refresh(grid, min(timeout, 60.0))
        self.registry.await_train_nodes(grid, timeout)
        t0 = time.perf_counter()
        msgs = list(self.configure_train(server_round, result.arrays, train_config, grid))
        server_seconds = time.perf_counter() - t0
        replies = exchange(grid, msgs, timeout, self.cfg.poll_interval)
        t0 = time.perf_counter()
        new_arrays, train_metrics = self.aggregate_train(server_round, replies)
        if new_arrays is not None:
            result.arrays = new_arrays
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        # Before central evaluation, which may reuse what they compute (FedFIbOS' prior_influence sorts the
        # clients' Fisher, and that sort also caches the prior the level masks are ranked by).
        method_entries = self.method.round_entries(self.x, self.registry.capacities())
        evaluation_round = server_round == num_rounds or bool(
            self.cfg.eval_every and server_round % self.cfg.eval_every == 0
        )
        central = self.central_evaluation(server_round, trained=evaluation_round)
        server_seconds += time.perf_counter() - t0
        if central:
            result.evaluate_metrics_serverapp[server_round] = MetricRecord(
                {"accuracy": central["accuracy"], "loss": central["loss"]}
            )
        local = None
        if self.cfg.eval_every and evaluation_round:
            eval_msgs = list(self.configure_evaluate(server_round, result.arrays, evaluate_config, grid))
            local_metrics = self.aggregate_evaluate(
                server_round, exchange(grid, eval_msgs, timeout, self.cfg.poll_interval)
            )
            if local_metrics is not None:
                result.evaluate_metrics_clientapp[server_round] = local_metrics
                local = {"accuracy": local_metrics["eval-acc"], "loss": local_metrics["eval-loss"]}
        return round_record(
            server_round,
            central=central,
            local=local,
            federated=self.take_federated(),
            clients=self.clients,
            eligible=len(self.registry.participants()),
            nodes_in=self.registry.take_nodes_in(),
            nodes_out=self.registry.take_nodes_out(),
            server_seconds=server_seconds,
            round_seconds=time.perf_counter() - t_round,
            method_entries=method_entries,
        )

    # -------------------------------------------------------------------- loop
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
        self.registry.join(grid, timeout)
        self.x = self._flat(initial_arrays)
        if self.first_round == 1:
            self.opening_round(grid, num_rounds, timeout)
        progress = RoundProgress(num_rounds)
        for server_round in range(self.first_round, num_rounds + 1):
            record = self.run_round(grid, server_round, num_rounds, timeout, train_config, evaluate_config, result)
            progress.log(record)
            if self.on_round:
                self.on_round(record)
        return result
