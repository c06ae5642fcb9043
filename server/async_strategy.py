"""The asynchronous strategy (FedGMR's ``gmr-mode = "async"``): no global rounds, every node kept
busy, each reply applied on arrival.

The loop pushes a TRAIN message to every idle node (``Grid.push_messages``), polls
``Grid.pull_messages`` every ``poll-interval`` seconds, validates each reply (the method's checks,
as in the synchronous rounds), folds it into the global model with the method's
:meth:`~common.methods.contract.server_side.AsynchronousMethod.apply_async` (FedGMR: staleness- and
overlap-weighted, or dropped beyond ``gmr-max-staleness``) and at once sends that node the current
model under its current mask.

* Restoration clock: ``t = applied updates / number of nodes`` (a fractional
  round equivalent), so submodels grow at the same pace as in sync mode per
  update applied.
* Every dispatch carries a unique number in the message's ``round`` field: a
  reply is matched to exactly the model and mask it was sent.
* A node holds at most one message. One silent for more than ``round-timeout``
  seconds is reported (logged) but not sent more work, which would only queue
  stale messages behind the one it is working on; the other nodes keep training.
  A node that stops heartbeating gets an error reply from the SuperLink (then a
  fresh message after the next node refresh, if still connected); departed nodes
  and their messages are forgotten and new nodes discovered every few seconds, so
  a vanished node never stalls the loop.
* The run stops after ``num-rounds x nodes`` applied updates. Central evaluation
  runs every ``gmr-eval-updates`` applied updates (0 = once per number of nodes);
  each evaluation writes one metrics.json record (``round`` = evaluation number)
  with ``updates`` (applied so far) and ``wall_seconds`` (since training started),
  plus the per-update details (staleness, overlap, weight) since the last record.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from logging import INFO, WARNING
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord
from flwr.common.logger import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result
from numpy.typing import NDArray

from common.aggregation.asynchronous import TooStale
from common.config.run import RunConfig
from common.methods.contract.server_side import AsynchronousMethod, ServerMethod
from common.methods.round_fold import Accepted
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.validation import ReplyError, SentSubmodel
from server.replies import ReplyParts, reply_parts
from server.strategy_core.base import EvaluateFn, SubmodelStrategyBase, local_figures
from server.strategy_core.round_records import (
    ClientRound,
    async_record,
    note_accepted,
    progress_line,
    update_line,
)

# Seconds between checks of the SuperLink's node list (departed / new nodes).
REFRESH_SECONDS = 5.0


@dataclass
class Dispatch:
    """One TRAIN message in flight.

    Parameters
    ----------
    node_id : int
        Destination node.
    sent : SentSubmodel
        What was sent (``sent.round`` is the unique dispatch number).
    version : int
        Global model version (updates applied) the message carried.
    sent_at : float
        ``time.monotonic()`` when it was pushed (seconds).
    info : ClientRound
        Bookkeeping written to metrics.json once the reply is handled.
    warned : bool
        Whether the node was already reported as late for this message.
    """

    node_id: int
    sent: SentSubmodel
    version: int
    sent_at: float
    info: ClientRound
    warned: bool = False


@dataclass(frozen=True)
class AsyncPlan:
    """How long an asynchronous run lasts, fixed when training starts.

    Parameters
    ----------
    total_updates : int
        Applied updates after which the run stops (``num-rounds`` times the nodes found at
        discovery).
    eval_every : int
        Applied updates between central evaluations.
    total_evals : int
        Evaluations the run makes after the initial one (for the progress line).
    """

    total_updates: int
    eval_every: int
    total_evals: int


class AsyncSubmodelStrategy(SubmodelStrategyBase):
    """Asynchronous rounds for a method that can apply one reply at a time (see the module
    docstring).

    A sibling of :class:`~server.strategy.SubmodelStrategy` (the same nodes, messages, records and
    evaluations), not a Flower ``Strategy``: Flower's ``configure_train`` / ``aggregate_train`` are
    steps of a round, and this loop has none.

    Parameters
    ----------
    cfg : RunConfig
        Validated run configuration.
    layout : ParamLayout
        Flat layout of the global model.
    method : AsynchronousMethod, optional
        The method (default: the one ``cfg.method`` names); it must implement
        :class:`~common.methods.contract.server_side.AsynchronousMethod`.
    on_round : Callable, optional
        Called with each evaluation record (a JSON-ready dict).
    """

    def __init__(
        self,
        cfg: RunConfig,
        layout: ParamLayout,
        method: ServerMethod | None = None,
        on_round: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        super().__init__(cfg, layout, method, on_round)
        if not isinstance(self.method, AsynchronousMethod):
            raise TypeError(f"method {self.method.name!r} cannot apply replies asynchronously")
        self.async_method: AsynchronousMethod = self.method
        self.sent: dict[
            int, SentSubmodel
        ] = {}  # each node's last dispatch, what its update must match
        self.federated: dict[str, Any] | None = (
            None  # the nodes' evaluation figures, for the next record
        )
        self.version = 0
        self.last_changed = np.zeros(layout.size, dtype=np.int64)
        self.in_flight: dict[str, Dispatch] = {}
        self.next_dispatch = 1
        self.window: list[dict[str, Any]] = []  # handled replies since the last record
        self.server_seconds = 0.0
        self.t_start = 0.0
        self.evals = 0
        self.last_record_at = 0.0
        self.nodes_at_start = 1
        self.grid: Grid | None = None
        self.records: list[dict[str, Any]] = []  # every evaluation record of the run
        self.train_config = ConfigRecord()
        self.evaluate_config = ConfigRecord()

    def clock(self) -> float:
        """Round equivalents since the start: applied updates per node found at discovery."""
        return self.version / max(1, self.nodes_at_start)

    def node_mask(
        self, node_id: int, server_round: int, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]:
        """The node's mask at the current :meth:`clock` (``server_round`` is only a dispatch number
        here)."""
        prof = self.registry.nodes[node_id]
        return self.async_method.mask_at(
            prof.key, self.clock(), prof.capacity, self.x if x is None else x
        )

    def level_mask(
        self, server_round: int, gamma: float, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]:
        """A capacity level's mask at the current :meth:`clock`."""
        return self.async_method.mask_at(None, self.clock(), gamma, self.x if x is None else x)

    # --------------------------------------------------------------- dispatch
    def busy(self) -> set[int]:
        """Nodes with a message in flight."""
        return {d.node_id for d in self.in_flight.values()}

    def dispatch(self, node_ids: list[int]) -> None:
        """Push the current model, under each node's current mask, to ``node_ids``."""
        t0 = time.perf_counter()
        msgs, pending = [], []
        for node_id in node_ids:
            seq = self.next_dispatch
            self.next_dispatch += 1
            msg, info = self.submodel_message(
                node_id,
                seq,
                MessageType.TRAIN,
                self.sent,
                self.node_mask(node_id, seq),
                self.train_config,
            )
            msgs.append(msg)
            pending.append((node_id, self.sent[node_id], info))
        self.server_seconds += time.perf_counter() - t0
        if not msgs:
            return
        try:
            ids = list(self.grid.push_messages(msgs))
        except (
            Exception
        ) as err:  # a node that vanished between refresh and push must not end the run
            log(
                WARNING,
                "push to nodes %s failed (%s); retried after the next node refresh",
                node_ids,
                err,
            )
            return
        now = time.monotonic()
        for msg_id, (node_id, sent, info) in zip(ids, pending):
            self.in_flight[msg_id] = Dispatch(node_id, sent, self.version, now, info)

    def idle_participants(self) -> list[int]:
        """Connected, usable nodes without a message in flight."""
        busy = self.busy()
        return [nid for nid in self.registry.participants() if nid not in busy]

    def warn_late(self, timeout: float) -> None:
        """Log (once per message) nodes silent for more than ``timeout`` s.

        A late node is not sent a second message: a SuperNode works through its
        queue one message at a time, so re-sending would only pile stale work on a
        slow node. It is freed when it answers, when the SuperLink answers for it
        (a node that stops heartbeating gets an error reply), or when it leaves.
        """
        now = time.monotonic()
        for d in self.in_flight.values():
            if not d.warned and now - d.sent_at > timeout:
                d.warned = True
                log(
                    WARNING,
                    "node %d has not answered dispatch %d for %.0f s (round-timeout); the others "
                    "keep training",
                    d.node_id,
                    d.sent.round,
                    now - d.sent_at,
                )

    def drop_departed(self) -> None:
        """Forget messages to nodes that left the federation (after
        :meth:`NodeRegistry.refresh`)."""
        for mid in [
            mid for mid, d in self.in_flight.items() if d.node_id not in self.registry.nodes
        ]:
            d = self.in_flight.pop(mid)
            d.info.status = "no reply: node left"
            self.window.append(
                {**asdict(d.info), "dispatch": d.sent.round, "sent_version": d.version}
            )

    def refresh(self, timeout: float) -> None:
        """Follow the SuperLink's node list, forget departed nodes' messages, and send work to every
        idle node."""
        self.registry.refresh(self.grid, min(timeout, 60.0))
        self.drop_departed()
        self.dispatch(self.idle_participants())
        if not self.in_flight:
            raise RuntimeError("no node is left to train: every node departed or failed")

    # ----------------------------------------------------------------- replies
    def handle(self, msg: Message, d: Dispatch) -> bool:
        """Validate and apply one reply Message; returns whether it changed the global model."""
        return self.apply_reply(reply_parts(msg, P.UPDATE, P.METRICS, P.META), d)

    def apply_reply(self, parts: ReplyParts, d: Dispatch) -> bool:
        """Validate and apply one reply's records; a rejected reply is logged and changes
        nothing."""
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"dispatch": d.sent.round, "sent_version": d.version}
        try:
            if parts.error:
                raise ReplyError(parts.error)
            if parts.node_id != d.node_id:
                raise ReplyError(
                    f"reply comes from node {parts.node_id}, the message went to node {d.node_id}"
                )
            reply = self.method.validate(parts.records, d.sent, self.x)
            step = self.async_method.apply_async(
                self.x, self.last_changed, self.version, reply.update, d.version
            )
        except (ReplyError, TooStale) as err:
            log(
                WARNING,
                "update from node %d (dispatch %d) rejected: %s",
                d.node_id,
                d.sent.round,
                err,
            )
            d.info.status = f"rejected: {err}"
            self.window.append({**asdict(d.info), **entry})
            self.server_seconds += time.perf_counter() - t0
            return False
        self.x, self.last_changed, self.version = step.x, step.last_changed, step.version
        nodes = self.registry.nodes
        if d.node_id in nodes:
            self.async_method.observe(
                Accepted(d.node_id, nodes[d.node_id].key, reply), int(self.clock()) + 1
            )
        note_accepted(d.info, parts.nbytes, reply)
        entry.update(
            staleness=step.staleness, overlap=step.overlap, weight=step.weight, version=step.version
        )
        self.window.append({**asdict(d.info), **entry})
        self.server_seconds += time.perf_counter() - t0
        return True

    def on_reply(self, msg: Message, d: Dispatch, plan: AsyncPlan, timeout: float) -> None:
        """Apply one reply; log it, record an evaluation when one is due, and give its node new
        work."""
        if self.handle(msg, d):
            log(
                INFO,
                "%s",
                update_line(self.window[-1], self.version, plan.total_updates, self.elapsed()),
            )
            if self.version >= plan.total_updates:
                t_end = (
                    time.perf_counter()
                )  # before the local evaluation, which is not training time
                local = self.local_evaluation(timeout) if self.cfg.eval_every else None
                self.record(plan.total_evals, local, t_end)
            elif self.version % plan.eval_every == 0:
                self.record(plan.total_evals)
        if self.version >= plan.total_updates:
            return
        # An error reply (node crashed, or unreachable) waits for the next node refresh instead of
        # being re-sent at once: re-sending to a dead node would spin on error replies.
        if d.node_id in self.registry.nodes and not msg.has_error():
            self.dispatch([d.node_id])

    def record(
        self, total_evals: int, local: dict[str, float] | None = None, now: float | None = None
    ) -> dict[str, Any]:
        """Evaluate centrally and emit one metrics.json record.

        Parameters
        ----------
        total_evals : int
            Evaluations the run will make (for the progress line).
        local : dict, optional
            Local (client-side) accuracy and loss, measured at the end of the run.
        now : float, optional
            ``time.perf_counter()`` the record is stamped with (default: after the central
            evaluation).
        """
        t0 = time.perf_counter()
        central = self.central_evaluation(self.version)
        self.server_seconds += time.perf_counter() - t0
        now = time.perf_counter() if now is None else now
        federated, self.federated = self.federated, None  # each evaluation in one record only
        record = async_record(
            self.evals,
            updates=self.version,
            wall_seconds=now - self.t_start if self.evals else 0.0,
            central=central,
            local=local,
            federated=federated,
            window=self.window,
            nodes_in=self.registry.take_nodes_in(),
            nodes_out=self.registry.take_nodes_out(),
            server_seconds=self.server_seconds,
            round_seconds=now - self.last_record_at if self.evals else 0.0,
        )
        log(INFO, "%s", progress_line(record, total_evals) + f" | {record['updates']} updates")
        self.records.append(record)
        if self.on_round:
            self.on_round(record)
        self.window, self.server_seconds, self.last_record_at = [], 0.0, now
        self.evals += 1
        return record

    # -------------------------------------------------------------------- loop
    def plan(self, num_rounds: int) -> AsyncPlan:
        """The run's length for the participants found at discovery (logged)."""
        self.nodes_at_start = len(self.registry.participants())
        total_updates = num_rounds * self.nodes_at_start
        eval_every = self.async_method.eval_updates() or self.nodes_at_start
        log(
            INFO,
            "asynchronous %s: %d nodes, %d updates, evaluation every %d",
            self.method.name,
            self.nodes_at_start,
            total_updates,
            eval_every,
        )
        return AsyncPlan(total_updates, eval_every, math.ceil(total_updates / eval_every))

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
        """Discovery, then apply ``num_rounds x nodes`` replies; the Result holds every evaluation.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid.
        initial_arrays : ArrayRecord
            The global model to start from.
        num_rounds : int
            Round equivalents: the run applies ``num_rounds`` times the number of nodes
            found at discovery replies, then stops.
        timeout : float
            ``round-timeout``: seconds after which a silent node is reported, and the
            time allowed for the final local evaluation (discovery waits ``discovery-timeout``).
        train_config, evaluate_config : ConfigRecord, optional
            Sent to every node with its TRAIN / EVALUATE messages (record ``config``).
        evaluate_fn : Callable, optional
            Central evaluation (see :meth:`SubmodelStrategy.start`).
        """
        self.grid = grid
        self.evaluate_fn = evaluate_fn
        self.train_config = train_config or ConfigRecord()
        self.evaluate_config = evaluate_config or ConfigRecord()
        x0 = self._flat(initial_arrays)
        self.summary()
        self.registry.join(self.grid, self.cfg.discovery_timeout)
        self.x = x0.copy()
        plan = self.plan(num_rounds)
        self.record(plan.total_evals)
        self.t_start = self.last_record_at = time.perf_counter()
        self.dispatch(self.idle_participants())
        next_refresh = time.monotonic() + REFRESH_SECONDS
        while self.version < plan.total_updates:
            if time.monotonic() >= next_refresh or not self.in_flight:
                self.refresh(timeout)
                next_refresh = time.monotonic() + REFRESH_SECONDS
            replies = list(self.grid.pull_messages(list(self.in_flight)))
            for msg in replies:
                d = self.in_flight.pop(msg.metadata.reply_to_message_id, None)
                if d is not None:
                    self.on_reply(msg, d, plan, timeout)
                if self.version >= plan.total_updates:
                    break
            self.warn_late(timeout)
            if not replies:
                time.sleep(self.cfg.poll_interval)
        return self.result()

    def result(self) -> Result:
        """Flower's Result of the run: the final model and every evaluation record's figures."""
        result = Result(arrays=self.to_arrays(self.x))
        for rec in self.records:
            if rec["global"]:
                result.evaluate_metrics_serverapp[rec["round"]] = MetricRecord(
                    {"accuracy": rec["global"]["accuracy"], "loss": rec["global"]["loss"]}
                )
            if rec["local"]:
                result.evaluate_metrics_clientapp[rec["round"]] = MetricRecord(rec["local"])
        return result

    def elapsed(self) -> float:
        """Wall-clock seconds since training started."""
        return time.perf_counter() - self.t_start

    def local_evaluation(self, timeout: float) -> dict[str, float] | None:
        """Each node evaluates its current submodel on its local test split (after training
        ends)."""
        arrays = self.to_arrays(self.x)
        metrics, self.federated = self.nodes_evaluate(
            self.evals, arrays, self.grid, timeout, self.evaluate_config
        )
        if metrics is None:
            return None
        local = local_figures(metrics)
        log(INFO, "asynchronous %s: local accuracy %.4f", self.method.name, local["accuracy"])
        return local
