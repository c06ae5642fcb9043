"""A round's replies validated and folded one at a time, in the order given; a bad one changes
nothing.

The synchronous strategy (:meth:`server.strategy.SubmodelStrategy.fold_train_replies`) hands each
round's replies, taken apart, to :func:`fold_replies`: each is checked against what the round sent
and the model it started from, folded into the method's
:class:`~common.methods.round_fold.RoundFold` and dropped. A rejected reply is logged with its
reason; a round with fewer than ``min-replies`` valid replies is skipped whole.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from logging import WARNING

from flwr.common.logger import log

from common.methods.contract.server_side import ServerMethod
from common.methods.round_fold import Accepted, RoundFold
from common.wire.validation import ReplyError
from server.replies import ReplyParts, expected_sent
from server.strategy_core.node_registry import NodeProfile
from server.strategy_core.round_plan import TrainPlan
from server.strategy_core.round_records import note_accepted


def fold_replies(
    method: ServerMethod,
    nodes: Mapping[int, NodeProfile],
    plan: TrainPlan,
    parts: Iterable[ReplyParts],
    fold: RoundFold,
    min_replies: int,
) -> list[dict[str, float]]:
    """Validate each reply against ``plan`` and add the accepted ones to ``fold``; their metrics.

    Parameters
    ----------
    method : ServerMethod
        The run's method (it validates and decodes its replies).
    nodes : Mapping[int, NodeProfile]
        The discovered nodes, by node id (a reply is folded under its client's stable key).
    plan : TrainPlan
        What the round sent; each client's entry notes its reply (bytes, status).
    parts : Iterable[ReplyParts]
        The replies, taken apart, in the order to fold them (the clients' key order).
    fold : RoundFold
        The round's fold; discarded when the round is skipped, left to the caller to finish
        otherwise.
    min_replies : int
        Valid replies the round needs (``min-replies``).

    Returns
    -------
    The accepted replies' metrics, in fold order; empty when none was accepted or the round was
    skipped.
    """
    accepted: dict[int, dict[str, float]] = {}
    for p in parts:
        info = plan.clients.get(p.node_id)
        try:
            sent = expected_sent(p, plan.sent, accepted)
            reply = method.validate(p.records, sent, plan.x)
            fold.add(Accepted(p.node_id, nodes[p.node_id].key, reply))
        except (ReplyError, ValueError) as err:
            log(
                WARNING,
                "round %d: reply from node %d rejected: %s",
                plan.server_round,
                p.node_id,
                err,
            )
            if info is not None and info.status in ("no reply",):
                info.status = f"rejected: {err}"
            continue
        accepted[p.node_id] = reply.metrics
        note_accepted(info, p.nbytes, reply)
        del reply, p  # the fold holds what it needs of it; the arrays go now
    if 0 < len(accepted) < min_replies:
        fold.discard()
        reason = f"only {len(accepted)} valid replies, min-replies={min_replies}: round skipped"
        log(WARNING, "round %d: %s", plan.server_round, reason)
        for node_id in accepted:
            plan.clients[node_id].status = f"skipped: {reason}"
        return []
    return list(accepted.values())
