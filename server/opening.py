"""The opening of a fresh run: round 0's Fisher warm-up, with discovery when the method allows it,
and round 1 carried by the same exchange.

A method that ranks round 1 by the nodes' Fisher
(:meth:`~common.methods.contract.server_side.ServerMethod.opening`) needs each node's Fisher at
the initial model first. :meth:`Opening.fisher_warmup` asks for it in an exchange of its own;
:meth:`Opening.discovery` folds it into discovery instead (each QUERY carries the initial model,
each reply the node's profile and Fisher), and, when every node trains every round, each node also
trains round 1 on the mask the server will choose, so round 1 costs no exchange either
(:meth:`Opening.round_one`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict
from logging import INFO, WARNING
from typing import Any, Protocol

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, RecordDict
from flwr.common.logger import log
from flwr.serverapp import Grid
from numpy.typing import NDArray

from common.config.run import RunConfig
from common.methods.contract.payloads import Download
from common.methods.contract.server_side import ServerMethod
from common.models.layout import ParamLayout
from common.wire import protocol as P
from common.wire.validation import SentSubmodel
from server.grid_io import GridTime, ordered_replies
from server.replies import ReplyParts, reply_parts, train_parts
from server.strategy_core.base import array_record
from server.strategy_core.node_registry import NodeRegistry
from server.strategy_core.round_plan import TrainPlan
from server.strategy_core.round_records import ClientRound, opening_record


class RoundStrategy(Protocol):
    """What the opening asks of the synchronous strategy
    (:class:`server.strategy.SubmodelStrategy`)."""

    cfg: RunConfig
    layout: ParamLayout
    method: ServerMethod
    registry: NodeRegistry
    x: NDArray[np.float32]
    first_round: int
    on_round: Callable[[dict[str, Any]], None] | None

    def plan_train(
        self,
        server_round: int,
        x: NDArray[np.float32],
        node_ids: Iterable[int],
        config: ConfigRecord | None = None,
    ) -> TrainPlan: ...

    def fold_train_replies(
        self, plan: TrainPlan, parts: Iterable[ReplyParts], warm_up: bool = False
    ) -> list[dict[str, float]]: ...

    def central_evaluation(self, server_round: int) -> dict[str, Any]: ...

    def node_mask(
        self, node_id: int, server_round: int, x: NDArray[np.float32] | None = None
    ) -> tuple[NDArray[np.bool_], str]: ...

    def note_sent(
        self,
        node_id: int,
        server_round: int,
        mask_and_source: tuple[NDArray[np.bool_], str],
        download: Download,
        store: dict[int, SentSubmodel],
        fisher_asked: bool,
        bytes_down: int,
    ) -> ClientRound: ...

    def submodel_message(
        self,
        node_id: int,
        server_round: int,
        message_type: str,
        store: dict[int, SentSubmodel],
        mask_and_source: tuple[NDArray[np.bool_], str] | None = None,
        config: ConfigRecord | None = None,
        x: NDArray[np.float32] | None = None,
    ) -> tuple[Message, ClientRound]: ...


#: Bytes of round-1 updates the opening exchange may hold until the warm-up is folded (``nodes x d x
#: 4``): above it, round 1 is an exchange of its own, whose replies are folded as they come.
ROUND_ONE_HOLD_BYTES = 1 << 30


def warmup_summary(plan: TrainPlan, replies: int, sent: int, **flags: bool) -> dict[str, Any]:
    """Round 0's entry of the opening record: replies folded, nodes sent, ``flags``, bytes and each
    client's entry."""
    return {
        "replies": replies,
        "sent": sent,
        **flags,
        "bytes_down": sum(c.bytes_down for c in plan.clients.values()),
        "bytes_up": sum(c.bytes_up for c in plan.clients.values()),
        "clients": [asdict(c) for c in plan.clients.values()],
    }


