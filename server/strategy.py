"""The ServerApp's Flower strategy: method-agnostic rounds of per-node submodels.

``start`` is Flower's template with the steps this federation needs around it: the nodes join (and
are refreshed before each round), the method may open with a Fisher warm-up, and every round is
:meth:`~SubmodelStrategy.configure_train`, the exchange, :meth:`~SubmodelStrategy.aggregate_train`,
central evaluation and, on evaluation rounds, :meth:`configure_evaluate` /
:meth:`aggregate_evaluate`; each round ends with its record
(:mod:`server.strategy_core.round_records`) and its progress line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from flwr.serverapp.strategy.strategy_utils import aggregate_metricrecords
from numpy.typing import NDArray

from common.wire import protocol as P
from server.grid_io import GridTime, ordered_replies
from server.opening import Opening
from server.replies import ReplyParts, train_parts
from server.strategy_core.base import EvaluateFn, SubmodelStrategyBase, local_figures
from server.strategy_core.reply_fold import fold_replies
from server.strategy_core.round_plan import TrainPlan
from server.strategy_core.round_records import RoundProgress, round_record
from server.strategy_core.server_clock import ServerClock


@dataclass
class TrainedRound:
    """A round trained and aggregated whose record is not made yet: what its evaluation and record
    need.

    Parameters
    ----------
    server_round : int
        The round.
    x : NDArray[float32]
        The global model after the round (not written afterwards: the next round folds into a new
        vector).
    capacities : list[float]
        The capacity levels present when it ended (central evaluation measures each).
    plan : TrainPlan
        What the round sent: every client's entry and submodel.
    eligible : int
        Nodes that could train.
    nodes_in, nodes_out : list of dict
        Nodes discovered, and nodes left out or departed, since the previous round's end.
    clock : ServerClock
        The server's own seconds of the round (wall-clock and CPU), central evaluation excluded.
    round_seconds : float
        The round's wall-clock seconds so far, central evaluation excluded.
    trained_at : float
        Unix time the round's model was aggregated.
    method_entries : dict
        The method's own entries of the record.
    evaluation_round : bool
        A round of the nodes' own evaluation (or the last): evaluated at once.
    """

    server_round: int
    x: NDArray[np.float32]
    capacities: list[float]
    plan: TrainPlan
    eligible: int
    nodes_in: list[dict[str, Any]]
    nodes_out: list[dict[str, Any]]
    clock: ServerClock
    round_seconds: float
    trained_at: float
    method_entries: dict[str, Any]
    evaluation_round: bool

    def record(
        self,
        central: dict[str, Any],
        local: dict[str, float] | None,
        federated: dict[str, Any] | None,
        central_clock: ServerClock,
        began: float,
        overlapped: bool,
    ) -> dict[str, Any]:
        """The round's record, once evaluated: ``central`` and, on an evaluation round, the nodes'
        ``local`` metrics and ``federated`` figures; ``central_clock`` timed the central evaluation,
        begun at ``perf_counter()`` time ``began``. ``overlapped``: it ran while the next round's
        nodes trained, so its seconds are neither the round's nor its server's (they are
        ``central_seconds``, with ``central_overlapped``)."""
        record = round_record(
            self.server_round,
            central=central,
            local=local,
            federated=federated,
            clients=self.plan.clients,
            eligible=self.eligible,
            nodes_in=self.nodes_in,
            nodes_out=self.nodes_out,
            server_seconds=self.clock.seconds + (0.0 if overlapped else central_clock.seconds),
            round_seconds=self.round_seconds + (0.0 if overlapped else time.perf_counter() - began),
            trained_at=self.trained_at,
            method_entries=self.method_entries,
        )
        # CPU seconds beside the wall-clock ones: what the server's work would take on a machine of
        # its own, as the nodes' ``cpu_seconds`` are (on one machine, every process's wall-clock
        # seconds share the cores).
        record["server_cpu_seconds"] = self.clock.cpu_seconds + (
            0.0 if overlapped else central_clock.cpu_seconds
        )
        record["central_seconds"] = central_clock.seconds
        record["central_cpu_seconds"] = central_clock.cpu_seconds
        record["central_overlapped"] = overlapped
        return record


def train_metrics(metrics: list[dict[str, float]]) -> MetricRecord:
    """The accepted replies' training metrics, example-weighted, with their total
    ``num-examples``."""
    records = [RecordDict({P.METRICS: MetricRecord(m)}) for m in metrics]
    aggregated = aggregate_metricrecords(records, "num-examples")
    aggregated["num-examples"] = sum(m["num-examples"] for m in metrics)
    return aggregated


class RoundReporter:
    """Each trained round's evaluation and record, made at once or once the next round is out.

    A round whose central evaluation can overlap the next round's training waits (:meth:`defer`):
    evaluating every capacity level then does not delay the next round. :meth:`flush`, called once
    the next round's messages are pushed, evaluates it. Each record goes to the progress line and
    to ``on_round``.

    Parameters
    ----------
    complete : Callable
        ``complete(done, overlapped)``: the round evaluated, its record
        (:meth:`SubmodelStrategy.complete_round`).
    progress : RoundProgress
        Logs each record's progress line.
    on_round : Callable, optional
        Called with each record.
    """

    def __init__(
        self,
        complete: Callable[[TrainedRound, bool], dict[str, Any]],
        progress: RoundProgress,
        on_round: Callable[[dict[str, Any]], None] | None,
    ) -> None:
        self.complete, self.progress, self.on_round = complete, progress, on_round
        self.waiting: list[TrainedRound] = []

    def report(self, done: TrainedRound, overlapped: bool) -> None:
        """Evaluate ``done`` and report its record (``overlapped``: beside the next round)."""
        record = self.complete(done, overlapped)
        self.progress.log(record)
        if self.on_round:
            self.on_round(record)

    def defer(self, done: TrainedRound) -> None:
        """Evaluate ``done`` at the next :meth:`flush`."""
        self.waiting.append(done)

    def flush(self) -> None:
        """Evaluate and report the round waiting, if any (beside the next round's training)."""
        while self.waiting:
            self.report(self.waiting.pop(), overlapped=True)


class SubmodelStrategy(SubmodelStrategyBase, Strategy):
    """Heterogeneous-capacity federated training: each node trains the submodel its method gives it.

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration.
    layout : ParamLayout
        Flat layout of the global model.
    method : ServerMethod, optional
        The method (default: the one ``cfg.method`` names, from the registry).
    on_round : Callable, optional
        Called with each round's record (a JSON-ready dict) after the round ends.
    """

    first_round = 1  # > 1 when resuming from a checkpoint

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.opening = Opening(self)

    # ------------------------------------------------------------------- train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> TrainPlan:
        """One Message per participating node, each carrying only that node's submodel, and what
        each was sent."""
        participants = self.registry.round_participants(server_round)
        return self.plan_train(server_round, self._flat(arrays), participants, config)

    def plan_train(
        self,
        server_round: int,
        x: NDArray[np.float32],
        node_ids: Iterable[int],
        config: ConfigRecord | None = None,
    ) -> TrainPlan:
        """TRAIN messages of the model ``x`` for ``node_ids``, in the clients' key order (the order
        their replies are folded in), with what each node was sent."""
        plan = TrainPlan(server_round, x)
        for node_id in self.registry.in_key_order(node_ids):
            msg, plan.clients[node_id] = self.submodel_message(
                node_id, server_round, MessageType.TRAIN, plan.sent, config=config, x=x
            )
            plan.messages.append(msg)
        return plan

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message], plan: TrainPlan
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply against ``plan`` and fold it into the round as it comes (in the
        clients' key order).

        ``replies`` may be a generator (:func:`server.grid_io.ordered_replies`): each reply is taken
        apart, validated, folded and dropped before the next is asked for.
        """
        return self.train_result(self.fold_train_replies(plan, train_parts(replies)))

    def train_result(
        self, metrics: list[dict[str, float]]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's model and its example-weighted training metrics, from the accepted replies'
        ``metrics``."""
        return (self.to_arrays(self.x), train_metrics(metrics)) if metrics else (None, None)

    def apply_train_replies(
        self, plan: TrainPlan, parts: list[ReplyParts]
    ) -> list[dict[str, float]]:
        """:meth:`fold_train_replies` of replies received in any order: they are folded in the
        clients' key order."""
        rank = {
            nid: i for i, nid in enumerate(self.registry.in_key_order({p.node_id for p in parts}))
        }
        return self.fold_train_replies(plan, sorted(parts, key=lambda p: rank[p.node_id]))

    def fold_train_replies(
        self, plan: TrainPlan, parts: Iterable[ReplyParts], warm_up: bool = False
    ) -> list[dict[str, float]]:
        """Validate each reply and fold the accepted ones into the model and the method's state, in
        the given order.

        Each reply is validated against what ``plan`` sent and the model the round started from,
        folded (:meth:`~common.methods.contract.server_side.ServerMethod.round_fold`) and dropped; a
        rejected one is logged with its reason and changes nothing. With fewer than ``min-replies``
        valid replies the round is skipped: the model and the method's state stay as they were.
        Otherwise the folded model becomes the strategy's model (``self.x``).

        Parameters
        ----------
        plan : TrainPlan
            What the round (0: the Fisher warm-up) sent; each client's entry notes its reply.
        parts : Iterable[ReplyParts]
            The replies, taken apart, in the order to fold them (the clients' key order).
        warm_up : bool
            Round 0's Fisher-only replies:
            :meth:`~common.methods.contract.server_side.ServerMethod.warm_up` takes them; the model
            stays.

        Returns
        -------
        The accepted replies' metrics, in fold order (empty when none was accepted or the round was
        skipped).
        """
        fold = self.open_fold(plan, warm_up)
        accepted = fold_replies(
            self.method, self.registry.nodes, plan, parts, fold, self.cfg.min_replies
        )
        if accepted:
            self.x = fold.finish()
        return accepted

    # --------------------------------------------------------------- one round
    def run_round(
        self,
        grid: Grid,
        server_round: int,
        num_rounds: int,
        timeout: float,
        train_config: ConfigRecord,
        result: Result,
        on_pushed: Callable[[], None] | None = None,
    ) -> TrainedRound:
        """Train and aggregate ``server_round`` into ``result``; :meth:`complete_round` evaluates
        it.

        ``train_config`` goes to every node with its TRAIN message; ``on_pushed`` is called once the
        round's messages are out, while the nodes train (the previous round's central evaluation,
        :meth:`start`).
        """
        t_round, clock, waited = time.perf_counter(), ServerClock(), GridTime()
        held = self.opening.take_round_one()
        if held is not None:
            # Round 1 went out with discovery: its replies are here, and the round began when those
            # were pushed.
            assert self.opening.pushed_at is not None
            t_round = self.opening.pushed_at[1]
            clock.start()
            plan, metrics = self.opening.round_one(grid, held, timeout, train_config, waited)
            new_arrays, train_metrics = self.train_result(metrics)
        else:
            plan, (new_arrays, train_metrics) = self.exchange_round(
                grid, server_round, timeout, train_config, result.arrays, on_pushed, clock, waited
            )
        if new_arrays is not None:
            result.arrays = new_arrays
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        # Before central evaluation, which may reuse what they compute (FedFIbOS' prior_influence
        # sorts the clients' Fisher, and that sort also caches the prior the level masks are ranked
        # by).
        capacities = self.registry.capacities()
        method_entries = self.method.round_entries(self.x, capacities)
        clock.stop()
        clock.exclude(waited)
        return TrainedRound(
            server_round=server_round,
            x=self.x,
            capacities=capacities,
            plan=plan,
            eligible=len(self.registry.participants()),
            nodes_in=self.registry.take_nodes_in(),
            nodes_out=self.registry.take_nodes_out(),
            clock=clock,
            round_seconds=time.perf_counter() - t_round,
            trained_at=time.time(),
            method_entries=method_entries,
            evaluation_round=server_round == num_rounds
            or bool(self.cfg.eval_every and server_round % self.cfg.eval_every == 0),
        )

    def exchange_round(
        self,
        grid: Grid,
        server_round: int,
        timeout: float,
        train_config: ConfigRecord,
        arrays: ArrayRecord,
        on_pushed: Callable[[], None] | None,
        clock: ServerClock,
        waited: GridTime,
    ) -> tuple[TrainPlan, tuple[ArrayRecord | None, MetricRecord | None]]:
        """Send round ``server_round`` of the model ``arrays`` and fold its replies as they come:
        the plan, and :meth:`aggregate_train`'s result. ``clock`` runs over the server's work (left
        running after the fold); ``waited`` gets the seconds spent waiting for replies and in
        ``on_pushed``."""
        if server_round > self.first_round:
            self.registry.refresh(grid, min(timeout, 60.0))
        self.registry.await_train_nodes(grid, timeout)
        clock.start()
        plan = self.configure_train(server_round, arrays, train_config, grid)
        clock.stop()
        # Replies are folded as they come, in the clients' key order; the seconds spent waiting for
        # them, and in ``on_pushed`` (the previous round's evaluation, beside the nodes' training,
        # recorded as that round's ``central_seconds``), are not this round's server work. The plan
        # lets its messages go with the stream, which lets the submodels go once pushed.
        messages = plan.take_messages()
        replies = ordered_replies(
            grid, messages, timeout, self.cfg.poll_interval, spent=waited, on_pushed=on_pushed
        )
        del messages
        clock.start()
        return plan, self.aggregate_train(server_round, replies, plan)

    def complete_round(
        self,
        done: TrainedRound,
        grid: Grid,
        timeout: float,
        evaluate_config: ConfigRecord,
        result: Result,
        overlapped: bool = False,
    ) -> dict[str, Any]:
        """Evaluate a trained round centrally (and on the nodes, on an evaluation round); returns
        its record.

        ``overlapped``: this runs while the next round's nodes train, so its seconds are neither the
        round's nor its server's (they are the record's ``central_seconds``, with
        ``central_overlapped``).
        """
        began, central_clock = time.perf_counter(), ServerClock()
        central_clock.start()
        trained = done.plan if done.evaluation_round else None
        central = self.central_evaluation(done.server_round, trained, done.x, done.capacities)
        central_clock.stop()
        if central:
            result.evaluate_metrics_serverapp[done.server_round] = MetricRecord(
                {"accuracy": central["accuracy"], "loss": central["loss"]}
            )
        local, federated = None, None
        if self.cfg.eval_every and done.evaluation_round:
            metrics, federated = self.nodes_evaluate(
                done.server_round, result.arrays, grid, timeout, evaluate_config
            )
            if metrics is not None:
                result.evaluate_metrics_clientapp[done.server_round] = metrics
                local = local_figures(metrics)
        return done.record(central, local, federated, central_clock, began, overlapped)

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
        """Discovery, then ``num_rounds`` of train / aggregate / evaluate; the Result holds every
        round's metrics.

        Parameters as Flower's ``Strategy.start``: ``num_rounds`` is the last round to run (a
        resumed run starts at ``first_round``); ``timeout`` the seconds to wait for each round's
        replies (and for nodes and discovery); ``evaluate_fn`` is called for the full model and for
        the submodel (zeros outside its mask) of each capacity level present, after every round.

        Unlike Flower's base loop this pushes messages and pulls replies every ``poll-interval``
        seconds (instead of a fixed 3 s), logs one line per round and reports every round through
        ``on_round``. A round's central evaluation runs once the next round's messages are out,
        while its nodes train (the last round, and rounds of the nodes' own evaluation, are
        evaluated at once): its record, and so its checkpoint, are made then.
        """
        self.evaluate_fn = evaluate_fn
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result = Result(arrays=initial_arrays)
        self.x = self._flat(initial_arrays)
        fold_warmup = self.first_round == 1 and self.method.opening().startswith("discovery")
        # a node's first reply starts its ClientApp: that wait is not a round's
        self.registry.join(
            grid,
            max(timeout, self.cfg.discovery_timeout) if fold_warmup else self.cfg.discovery_timeout,
            self.opening.discovery if fold_warmup else None,
        )
        if self.first_round == 1:
            self.opening.round_zero(grid, num_rounds, timeout)
        reporter = RoundReporter(
            lambda done, overlapped: self.complete_round(
                done, grid, timeout, evaluate_config, result, overlapped
            ),
            RoundProgress(num_rounds),
            self.on_round,
        )
        for server_round in range(self.first_round, num_rounds + 1):
            done = self.run_round(
                grid, server_round, num_rounds, timeout, train_config, result, reporter.flush
            )
            reporter.flush()  # a round that sent nothing (its replies came with discovery, or none)
            if done.evaluation_round:
                reporter.report(done, overlapped=False)
            else:
                reporter.defer(done)
        reporter.flush()
        return result
