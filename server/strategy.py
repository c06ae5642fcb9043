"""The ServerApp's Flower strategy: method-agnostic rounds of per-node submodels.

``start`` is Flower's template with the steps this federation needs around it: the nodes join (and are
refreshed before each round), the method may open with a Fisher warm-up, and every round is
:meth:`~SubmodelStrategy.configure_train`, the exchange, :meth:`~SubmodelStrategy.aggregate_train`, central
evaluation and, on evaluation rounds, :meth:`configure_evaluate` / :meth:`aggregate_evaluate`; each round ends
with its record (:mod:`server.strategy_core.round_records`) and its progress line.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
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
from common.methods.round_fold import RoundFold, WarmUpFold
from common.wire import protocol as P
from common.wire.validation import ReplyError
from server.grid_io import GridTime, exchange, ordered_replies
from server.replies import ReplyParts, expected_sent, reply_parts
from server.strategy_core.base import EvaluateFn, SubmodelStrategyBase, array_record
from server.strategy_core.round_records import (
    ClientRound,
    RoundProgress,
    note_accepted,
    opening_record,
    round_record,
)


@dataclass
class TrainedRound:
    """A round trained and aggregated whose record is not made yet: what its evaluation and record need.

    Parameters
    ----------
    server_round : int
        The round.
    x : NDArray[float32]
        The global model after the round (not written afterwards: the next round folds into a new vector).
    capacities : list[float]
        The capacity levels present when it ended (central evaluation measures each).
    clients : dict
        The entry of every client sent a TRAIN message.
    eligible : int
        Nodes that could train.
    nodes_in, nodes_out : list of dict
        Nodes discovered, and nodes left out or departed, since the previous round's end.
    server_seconds, server_cpu_seconds, round_seconds : float
        The server's own seconds of the round (wall-clock, and its process's CPU seconds) and the round's
        wall-clock seconds so far, central evaluation excluded.
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
    clients: dict[int, ClientRound]
    eligible: int
    nodes_in: list[dict[str, Any]]
    nodes_out: list[dict[str, Any]]
    server_seconds: float
    server_cpu_seconds: float
    round_seconds: float
    trained_at: float
    method_entries: dict[str, Any]
    evaluation_round: bool


#: Bytes of round-1 updates the opening exchange may hold until the warm-up is folded (``nodes x d x 4``): above
#: it, round 1 is an exchange of its own, whose replies are folded as they come.
ROUND_ONE_HOLD_BYTES = 1 << 30