class Opening:
    """Round 0 of a fresh run and, when discovery carried it, round 1's replies until round 1 folds
    them.

    Parameters
    ----------
    strategy : RoundStrategy
        The strategy whose nodes, method and folds the opening uses.
    """

    def __init__(self, strategy: RoundStrategy) -> None:
        self.strategy = strategy
        self.warmup: dict[str, Any] | None = (
            None  # the warm-up discovery folded, for round 0's record
        )
        self.held: dict[int, ReplyParts | str] | None = (
            None  # round-1 replies held for :meth:`round_one`
        )
        self.pushed_at: tuple[float, float] | None = (
            None  # Unix and perf_counter time round 1 went out
        )
        self.initial_central: dict[str, Any] | None = (
            None  # the initial model's evaluation, made meanwhile
        )

    def trains_round_one(self, nodes: int) -> bool:
        """Whether the opening exchange of ``nodes`` nodes also trains round 1 (:meth:`discovery`).

        When the method can
        (:meth:`~common.methods.contract.server_side.ServerMethod.opening`), every
        participant trains each round (``fraction-train = 1``), and the nodes' round-1 updates, held
        until the warm-up is folded, fit in :data:`ROUND_ONE_HOLD_BYTES`.
        """
        s = self.strategy
        return (
            s.first_round == 1
            and s.method.opening() == "discovery+round-one"
            and s.cfg.fraction_train == 1
            and nodes * s.layout.size * 4 <= ROUND_ONE_HOLD_BYTES
        )

    def fisher_warmup(self, grid: Grid, timeout: float) -> dict[str, Any]:
        """Round 0 of ``fisher-warmup``: every participant returns its Fisher at the initial model,
        untrained.

        Each node gets the submodel it would get in round 1 without a Fisher estimate (the method's
        fallback), measures its Fisher there (``fisher-estimator = "received"``) and replies with a
        zero update; the method folds the Fisher into its state
        (:meth:`~common.methods.contract.server_side.ServerMethod.warm_up`) and round 1 ranks by it.
        """
        s = self.strategy
        plan = s.plan_train(0, s.x, s.registry.participants())
        sent = len(plan)
        replies = ordered_replies(grid, plan.take_messages(), timeout, s.cfg.poll_interval)
        accepted = s.fold_train_replies(plan, train_parts(replies), warm_up=True)
        return warmup_summary(plan, len(accepted), sent)

    def discovery(self, grid: Grid, timeout: float) -> None:
        """Discovery and round 0's Fisher warm-up in one exchange
        (:meth:`ServerMethod.opening` ``discovery``), and round 1 with them when
        :meth:`trains_round_one`.

        Each QUERY carries the initial model (every node would have been sent all of it for the
        warm-up anyway); each node replies with its profile and its Fisher for the submodel it would
        get in round 0, which it builds itself
        (:meth:`~common.methods.masked.FisherRankedMethod.opening_received`). Replies are taken in
        node-id order as they come: each registers its node, is checked against the round-0 submodel
        the server would have sent that node (same checks as a warm-up reply, the mask digest
        included) and is folded into the method's state, as :meth:`fisher_warmup` would. A node that
        sends no Fisher, or one that fails the checks, is ranked by the prior until its first
        refresh. Saves one message exchange before round 1 (a SuperNode poll and a ClientApp start
        per node).

        With round 1, each node also trains the round-1 submodel ranked by the Fisher it just
        measured, which it computes as the server will
        (:meth:`~common.methods.contract.client_side.ClientMethod.round_one_received`), and adds
        that reply; the replies are held until :meth:`round_one` folds them in the clients' key
        order, each checked against the mask the server then chooses. Saves a second exchange. The
        initial model is evaluated centrally while the nodes work.
        """
        s = self.strategy
        node_ids = sorted(grid.get_node_ids())
        opening = array_record({P.VALUES: s.x})
        with_round_one = self.trains_round_one(len(node_ids))
        content: dict[str, ArrayRecord | ConfigRecord] = {P.OPENING: opening}
        if with_round_one:
            content[P.ROUND_ONE] = ConfigRecord({"round": 1})
        msgs = [
            Message(RecordDict(content), dst_node_id=nid, message_type=MessageType.QUERY)
            for nid in node_ids
        ]
        plan = TrainPlan(0, s.x)
        held: dict[int, ReplyParts | str] = {}

        def pushed() -> None:
            self.pushed_at = (time.time(), time.perf_counter()) if with_round_one else None
            if (
                with_round_one
            ):  # the nodes now train for a while: evaluate the initial model meanwhile
                self.initial_central = s.central_evaluation(0)

        replies = ordered_replies(grid, msgs, timeout, s.cfg.poll_interval, on_pushed=pushed)
        parts = self.warmup_parts(
            replies, plan, opening.count_bytes(), held if with_round_one else None
        )
        accepted = s.fold_train_replies(plan, parts, warm_up=True)
        self.warmup = warmup_summary(plan, len(accepted), len(plan.clients), with_discovery=True)
        if with_round_one:
            self.warmup["with_round_one"] = True
            self.held = held

    def warmup_parts(
        self,
        replies: Iterator[Message],
        plan: TrainPlan,
        bytes_down: int,
        held: dict[int, ReplyParts | str] | None,
    ) -> Iterator[ReplyParts]:
        """The warm-up replies of :meth:`discovery` to fold, each noted in ``plan`` as sent its
        opening mask.

        Parameters
        ----------
        replies : Iterator[Message]
            The discovery replies, in node-id order.
        plan : TrainPlan
            Round 0's plan: each participant's entry and the submodel its Fisher is checked against.
        bytes_down : int
            Bytes of the opening record each node received.
        held : dict, optional
            Receives each participant's round-1 reply taken apart, or why it has none (``None``: no
            round 1).
        """
        s = self.strategy
        for msg in replies:
            node_id = int(msg.metadata.src_node_id)
            if not s.registry.profile_reply(reply_parts(msg, None, P.PROFILE, None)):
                continue
            if node_id not in s.registry.participants():
                continue
            info = self.note_opening(plan, node_id, bytes_down)
            if held is not None:
                held[node_id] = self.round_one_part(msg)
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

    def note_opening(self, plan: TrainPlan, node_id: int, bytes_down: int) -> ClientRound:
        """Note in ``plan`` that ``node_id`` was sent the whole initial model and builds its opening
        mask."""
        s = self.strategy
        # The opening mask, not mask_for: the warm-ups folded so far already make a prior, which the
        # separate warm-up's masks (all chosen before any reply) never saw.
        mask = s.method.opening_mask(s.layout, s.x, s.registry.nodes[node_id].capacity)
        download = s.method.encode(s.x, mask)
        info = s.note_sent(
            node_id,
            0,
            (mask, "magnitude"),
            download,
            plan.sent,
            fisher_asked=True,
            bytes_down=bytes_down,
        )
        info.values_bytes, info.mask_bytes, info.mask_kind = s.x.nbytes, 0, "opening"
        plan.clients[node_id] = info
        return info

    @staticmethod
    def round_one_part(msg: Message) -> ReplyParts | str:
        """A discovery reply's round-1 update taken apart, or why it carries none."""
        one = reply_parts(msg, P.ROUND_ONE_UPDATE, P.ROUND_ONE_METRICS, P.ROUND_ONE_META)
        if one.arrays is None and not one.error:
            return str(one.extras.get(P.ROUND_ONE_ERROR, "the reply carries no round-1 update"))
        return one

    def round_zero(self, grid: Grid, num_rounds: int, timeout: float) -> None:
        """Round 0 of a fresh run: the method's Fisher warm-up when it asks for one (unless
        discovery carried it, :meth:`discovery`), then the initial model's record."""
        s = self.strategy
        warmup = self.warmup
        if warmup is None and s.method.opening() != "none":
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
        central = (
            self.initial_central if self.initial_central is not None else s.central_evaluation(0)
        )
        if not central:
            return
        log(INFO, "[round 0/%d] global acc %.4f", num_rounds, central["accuracy"])
        if s.on_round:
            registry = s.registry
            record = opening_record(
                central, registry.take_nodes_in(), registry.take_nodes_out(), warmup
            )
            if self.pushed_at is not None:
                record["round_one_pushed"] = self.pushed_at[0]
            s.on_round(record)

    def take_round_one(self) -> dict[int, ReplyParts | str] | None:
        """Round 1's replies held since discovery (once; ``None`` when it carried none, or too few
        nodes train)."""
        held, self.held = self.held, None
        if (
            held is not None
            and len(self.strategy.registry.participants()) < self.strategy.cfg.min_train_nodes
        ):
            log(
                WARNING,
                "round 1: fewer than min-train-nodes trained with discovery; round 1 is sent again",
            )
            return None
        return held if self.pushed_at is not None else None

    def round_one(
        self,
        grid: Grid,
        held: dict[int, ReplyParts | str],
        timeout: float,
        config: ConfigRecord | None = None,
        waited: GridTime | None = None,
    ) -> tuple[TrainPlan, list[dict[str, float]]]:
        """Round 1 from the replies discovery held: the round's plan and the accepted replies'
        metrics.

        Each participant's round-1 mask is chosen now, as :meth:`SubmodelStrategy.plan_train` would
        (the warm-up is folded). A held reply that echoes that mask's digest is taken as it is (its
        entry notes no bytes down: the opening carried the model); a node that trained no round 1
        with discovery, or another mask (its warm-up was not folded, so the server ranks it by the
        prior), is sent round 1 now, as usual. Then every reply is folded in the clients' key order,
        as a round's replies are.

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
        s = self.strategy
        plan = TrainPlan(1, s.x)
        replies: dict[int, ReplyParts] = {}
        resend: list[Message] = []
        for node_id in s.registry.in_key_order(set(held) & set(s.registry.participants())):
            got = self.matching_reply(plan, node_id, held[node_id], config, resend)
            if got is not None:
                replies[node_id] = got
        for part in train_parts(
            ordered_replies(grid, resend, timeout, s.cfg.poll_interval, spent=waited)
        ):
            replies[part.node_id] = part
        return plan, s.fold_train_replies(
            plan, [replies[nid] for nid in s.registry.in_key_order(replies)]
        )

    def matching_reply(
        self,
        plan: TrainPlan,
        node_id: int,
        got: ReplyParts | str,
        config: ConfigRecord | None,
        resend: list[Message],
    ) -> ReplyParts | None:
        """A held round-1 reply when it trained the mask the server now chooses; else ``node_id`` is
        sent round 1 again (its message appended to ``resend``) and ``None`` is returned. Either way
        the node's entry and submodel are noted in ``plan``."""
        s = self.strategy
        mask, source = s.node_mask(node_id, 1, plan.x)
        download = s.method.encode(plan.x, mask)
        if (
            isinstance(got, ReplyParts)
            and got.meta is not None
            and got.meta.get("mask-digest") == download.digest
        ):
            key = s.registry.nodes[node_id].key
            asked = s.method.fisher_request(key, 1, plan.x, mask, download) is not None
            plan.clients[node_id] = s.note_sent(
                node_id, 1, (mask, source), download, plan.sent, asked, 0
            )
            return got
        why = (
            got if isinstance(got, str) else f"it trained another mask than the {source}-ranked one"
        )
        log(INFO, "round 1: node %d is sent round 1 (%s)", node_id, why)
        msg, plan.clients[node_id] = s.submodel_message(
            node_id, 1, MessageType.TRAIN, plan.sent, (mask, source), config, plan.x
        )
        resend.append(msg)
        return None