def train_parts(replies: Iterable[Message]) -> Iterator[ReplyParts]:
    """Each TRAIN reply taken apart (:func:`server.replies.reply_parts`); the Message is let go before the next."""
    for msg in replies:
        parts = reply_parts(msg, P.UPDATE, P.METRICS, P.META)
        del msg  # its serialised arrays go before the next reply is pulled
        yield parts


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
    opened: dict[str, Any] | None = None  # the warm-up :meth:`opening_discovery` folded, for round 0's record
    round_one: dict[int, ReplyParts | str] | None = None  # round-1 replies the opening held, for :meth:`run_round`
    round_one_pushed: tuple[float, float] | None = None  # Unix and perf_counter time the opening went out with round 1
    initial_central: dict[str, Any] | None = None  # the initial model's central evaluation, made during the opening

    def node_mask(self, node_id: int, server_round: int) -> tuple[NDArray[np.bool_], str]:
        """The submodel mask of a discovered node for ``server_round``, and the rule that chose it."""
        prof = self.registry.nodes[node_id]
        return self.method.mask_for(prof.key, server_round, prof.capacity, self.x)

    def level_mask(
        self, server_round: int, gamma: float, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]:
        """The submodel of capacity level ``gamma`` that central evaluation measures after ``server_round``."""
        return self.method.mask_for(None, server_round + 1, gamma, self.x if x is None else x)

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
        """TRAIN messages for ``node_ids``, in the clients' key order (the order their replies are folded in).

        What each was sent becomes this round's ``sent`` and ``clients``.
        """
        self.sent, self.clients = {}, {}
        msgs = []
        for node_id in self.in_key_order(node_ids):
            msg, info = self.submodel_message(node_id, server_round, MessageType.TRAIN, self.sent, config=config)
            msgs.append(msg)
            self.clients[node_id] = info
        return msgs

    def in_key_order(self, node_ids: Iterable[int]) -> list[int]:
        """``node_ids`` sorted by the clients' stable keys (node ids last, for a node not discovered).

        Not arrival order nor node ids (which the Simulation Engine draws anew each run): the float sums of the
        fold and FedRolex's order-dependent count weights then repeat from run to run.
        """
        nodes = self.registry.nodes
        return sorted(node_ids, key=lambda nid: (nid not in nodes, nodes[nid].key if nid in nodes else "", nid))

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate each reply and fold it into the round as it comes (``replies`` in the clients' key order).

        ``replies`` may be a generator (:func:`server.grid_io.ordered_replies`): each reply is taken apart,
        validated, folded and dropped before the next is asked for.
        """
        return self.train_result(self.fold_train_replies(server_round, train_parts(replies)))

    def train_result(self, metrics: list[dict[str, float]]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The round's model and its example-weighted training metrics, from the accepted replies' ``metrics``."""
        if not metrics:
            return None, None
        records = [RecordDict({P.METRICS: MetricRecord(m)}) for m in metrics]
        aggregated = aggregate_metricrecords(records, "num-examples")
        aggregated["num-examples"] = sum(m["num-examples"] for m in metrics)
        return self.to_arrays(self.x), aggregated

    def apply_train_replies(self, server_round: int, parts: list[ReplyParts]) -> list[dict[str, float]]:
        """:meth:`fold_train_replies` of replies received in any order: they are folded in the clients' key order."""
        rank = {nid: i for i, nid in enumerate(self.in_key_order({p.node_id for p in parts}))}
        return self.fold_train_replies(server_round, sorted(parts, key=lambda p: rank[p.node_id]))

    def fold_train_replies(
        self, server_round: int, parts: Iterable[ReplyParts], warm_up: bool = False
    ) -> list[dict[str, float]]:
        """Validate each reply and fold the accepted ones into ``self.x`` and the method's state, in the given order.

        Each reply is validated against what was sent and the model before the round, folded
        (:meth:`~common.methods.base.Method.round_fold`) and dropped; a rejected one is logged with its reason and
        changes nothing. With fewer than ``min-replies`` valid replies the round is skipped: ``self.x`` and the
        method's state stay as they were.

        Parameters
        ----------
        server_round : int
            The round (0: the Fisher warm-up).
        parts : Iterable[ReplyParts]
            The replies, taken apart, in the order to fold them (the clients' key order).
        warm_up : bool
            Round 0's Fisher-only replies: :meth:`~common.methods.base.Method.warm_up` takes them; the model stays.

        Returns
        -------
        The accepted replies' metrics, in fold order (empty when none was accepted or the round was skipped).
        """
        min_replies = self.cfg.min_replies
        if warm_up:
            fold: RoundFold = WarmUpFold(self.method, self.x, server_round, min_replies)
        else:
            fold = self.method.round_fold(self.x, server_round, min_replies)
        accepted: dict[int, dict[str, float]] = {}
        nodes = self.registry.nodes
        for p in parts:
            info = self.clients.get(p.node_id)
            try:
                sent = expected_sent(p, self.sent, accepted)
                reply = self.method.validate(p.records, sent, self.x)
                fold.add(Accepted(p.node_id, nodes[p.node_id].key, reply))
            except (ReplyError, ValueError) as err:
                log(WARNING, "round %d: reply from node %d rejected: %s", server_round, p.node_id, err)
                if info is not None and info.status in ("no reply",):
                    info.status = f"rejected: {err}"
                continue
            accepted[p.node_id] = reply.metrics
            note_accepted(info, p.nbytes, reply)
            del reply, p  # the fold holds what it needs of it; the arrays go now
        if 0 < len(accepted) < min_replies:
            fold.discard()
            reason = f"only {len(accepted)} valid replies, min-replies={min_replies}: round skipped"
            log(WARNING, "round %d: %s", server_round, reason)
            for node_id in accepted:
                self.clients[node_id].status = f"skipped: {reason}"
            return []
        if accepted:
            self.x = fold.finish()
        return list(accepted.values())

    # ---------------------------------------------------------------- round 0
    def fisher_warmup(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Round 0 of ``fisher-warmup``: every participant returns its Fisher at the initial model, untrained.

        Each node gets the submodel it would get in round 1 without a Fisher estimate (the method's
        fallback), measures its Fisher there (``fisher-estimator = "received"``) and replies with a zero
        update; the method folds the Fisher into its state (:meth:`~common.methods.base.Method.warm_up`)
        and round 1 ranks by it.
        """
        msgs = self.train_messages(0, self.registry.participants())
        sent = len(msgs)
        replies = ordered_replies(grid, msgs, timeout, self.cfg.poll_interval)
        del msgs
        accepted = self.fold_train_replies(0, train_parts(replies), warm_up=True)
        return {
            "replies": len(accepted),
            "sent": sent,
            "bytes_down": sum(c.bytes_down for c in self.clients.values()),
            "bytes_up": sum(c.bytes_up for c in self.clients.values()),
            "clients": [asdict(c) for c in self.clients.values()],
        }

    def trains_round_one_in_opening(self, nodes: int) -> bool:
        """Whether the opening exchange of ``nodes`` nodes also trains round 1 (:meth:`opening_discovery`).

        When the method can (:meth:`~common.methods.base.Method.opens_round_one`), every participant trains each
        round (``fraction-train = 1``), and the nodes' round-1 updates, held until the warm-up is folded, fit in
        :data:`ROUND_ONE_HOLD_BYTES`.
        """
        return (
            self.first_round == 1
            and self.method.opens_round_one()
            and self.cfg.fraction_train == 1
            and nodes * self.layout.size * 4 <= ROUND_ONE_HOLD_BYTES
        )

    def opening_discovery(self, grid: Grid, timeout: float) -> None:
        """Discovery and round 0's Fisher warm-up in one exchange (:meth:`Method.warmup_in_discovery`), and
        round 1 with them when :meth:`trains_round_one_in_opening`.

        Each QUERY carries the initial model (every node would have been sent all of it for the warm-up anyway);
        each node replies with its profile and its Fisher for the submodel it would get in round 0, which it
        builds itself (:meth:`~common.methods.masked.FisherRankedMethod.opening_received`). Replies are taken
        in node-id order as they come: each registers its node, is checked against the round-0 submodel the
        server would have sent that node (same checks as a warm-up reply, the mask digest included) and is
        folded into the method's state, as :meth:`fisher_warmup` would. A node that sends no Fisher, or one that
        fails the checks, is ranked by the prior until its first refresh. Saves one message exchange before round
        1 (a SuperNode poll and a ClientApp start per node).

        With round 1, each node also trains the round-1 submodel ranked by the Fisher it just measured, which
        it computes as the server will (:meth:`~common.methods.base.Method.round_one_received`), and adds that
        reply; the replies are held (``self.round_one``) until :meth:`run_round` folds them in the clients' key
        order, each checked against the mask the server then chooses. Saves a second exchange. The initial
        model is evaluated centrally while the nodes work.
        """
        node_ids = sorted(grid.get_node_ids())
        opening = array_record({P.VALUES: self.x})
        with_round_one = self.trains_round_one_in_opening(len(node_ids))
        content: dict[str, ArrayRecord | ConfigRecord] = {P.OPENING: opening}
        if with_round_one:
            content[P.ROUND_ONE] = ConfigRecord({"round": 1})
        msgs = [Message(RecordDict(content), dst_node_id=nid, message_type=MessageType.QUERY) for nid in node_ids]
        self.sent, self.clients = {}, {}
        held: dict[int, ReplyParts | str] = {}
        sent = 0

        def pushed() -> None:
            self.round_one_pushed = (time.time(), time.perf_counter()) if with_round_one else None
            if with_round_one:  # the nodes now train for a while: evaluate the initial model meanwhile
                self.initial_central = self.central_evaluation(0)

        def warmup_parts() -> Iterator[ReplyParts]:
            nonlocal sent
            for msg in ordered_replies(grid, msgs, timeout, self.cfg.poll_interval, on_pushed=pushed):
                node_id = int(msg.metadata.src_node_id)
                if not self.registry.profile_reply(reply_parts(msg, None, P.PROFILE, None)):
                    continue
                if node_id not in self.registry.participants():
                    continue
                # The opening mask, not mask_for: the warm-ups folded so far already make a prior, which the
                # separate warm-up's masks (all chosen before any reply) never saw.
                mask = self.method.opening_mask(self.layout, self.x, self.registry.nodes[node_id].capacity)
                info = self.note_sent(
                    node_id,
                    0,
                    (mask, "magnitude"),
                    self.method.encode(self.x, mask),
                    self.sent,
                    fisher_asked=True,
                    bytes_down=opening.count_bytes(),
                )
                info.values_bytes, info.mask_bytes, info.mask_kind = self.x.nbytes, 0, "opening"
                self.clients[node_id] = info
                sent += 1
                if with_round_one:
                    one = reply_parts(msg, P.ROUND_ONE_UPDATE, P.ROUND_ONE_METRICS, P.ROUND_ONE_META)
                    if one.arrays is None and not one.error:
                        held[node_id] = str(one.extras.get(P.ROUND_ONE_ERROR, "the reply carries no round-1 update"))
                    else:
                        held[node_id] = one
                parts = reply_parts(msg, P.UPDATE, P.METRICS, P.META)
                if parts.arrays is None and not parts.error:
                    reason = parts.extras.get(P.OPENING_ERROR, "the reply carries no Fisher")
                    log(
                        WARNING,
                        "node %d: no warm-up Fisher (%s); ranked by the prior until it reports",
                        node_id,
                        reason,
                    )
                    info.status = f"rejected: {reason}"
                    continue
                yield parts

        accepted = self.fold_train_replies(0, warmup_parts(), warm_up=True)
        self.opened = {
            "replies": len(accepted),
            "sent": sent,
            "with_discovery": True,
            "bytes_down": sum(c.bytes_down for c in self.clients.values()),
            "bytes_up": sum(c.bytes_up for c in self.clients.values()),
            "clients": [asdict(c) for c in self.clients.values()],
        }
        if with_round_one:
            self.opened["with_round_one"] = True
            self.round_one = held

    def round_one_replies(
        self,
        grid: Grid,
        held: dict[int, ReplyParts | str],
        timeout: float,
        config: ConfigRecord | None = None,
        waited: GridTime | None = None,
    ) -> list[dict[str, float]]:
        """Round 1 from the replies the opening exchange held (:meth:`opening_discovery`); returns their metrics.

        Each participant's round-1 mask is chosen now, as :meth:`train_messages` would (the warm-up is folded).
        A held reply that echoes that mask's digest is taken as it is (its entry notes no bytes down: the opening
        carried the model); a node that trained no round 1 with discovery, or another mask (its warm-up was not
        folded, so the server ranks it by the prior), is sent round 1 now, as usual. Then every reply is folded
        in the clients' key order, as a round's replies are.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid (for the nodes sent round 1 again).
        held : dict
            Node id -> its round-1 reply taken apart, or why it has none.
        timeout : float
            Seconds to wait for the replies of the nodes sent round 1 again.
        config : ConfigRecord, optional
            Sent with those TRAIN messages (``train_config``).
        waited : GridTime, optional
            Receives the seconds spent waiting for those replies.
        """
        self.sent, self.clients = {}, {}
        replies: dict[int, ReplyParts] = {}
        resend: list[Message] = []
        participants = set(self.registry.participants())
        for node_id in self.in_key_order(set(held) & participants):
            mask, source = self.node_mask(node_id, 1)
            download = self.method.encode(self.x, mask)
            got = held[node_id]
            if isinstance(got, ReplyParts) and got.meta is not None and got.meta.get("mask-digest") == download.digest:
                key = self.registry.nodes[node_id].key
                asked = self.method.fisher_request(key, 1, self.x, mask, download) is not None
                self.clients[node_id] = self.note_sent(node_id, 1, (mask, source), download, self.sent, asked, 0)
                replies[node_id] = got
                continue
            why = got if isinstance(got, str) else f"it trained another mask than the {source}-ranked one"
            log(INFO, "round 1: node %d is sent round 1 (%s)", node_id, why)
            msg, self.clients[node_id] = self.submodel_message(
                node_id, 1, MessageType.TRAIN, self.sent, (mask, source), config
            )
            resend.append(msg)
        for part in train_parts(ordered_replies(grid, resend, timeout, self.cfg.poll_interval, spent=waited)):
            replies[part.node_id] = part
        return self.fold_train_replies(1, [replies[nid] for nid in self.in_key_order(replies)])

    def opening_round(self, grid: Grid, num_rounds: int, timeout: float) -> None:
        """Round 0 of a fresh run: the method's Fisher warm-up when it asks for one (unless discovery carried it,
        :meth:`opening_discovery`), then the initial model's record."""
        warmup = self.opened
        if warmup is None and self.method.runs_warmup():
            warmup = self.fisher_warmup(grid, timeout)
        if warmup is not None:
            log(
                INFO,
                "[round 0/%d] Fisher warm-up%s: %d of %d nodes replied",
                num_rounds,
                " (with discovery)" if warmup.get("with_discovery") else "",
                warmup["replies"],
                warmup["sent"],
            )
        central = self.initial_central if self.initial_central is not None else self.central_evaluation(0)
        if not central:
            return
        log(INFO, "[round 0/%d] global acc %.4f", num_rounds, central["accuracy"])
        if self.on_round:
            registry = self.registry
            record = opening_record(central, registry.take_nodes_in(), registry.take_nodes_out(), warmup)
            if self.round_one_pushed is not None:
                record["round_one_pushed"] = self.round_one_pushed[0]
            self.on_round(record)

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
        """Train and aggregate ``server_round`` into ``result``; :meth:`complete_round` evaluates it.

        Parameters
        ----------
        grid : Grid
            The ServerApp's grid.
        server_round, num_rounds : int
            This round, and the run's last.
        timeout : float
            Seconds to wait for the round's replies.
        train_config : ConfigRecord
            Sent to every node with its TRAIN message (see :meth:`start`).
        result : Result
            Gets the round's model and training metrics.
        on_pushed : Callable, optional
            Called once the round's TRAIN messages are out, while the nodes train (the previous round's central
            evaluation, :meth:`start`).
        """
        t_round = time.perf_counter()
        held, self.round_one = self.round_one, None
        if held is not None and len(self.registry.participants()) < self.cfg.min_train_nodes:
            log(WARNING, "round 1: fewer than min-train-nodes trained with discovery; round 1 is sent again")
            held = None
        if held is not None and self.round_one_pushed is not None:
            # Round 1 went out with discovery: its replies are here, and the round began when those were pushed.
            t_round = self.round_one_pushed[1]
            t0, c0 = time.perf_counter(), time.process_time()
            waited = GridTime()
            new_arrays, train_metrics = self.train_result(
                self.round_one_replies(grid, held, timeout, train_config, waited)
            )
            server_seconds, server_cpu = -waited.seconds, -waited.cpu_seconds
        else:
            if server_round > self.first_round:
                self.registry.refresh(grid, min(timeout, 60.0))
            self.registry.await_train_nodes(grid, timeout)
            t0, c0 = time.perf_counter(), time.process_time()
            msgs = list(self.configure_train(server_round, result.arrays, train_config, grid))
            server_seconds, server_cpu = time.perf_counter() - t0, time.process_time() - c0
            # Replies are folded as they come, in the clients' key order; the seconds spent waiting for them, and
            # in ``on_pushed`` (the previous round's evaluation, beside the nodes' training, recorded as that
            # round's ``central_seconds``), are not this round's server work. The list goes with the stream, which
            # lets the submodels go once pushed.
            waited = GridTime()
            replies = ordered_replies(grid, msgs, timeout, self.cfg.poll_interval, spent=waited, on_pushed=on_pushed)
            del msgs
            t0, c0 = time.perf_counter(), time.process_time()
            new_arrays, train_metrics = self.aggregate_train(server_round, replies)
            server_seconds -= waited.seconds
            server_cpu -= waited.cpu_seconds
        if new_arrays is not None:
            result.arrays = new_arrays
        if train_metrics is not None:
            result.train_metrics_clientapp[server_round] = train_metrics
        # Before central evaluation, which may reuse what they compute (FedFIbOS' prior_influence sorts the
        # clients' Fisher, and that sort also caches the prior the level masks are ranked by).
        capacities = self.registry.capacities()
        method_entries = self.method.round_entries(self.x, capacities)
        server_seconds += time.perf_counter() - t0
        server_cpu += time.process_time() - c0
        return TrainedRound(
            server_round=server_round,
            x=self.x,
            capacities=capacities,
            clients=self.clients,
            eligible=len(self.registry.participants()),
            nodes_in=self.registry.take_nodes_in(),
            nodes_out=self.registry.take_nodes_out(),
            server_seconds=server_seconds,
            server_cpu_seconds=server_cpu,
            round_seconds=time.perf_counter() - t_round,
            trained_at=time.time(),
            method_entries=method_entries,
            evaluation_round=server_round == num_rounds
            or bool(self.cfg.eval_every and server_round % self.cfg.eval_every == 0),
        )

    def complete_round(
        self,
        done: TrainedRound,
        grid: Grid,
        timeout: float,
        evaluate_config: ConfigRecord,
        result: Result,
        overlapped: bool = False,
    ) -> dict[str, Any]:
        """Evaluate a trained round centrally (and on the nodes, on an evaluation round); returns its record.

        ``overlapped``: this runs while the next round's nodes train, so its seconds are neither the round's nor
        its server's (they are the record's ``central_seconds``, with ``central_overlapped``).
        """
        t0, c0 = time.perf_counter(), time.process_time()
        central = self.central_evaluation(
            done.server_round, trained=done.evaluation_round, x=done.x, capacities=done.capacities
        )
        central_seconds, central_cpu = time.perf_counter() - t0, time.process_time() - c0
        if central:
            result.evaluate_metrics_serverapp[done.server_round] = MetricRecord(
                {"accuracy": central["accuracy"], "loss": central["loss"]}
            )
        local = None
        if self.cfg.eval_every and done.evaluation_round:
            eval_msgs = list(self.configure_evaluate(done.server_round, result.arrays, evaluate_config, grid))
            local_metrics = self.aggregate_evaluate(
                done.server_round, exchange(grid, eval_msgs, timeout, self.cfg.poll_interval)
            )
            if local_metrics is not None:
                result.evaluate_metrics_clientapp[done.server_round] = local_metrics
                local = {"accuracy": local_metrics["eval-acc"], "loss": local_metrics["eval-loss"]}
        record = round_record(
            done.server_round,
            central=central,
            local=local,
            federated=self.take_federated(),
            clients=done.clients,
            eligible=done.eligible,
            nodes_in=done.nodes_in,
            nodes_out=done.nodes_out,
            server_seconds=done.server_seconds + (0.0 if overlapped else central_seconds),
            round_seconds=done.round_seconds + (0.0 if overlapped else time.perf_counter() - t0),
            trained_at=done.trained_at,
            method_entries=done.method_entries,
        )
        # CPU seconds beside the wall-clock ones: what the server's work would take on a machine of its own,
        # as the nodes' ``cpu_seconds`` are (on one machine, every process's wall-clock seconds share the cores).
        record["server_cpu_seconds"] = done.server_cpu_seconds + (0.0 if overlapped else central_cpu)
        record["central_seconds"] = central_seconds
        record["central_cpu_seconds"] = central_cpu
        record["central_overlapped"] = overlapped
        return record

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
        ``on_round``. A round's central evaluation runs once the next round's messages are out, while its nodes
        train (the last round, and rounds of the nodes' own evaluation, are evaluated at once): its record, and
        so its checkpoint, are made then.
        """
        self.evaluate_fn = evaluate_fn
        self.summary()
        train_config = train_config or ConfigRecord()
        evaluate_config = evaluate_config or ConfigRecord()
        result = Result(arrays=initial_arrays)
        self.x = self._flat(initial_arrays)
        fold_warmup = self.first_round == 1 and self.method.warmup_in_discovery()
        self.registry.join(grid, timeout, self.opening_discovery if fold_warmup else None)
        if self.first_round == 1:
            self.opening_round(grid, num_rounds, timeout)
        progress = RoundProgress(num_rounds)
        waiting: TrainedRound | None = None  # a round whose central evaluation waits for the next round's push

        def report(record: dict[str, Any]) -> None:
            progress.log(record)
            if self.on_round:
                self.on_round(record)

        def evaluate_waiting() -> None:
            nonlocal waiting
            if waiting is not None:
                done, waiting = waiting, None
                report(self.complete_round(done, grid, timeout, evaluate_config, result, overlapped=True))

        for server_round in range(self.first_round, num_rounds + 1):
            done = self.run_round(grid, server_round, num_rounds, timeout, train_config, result, evaluate_waiting)
            evaluate_waiting()  # a round that sent nothing (its replies came with discovery, or no node trained)
            if done.evaluation_round:
                report(self.complete_round(done, grid, timeout, evaluate_config, result))
            else:
                # Evaluated once the next round's messages are out: the server's evaluation of every capacity
                # level then overlaps the nodes' training instead of delaying the next round.
                waiting = done
        evaluate_waiting()
        return result
